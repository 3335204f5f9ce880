"""The scheduler: orders dispatch / compute / combine of the micro-batches; owns no math.

The same loop serves the forward (tokens out, expert outputs back) and the backward (output
gradients out, input gradients back): the backward's traffic follows the forward's routes, so a
:class:`~mc2.engine.decide.routing.DispatchHandle` plus three callbacks describe either pass.

Overlapped schedule (``overlap=True``), as issued on every rank in the same order::

    dispatch(0)
    for i in 0..K-1:
        dispatch(i+1)            # in flight while i computes (i == 0 without local work:
                                 #   issued after dispatch(0) has arrived, see below)
        local()                  # once, i == 0: shared experts (half) under the first dispatch
        wait dispatch(i); compute(i)
        combine(i)               # in flight while i+1 computes
        drain()                  # once, i == K-1: the forward's other half of the shared
                                 #   experts, under the last combine
        deferred(i)              # e.g. weight gradients, while combine(i) travels (after
                                 #   the next stop, see _Pass.overlapped)
        wait combine(i-1); receive(i-1)
    wait combine(K-1); receive(K-1)

The first dispatch is the pipeline's fill: nothing computes until it arrives. On a backend that
runs two collectives at once (Gloo's worker threads) a second dispatch issued right away would
share the link with it and make the fill last twice as long. So when there is no local work to
run under it, the second dispatch is prepared (gathered, encoded) while the first travels and
issued as soon as the first has arrived, to travel under micro-batch 0's compute.

Serial schedule (``overlap=False``): each collective is synchronous, nothing overlaps.

Waits (:mod:`mc2.engine.transport.comm`): on a host backend (Gloo) a wait blocks the caller until the rows
are there; on a stream backend (NCCL, HCCL) it makes the compute stream wait and returns at once,
so the host queues the whole schedule ahead of the device and the same order plays out on the
streams. If a step raises mid-pass, the transfers still in flight are waited for before their
buffers can be reused (after a timeout they are kept alive instead: the group is unusable).

Wire formats (:mod:`mc2.engine.transport.wire`): each pass's first exchange (dispatch) encodes its rows with
``wire.dispatch``, its second (combine) with ``wire.combine``; rows are encoded on the way out and decoded
right after the wait, so the compute steps only ever see compute-dtype rows.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from mc2.device import streams
from mc2.observation.timeline import SpanKind, Timeline, maybe_span
from mc2.engine.transport.comm import PendingTransfer, abandon
from mc2.engine.transport.deadline import Abandoned, CommTimeout
from mc2.engine.transport.watchdog import check as check_deadlines
from mc2.engine.decide.routing import DispatchHandle
from mc2.engine.transport.wire import WireFormat, WirePair
from mc2.engine.transport.workspace import Workspace


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
            dispatch is in flight (the pipeline's fill, when nothing else can compute).
        drain: more such work, run while the last combine is in flight (the drain).
    """

    gather: Callable[[int], Tensor]
    compute: Callable[[int, Tensor], Tensor]
    scatter: Callable[[int, Tensor], None]
    deferred: Callable[[int], None] | None = None
    local: Callable[[], None] | None = None
    drain: Callable[[], None] | None = None


class PassSchedule:
    """One pass's schedule as three plain steps its caller runs in order: :meth:`begin` (up
    to the first dispatch's wait), :meth:`experts` (up to the first combine's wait) and
    :meth:`end`. Between them the first transfers are in flight, and a caller may run other
    work there: batch overlap (:mod:`mc2.engine.autograd.staged`) computes the other
    micro-batch, a paired backward another micro-batch's forward (also at the waits inside
    the steps: :meth:`between_waits`); the in-layer call runs the three back to back. The
    serial schedule runs whole in :meth:`begin`. Transfers in flight are released when a
    step raises. Inside a graph capture no span is recorded: it would time the capture, not
    the replays."""

    def __init__(self, call: Any, steps: PipelineSteps, phase: str, device: torch.device) -> None:
        timeline = None if streams.capturing(device) else call.timeline
        self._pass = _Pass(call.handle, steps, phase, timeline, call.wire, call.workspace)
        self._overlap = call.overlap

    def begin(self) -> None:
        if not self._overlap:
            self._pass.serial()
            check_deadlines()
            return
        with self._released():
            self._pass.fill()

    def experts(self) -> None:
        if self._overlap:
            with self._released():
                self._pass.first_experts()

    def end(self) -> None:
        if self._overlap:
            with self._released():
                self._pass.rest()
                check_deadlines()

    def between_waits(self, work: Callable[[], None]) -> None:
        """``work()`` also before each later wait inside a step (the second micro-batch's
        dispatch, each combine after the first): a paired schedule hands over there too, so
        the other micro-batch computes while that transfer travels. Measured on the
        Mixtral-shaped model at 200 Mbit (``docs/forward_backward.md``): the paired step 6.65 s
        against 7.03 s with hand-overs only between the steps."""
        self._pass.at_wait = work

    def between(self, work: Callable[[], None]) -> None:
        """``work()`` between two steps, this pass's transfers released if it raises (a
        paired forward given up there: :class:`~mc2.engine.transport.deadline.Abandoned`)."""
        with self._released():
            work()

    @contextmanager
    def _released(self) -> Iterator[None]:
        try:
            yield
        except BaseException as exc:
            self._pass.release(wait=not isinstance(exc, (CommTimeout, Abandoned)))
            raise


