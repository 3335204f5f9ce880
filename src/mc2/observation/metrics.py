"""The measurement vocabulary (``docs/profiling.md``), as plain functions of measured seconds.

* ``T_serial``: step time of the serial path (K = 1, synchronous); ``T_comm``: its communication
  time; ``T_comp = T_serial - T_comm``.
* comm share: exposed communication / step time.
* ``T_ideal = max(T_comp, T_comm)``: the best overlap can do.
* hidden fraction: ``(T_serial - T_mc2) / (T_serial - T_ideal)``.
* speedup: ``T_serial / T_mc2``; overlap alone is bounded by ``1 / (1 - comm share)``.
"""

from __future__ import annotations

import math
import statistics
from typing import Iterable


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else math.nan


def comm_share(exposed_comm_s: float, step_s: float) -> float:
    return exposed_comm_s / step_s if step_s > 0 else math.nan


def speedup(t_serial: float, t_mc2: float) -> float:
    return t_serial / t_mc2 if t_mc2 > 0 else math.nan


def ideal_step(t_serial: float, t_comm: float) -> float:
    """``max(T_comp, T_comm)``: the step time if communication hid perfectly."""
    return max(t_serial - t_comm, t_comm)


def hidden_fraction(t_serial: float, t_comm: float, t_mc2: float) -> float:
    """Share of the hideable time that was hidden (1 = perfect overlap, <0 = slower than serial)."""
    hideable = t_serial - ideal_step(t_serial, t_comm)
    return (t_serial - t_mc2) / hideable if hideable > 0 else math.nan


def overlap_bound(comm_share_serial: float) -> float:
    """The largest speedup overlap alone can give: ``1 / (1 - comm share)``."""
    return 1.0 / (1.0 - comm_share_serial) if comm_share_serial < 1 else math.inf
