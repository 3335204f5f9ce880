"""The scheduler: orders dispatch / compute / combine of the micro-batches; owns no math.

The same loop serves the forward (tokens out, expert outputs back) and the backward (output
gradients out, input gradients back): the backward's traffic follows the forward's routes, so a
:class:`~mc2.engine.routing.DispatchHandle` plus three callbacks describe either pass.

Overlapped schedule (``overlap=True``), as issued on every rank in the same order::

    dispatch(0)
    for i in 0..K-1:
        dispatch(i+1)            # in flight while i computes (i == 0 without local work:
                                 #   issued after dispatch(0) has arrived, see below)
        local()                  # once, i == 0: shared experts under the first dispatch
        wait dispatch(i); compute(i)
        combine(i)               # in flight while i+1 computes
        deferred(i)              # e.g. weight gradients, while combine(i) travels
        wait combine(i-1); receive(i-1)
    wait combine(K-1); receive(K-1)

The first dispatch is the pipeline's fill: nothing computes until it arrives. On a backend that
runs two collectives at once (Gloo's worker threads) a second dispatch issued right away would
share the link with it and make the fill last twice as long. So when there is no local work to
run under it, the second dispatch is prepared (gathered, encoded) while the first travels and
issued as soon as the first has arrived, to travel under micro-batch 0's compute.

Serial schedule (``overlap=False``): each collective is synchronous, nothing overlaps.

Waits (:mod:`mc2.engine.comm`): on a host backend (Gloo) a wait blocks the caller until the rows
are there; on a stream backend (NCCL, HCCL) it makes the compute stream wait and returns at once,
so the host queues the whole schedule ahead of the device and the same order plays out on the
streams. If a step raises mid-pass, the transfers still in flight are waited for before their
buffers can be reused (after a timeout they are kept alive instead: the group is unusable).

Wire formats (:mod:`mc2.engine.wire`): each pass's first exchange (dispatch) encodes its rows with
``wire[0]``, its second (combine) with ``wire[1]``; rows are encoded on the way out and decoded
right after the wait, so the compute steps only ever see compute-dtype rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
from torch import Tensor

from ..observation.timeline import Timeline, maybe_span
from .comm import PendingTransfer, abandon
from .deadline import CommTimeout
from .watchdog import check as check_deadlines
from .routing import DispatchHandle
from .wire import NONE, WireFormat
from .workspace import Workspace


@dataclass
class _Encoded:
    """A transfer of encoded rows; ``wait()`` decodes them."""

    pending: PendingTransfer
    fmt: WireFormat
    hidden: int
    dtype: torch.dtype
    workspace: Workspace | None = None

    def wait(self, *, micro_batch: int | None = None, phase: str | None = None) -> Tensor:
        data = self.pending.wait(micro_batch=micro_batch, phase=phase)
        return self.fmt.decode(data, self.hidden, self.dtype, self.workspace)


Pending = PendingTransfer | _Encoded


def _release(pending: list[Pending], *, wait: bool) -> None:
    """Transfers left in flight when a pass raises: wait for them before their buffers go
    back to the workspace (or, after a timeout, keep them alive for good)."""
    for transfer in pending:
        if not wait:
            abandon(transfer)
            continue
        try:
            transfer.wait()
        except BaseException:  # noqa: BLE001 - the original error is the one to raise
            abandon(transfer)


@dataclass(frozen=True)
class PipelineSteps:
    """The three pieces of per-micro-batch work the scheduler interleaves with communication.

    Attributes:
        gather: ``i -> [n_i, H]`` rows to send for micro-batch ``i``, grouped by destination.
        compute: ``(i, received [r_i, H]) -> [r_i, H]`` rows to send back, in receive order.
        scatter: ``(i, returned [n_i, H]) -> None`` consumes the rows that came back.
        deferred: ``i -> None`` work of micro-batch ``i`` that nothing sent depends on (the
            backward's weight gradients); run after ``i``'s combine is on the wire, so it fills
            time that would otherwise be spent waiting.
        local: work that needs no communication at all (shared experts); run while the first
            dispatch is in flight.
    """

    gather: Callable[[int], Tensor]
    compute: Callable[[int, Tensor], Tensor]
    scatter: Callable[[int, Tensor], None]
    deferred: Callable[[int], None] | None = None
    local: Callable[[], None] | None = None


def run_pipeline(
    handle: DispatchHandle,
    steps: PipelineSteps,
    *,
    overlap: bool,
    phase: str,
    timeline: Timeline | None = None,
    wire: tuple[WireFormat, WireFormat] = (NONE, NONE),
    workspace: Workspace | None = None,
) -> None:
    """Run every micro-batch of ``handle`` through dispatch -> compute -> combine."""
    routes = handle.micro_batches

    def gather(i: int) -> Tensor:
        with maybe_span(timeline, "compute", "gather", phase, i):
            return steps.gather(i)

    def in_flight(name: str, i: int) -> Callable[[Any, Any], None] | None:
        if timeline is None:
            return None
        return lambda start, end: timeline.add("transfer", name, phase, i, start, end)

    def prepare(i: int, rows: Tensor, direction: int) -> Callable[[bool], Pending]:
        """Encode ``rows`` now; the returned function issues their transfer."""
        fmt = wire[direction]
        name = ("dispatch", "combine")[direction]
        start = (routes[i].exchange.dispatch, routes[i].exchange.combine)[direction]
        if fmt.kind is None:
            return lambda async_op: start(rows, async_op=async_op, on_complete=in_flight(name, i))
        with maybe_span(timeline, "compute", "encode", phase, i):
            data = fmt.encode(rows, workspace)

        def issue(async_op: bool) -> _Encoded:
            pending = start(data, async_op=async_op, on_complete=in_flight(name, i))
            return _Encoded(pending, fmt, rows.shape[-1], rows.dtype, workspace)
        return issue

    def send(i: int, rows: Tensor, async_op: bool) -> Pending:
        return prepare(i, rows, 0)(async_op)

    def combine(i: int, rows: Tensor, async_op: bool) -> Pending:
        return prepare(i, rows, 1)(async_op)

    def compute(i: int, received: Tensor) -> Tensor:
        with maybe_span(timeline, "compute", "experts", phase, i):
            return steps.compute(i, received)

    def scatter(i: int, returned: Tensor) -> None:
        with maybe_span(timeline, "compute", "scatter", phase, i):
            steps.scatter(i, returned)

    def deferred(i: int) -> None:
        if steps.deferred is not None:
            with maybe_span(timeline, "compute", "deferred", phase, i):
                steps.deferred(i)

    def waited(pending: Callable[[], Pending], name: str, i: int) -> Tensor:
        """``pending().wait()``, a timeout told which micro-batch and phase it hit; a transfer
        whose wait failed is kept alive (its buffers may still be in use)."""
        transfer = pending()
        try:
            return transfer.wait(micro_batch=i, phase=phase)
        except CommTimeout as exc:
            abandon(transfer)
            raise exc.at(operation=name, micro_batch=i, phase=phase) from exc.__cause__
        except BaseException:
            abandon(transfer)
            raise

    def local() -> None:
        if steps.local is not None:
            with maybe_span(timeline, "compute", "local", phase):
                steps.local()

    if not overlap:
        local()
        for i in range(len(routes)):
            rows = gather(i)
            with maybe_span(timeline, "comm", "dispatch", phase, i):
                received = waited(partial(send, i, rows, async_op=False), "dispatch", i)
            out = compute(i, received)
            with maybe_span(timeline, "comm", "combine", phase, i):
                returned = waited(partial(combine, i, out, async_op=False), "combine", i)
            scatter(i, returned)
            deferred(i)
        check_deadlines()
        return

    dispatches: dict[int, Pending] = {}
    combines: dict[int, Pending] = {}
    try:
        _overlapped(len(routes), dispatches, combines, gather=gather, prepare=prepare, send=send,
                    combine=combine, compute=compute, scatter=scatter, deferred=deferred,
                    local=local, waited=waited, first_alone=steps.local is None,
                    timeline=timeline, phase=phase)
    except BaseException as exc:
        _release([*dispatches.values(), *combines.values()],
                 wait=not isinstance(exc, CommTimeout))
        raise
    check_deadlines()


def _overlapped(k: int, dispatches: dict[int, Pending], combines: dict[int, Pending], *,
                gather: Callable, prepare: Callable, send: Callable, combine: Callable,
                compute: Callable, scatter: Callable, deferred: Callable, local: Callable,
                waited: Callable, first_alone: bool, timeline: Timeline | None,
                phase: str) -> None:
    """The overlapped schedule of the module docstring; in-flight transfers stay in
    ``dispatches`` and ``combines`` until waited, so a caller can release them on an error."""
    dispatches[0] = send(0, gather(0), async_op=True)
    # without local work the fill gets the link to itself (module docstring)
    for i in range(k):
        issue_next = prepare(i + 1, gather(i + 1), 0) if i + 1 < k else None
        if issue_next is not None and not (i == 0 and first_alone):
            dispatches[i + 1], issue_next = issue_next(True), None
        if i == 0:
            local()
        with maybe_span(timeline, "wait", "dispatch", phase, i):
            received = waited(partial(dispatches.pop, i), "dispatch", i)
        if issue_next is not None:
            dispatches[i + 1] = issue_next(True)
        combines[i] = combine(i, compute(i, received), async_op=True)
        deferred(i)
        if i >= 1:
            with maybe_span(timeline, "wait", "combine", phase, i - 1):
                returned = waited(partial(combines.pop, i - 1), "combine", i - 1)
            scatter(i - 1, returned)
    last = k - 1
    with maybe_span(timeline, "wait", "combine", phase, last):
        returned = waited(partial(combines.pop, last), "combine", last)
    scatter(last, returned)