@dataclass
class _Pass:
    """One pass (forward or backward) of the pipeline: its named steps, each recorded on the
    timeline, and the two schedules of the module docstring."""

    handle: DispatchHandle
    steps: PipelineSteps
    phase: str
    timeline: Timeline | None
    wire: WirePair
    workspace: Workspace | None
    dispatches: dict[int, Pending] = field(default_factory=dict)  # in flight, by micro-batch
    combines: dict[int, Pending] = field(default_factory=dict)
    owed: list[int] = field(default_factory=list)  # micro-batches whose deferred work is due
    held: Callable[[bool], Pending] | None = None  # a dispatch prepared, issued after the next wait
    at_wait: Callable[[], None] | None = None  # other work before each wait inside a step

    def _span(self, kind: SpanKind, name: str, i: int = -1) -> Any:
        return maybe_span(self.timeline, kind, name, self.phase, i)

    def release(self, *, wait: bool) -> None:
        """Transfers left in flight when the pass raises: wait for them before their buffers
        go back to the workspace (or, after a timeout, keep them alive for good)."""
        for transfer in [*self.dispatches.values(), *self.combines.values()]:
            if not wait:
                abandon(transfer)
                continue
            try:
                transfer.wait()
            except BaseException:  # noqa: BLE001 - the original error is the one to raise
                abandon(transfer)

    # ---- the steps
    def gather(self, i: int) -> Tensor:
        with self._span("compute", "gather", i):
            return self.steps.gather(i)

    def _observer(self, name: str, i: int) -> Callable[[Any, Any], None] | None:
        if self.timeline is None:
            return None
        timeline, phase = self.timeline, self.phase
        return lambda start, end: timeline.add("transfer", name, phase, i, start, end)

    def prepare(self, i: int, rows: Tensor, direction: int) -> Callable[[bool], Pending]:
        """Encode ``rows`` now; the returned function issues their transfer."""
        fmt = self.wire[direction]
        name = ("dispatch", "combine")[direction]
        exchange = self.handle.micro_batches[i].exchange
        start = (exchange.dispatch, exchange.combine)[direction]
        if fmt.kind is None:
            return lambda async_op: start(rows, async_op=async_op,
                                          on_complete=self._observer(name, i))
        with self._span("compute", "encode", i):
            data = fmt.encode(rows, self.workspace)

        def issue(async_op: bool) -> _Encoded:
            pending = start(data, async_op=async_op, on_complete=self._observer(name, i))
            return _Encoded(pending, fmt, rows.shape[-1], rows.dtype, self.workspace)
        return issue

    def send(self, i: int, rows: Tensor, async_op: bool) -> Pending:
        return self.prepare(i, rows, 0)(async_op)

    def combine(self, i: int, rows: Tensor, async_op: bool) -> Pending:
        return self.prepare(i, rows, 1)(async_op)

    def compute(self, i: int, received: Tensor) -> Tensor:
        with self._span("compute", "experts", i):
            return self.steps.compute(i, received)

    def scatter(self, i: int, returned: Tensor) -> None:
        with self._span("compute", "scatter", i):
            self.steps.scatter(i, returned)

    def deferred(self, i: int) -> None:
        if self.steps.deferred is not None:
            with self._span("compute", "deferred", i):
                self.steps.deferred(i)

    def local(self) -> None:
        if self.steps.local is not None:
            with self._span("compute", "local"):
                self.steps.local()

    def drain(self) -> None:
        if self.steps.drain is not None:
            with self._span("compute", "local", self.handle.num_micro_batches - 1):
                self.steps.drain()

    def waited(self, transfer: Pending, name: str, i: int) -> Tensor:
        """``transfer.wait()``, a timeout told which micro-batch and phase it hit; a transfer
        whose wait failed is kept alive (its buffers may still be in use)."""
        try:
            return transfer.wait(micro_batch=i, phase=self.phase)
        except CommTimeout as exc:
            abandon(transfer)
            raise exc.at(operation=name, micro_batch=i, phase=self.phase) from exc.__cause__
        except BaseException:
            abandon(transfer)
            raise

    # ---- the schedules
    def serial(self) -> None:
        """Each collective synchronous: nothing overlaps."""
        self.local()
        for i in range(self.handle.num_micro_batches):
            rows = self.gather(i)
            with self._span("comm", "dispatch", i):
                received = self.waited(self.send(i, rows, async_op=False), "dispatch", i)
            out = self.compute(i, received)
            with self._span("comm", "combine", i):
                returned = self.waited(self.combine(i, out, async_op=False), "combine", i)
            self.scatter(i, returned)
            self.deferred(i)
        self.drain()

    def fill(self) -> None:
        """The overlapped schedule up to the first dispatch's wait: the first dispatch (and
        the second, unless it waits for the first to arrive: module docstring), the local
        work under them."""
        self.dispatches[0] = self.send(0, self.gather(0), async_op=True)
        self._next(0)
        self.local()

    def first_experts(self) -> None:
        """On to the first combine's wait: micro-batch 0's experts (and 1's: its dispatch
        was in flight under 0's)."""
        self._experts(0)
        if self.handle.num_micro_batches > 1:
            self._next(1)
            self._experts(1)

    def rest(self) -> None:
        """On to the end: each combine received while the next micro-batch computes."""
        k = self.handle.num_micro_batches
        if k > 1:
            self._pay()
            self._receive(0)
        for i in range(2, k):
            self._next(i)
            self._experts(i)
            self._pay()
            self._receive(i - 1)
        self._pay()
        self._receive(k - 1)

    def _next(self, i: int) -> None:
        """Gather and encode micro-batch ``i + 1``'s dispatch and issue it, or hold it until
        micro-batch 0's has arrived where no local work runs under the fill (module
        docstring)."""
        if i + 1 >= self.handle.num_micro_batches:
            return
        issue = self.prepare(i + 1, self.gather(i + 1), 0)
        if i == 0 and self.steps.local is None:
            self.held = issue
        else:
            self.dispatches[i + 1] = issue(True)

    def _experts(self, i: int) -> None:
        """Wait for ``i``'s dispatch, compute, issue its combine. The deferred work of the
        micro-batch before runs first: after the stop where a caller computed the other
        micro-batch up to issuing its next transfer, so the weight gradients run while both
        transfers travel instead of in the way of the other's issue (measured at 200 Mbit,
        ``docs/batch_overlap.md``: the step 5.5% faster than right after the combine)."""
        self._pay()
        self._before_wait(i)
        with self._span("wait", "dispatch", i):
            received = self.waited(self.dispatches.pop(i), "dispatch", i)
        if self.held is not None:
            self.dispatches[i + 1], self.held = self.held(True), None
        self.combines[i] = self.combine(i, self.compute(i, received), async_op=True)
        self.owed.append(i)
        if i == self.handle.num_micro_batches - 1:  # the last combine is on the wire
            self.drain()

    def _pay(self) -> None:
        """The deferred work postponed to this point."""
        while self.owed:
            self.deferred(self.owed.pop(0))

    def _before_wait(self, i: int) -> None:
        """Where a step waits for a transfer past its first (micro-batch ``i > 0``): the
        caller's other work, as between two steps (:meth:`PassSchedule.between_waits`)."""
        if i > 0 and self.at_wait is not None:
            self.at_wait()

    def _receive(self, i: int) -> None:
        self._before_wait(i)
        with self._span("wait", "combine", i):
            returned = self.waited(self.combines.pop(i), "combine", i)
        self.scatter(i, returned)
