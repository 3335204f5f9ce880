"""The time of one overlapped pass, from each micro-batch's compute and transfer times.

One formula for both cost models, the planner's (:mod:`mc2.engine.decide.planner`, measured constants) and the
simulator's (:mod:`mc2.sim.model`, hardware presets), so that what they predict follows the
schedule :mod:`mc2.engine.passes.pipeline` really runs:

* the first dispatch is the fill: nothing computes before it arrives, except local work (shared
  experts), which runs under it (in the forward half of it, the other half under the drain:
  :mod:`mc2.engine.passes.shared_experts`);
* while micro-batch ``i`` computes, two transfers travel: dispatch ``i+1`` and combine ``i-1``
  (one at either end); what they take beyond the compute is a stall;
* while a transfer runs under compute, compute slows by ``interference`` times the overlap;
* the last combine is the drain.

The micro-batches need not be equal (:func:`mc2.engine.decide.routing.micro_batch_weights` tapers the ends).
"""

from __future__ import annotations

from typing import Sequence

FORWARD_SHARE = 1 / 3  # 3 of the 9 expert GEMMs run in the forward


def overlapped_pass(compute: Sequence[float], transfer: Sequence[float], *, local: float = 0.0,
                    drain: float = 0.0, interference: float = 0.0) -> tuple[float, float]:
    """``(pass seconds, exposed communication seconds)`` of one overlapped pass.

    Args:
        compute: seconds of compute of each micro-batch.
        transfer: seconds of one transfer (dispatch or combine) of each micro-batch.
        local: work that needs no communication, run under the first dispatch.
        drain: such work run under the last combine.
        interference: compute slowdown per second of concurrent transfer.
    """
    k = len(compute)
    head = max(0.0, transfer[0] - local)
    total, exposed = local + head, head
    for i, c in enumerate(compute):
        load = (transfer[i + 1] if i + 1 < k else 0.0) + (transfer[i - 1] if i >= 1 else 0.0)
        stall = max(0.0, load - c)
        total += c + stall + interference * min(load, c)
        exposed += stall
    tail = max(0.0, transfer[-1] - drain)
    return total + drain + tail, exposed + tail


def serial_pass(compute: Sequence[float], transfer: Sequence[float], *, local: float = 0.0
                ) -> tuple[float, float]:
    """``(pass seconds, exposed communication seconds)`` when nothing overlaps."""
    comm = 2 * sum(transfer)
    return local + sum(compute) + comm, comm


def training_step(compute: Sequence[float], transfer: Sequence[float], *, overlap: bool,
                  local: float = 0.0, interference: float = 0.0) -> tuple[float, float]:
    """``(seconds, exposed communication seconds)`` of a forward plus a backward pass.

    ``compute`` and ``local`` are forward + backward totals; the forward takes
    :data:`FORWARD_SHARE` of them. Each pass moves every micro-batch's rows twice.
    """
    total = exposed = 0.0
    for share in (FORWARD_SHARE, 1 - FORWARD_SHARE):
        c = [share * t for t in compute]
        if overlap:
            # the forward's shared experts: half under the fill, half under the drain
            fill = share * local / (2 if share == FORWARD_SHARE else 1)
            pass_s, pass_exposed = overlapped_pass(c, transfer, local=fill,
                                                   drain=share * local - fill,
                                                   interference=interference)
        else:
            pass_s, pass_exposed = serial_pass(c, transfer, local=share * local)
        total += pass_s
        exposed += pass_exposed
    return total, exposed
