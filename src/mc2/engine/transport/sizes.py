"""Sizes that are close share one bucket: a power of two split in 16 steps.

Routing changes the row counts a little from step to step. A buffer sized for one step should
serve the next (:mod:`mc2.engine.transport.workspace`), and a decision made for one token count should
hold for its neighbours (:mod:`mc2.engine.decide.planner`), so both round sizes up to the next of 16
steps between consecutive powers of two (at most 1/16 more than asked).
"""

from __future__ import annotations


def bucket(n: int) -> int:
    """``n`` rounded up to a multiple of 1/16 of its power of two (``n`` itself below 32)."""
    step = max(1, 1 << max(0, n.bit_length() - 5))
    return -(-n // step) * step
