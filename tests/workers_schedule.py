"""Rank functions that record the schedule a call really ran (``tests/test_overlap_schedule.py``).

What is recorded, on each rank, for each exchange of a pass: when its issue returned (the
transfer is in flight from then on), when the schedule began to wait for it, and when the
backend reported it complete; and when each micro-batch's experts ran.

Where: at the transport's seam, not the scheduler's. Every micro-batch's exchange is a
:class:`~mc2.engine.transport.comm.FlatExchange` or a
:class:`~mc2.engine.transport.hierarchy.TwoStageExchange`; its ``dispatch``/``combine`` return
the :class:`~mc2.engine.transport.comm.PendingTransfer` that the schedule later waits on, naming
the micro-batch and phase it waits for. Wrapping those three methods inside the rank (the
class attributes of this forked process only, restored afterwards) records what the transport
was asked to do and when, whatever the scheduler believes it does. The experts' spans come from
the call's :class:`mc2.Timeline`, the public record of the pass's compute steps.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from tests.problems import Problem


@dataclass(frozen=True)
class Exchange:
    """One exchange of one pass, as this rank's transport saw it (``perf_counter`` seconds).

    Attributes:
        name: ``"dispatch"`` or ``"combine"`` (the backward's output gradients travel the
            dispatch routes, its input gradients the combine routes).
        phase: ``"forward"`` or ``"backward"``, as the schedule named it when it waited.
        micro_batch: the micro-batch the schedule waited for.
        via: the exchange's class (``FlatExchange``, ``TwoStageExchange``): which path ran.
        issued: the issuing call returned: the transfer is in flight from here.
        waited: the schedule began to wait for it.
        completed: the backend reported it done (a synchronous transfer: when it returned).
        asynchronous: it was issued with ``async_op=True``. A blocking issue returns a
            finished transfer: its issue and wait would still bracket the experts, so without
            this the proof would pass a schedule that overlaps nothing.
    """

    name: str
    phase: str
    micro_batch: int
    via: str
    issued: float
    waited: float
    completed: float | None
    asynchronous: bool


@dataclass(frozen=True)
class Experts:
    """One micro-batch's expert step (``perf_counter`` seconds, from the call's timeline)."""

    phase: str
    micro_batch: int
    start: float
    end: float


@dataclass
class _Transfer:
    """One transfer's record as it fills in. Until its wait it holds the transfer itself, so
    that the transfer's ``id`` names it; ``completed`` is filed by the backend's thread."""

    name: str
    via: str
    issued: float
    transfer: Any
    asynchronous: bool
    completed: float | None = None
    waited: float | None = None
    micro_batch: int | None = None
    phase: str | None = None


class ScheduleRecorder:
    """Records every exchange issued while :meth:`installed` is active (see the module
    docstring); :meth:`exchanges` returns those the schedule waited for by micro-batch."""

    def __init__(self, blocking: bool = False, emulated_stream: bool = False) -> None:
        """``blocking``: issue every exchange with ``async_op=False`` whatever the schedule
        asks (the checker's own check: a schedule that blocks overlaps nothing).
        ``emulated_stream``: the world runs the emulated stream backend
        (:mod:`tests.fake_stream_backend`), whose waits block the host where a real stream
        wait would only order a stream: the timeline's completion observer, which waits on a
        side stream right at the issue, would make every issue blocking there. Its
        completions are filed from the backend's future instead."""
        self._live: dict[int, _Transfer] = {}
        self._waited: list[_Transfer] = []
        self._blocking = blocking
        self._observers = not emulated_stream

    def exchanges(self) -> list[Exchange]:
        """The exchanges waited for so far (read once the call is over: a completion is filed
        by the backend's thread, which may run just after the wait returned)."""
        return [Exchange(r.name, str(r.phase), int(r.micro_batch), r.via, r.issued,
                         float(r.waited), r.completed, r.asynchronous)
                for r in self._waited if r.micro_batch is not None and r.waited is not None]

    @contextmanager
    def installed(self) -> Iterator["ScheduleRecorder"]:
        """Wrap the exchanges' ``dispatch``/``combine`` and ``PendingTransfer.wait``."""
        from mc2.engine.transport.comm import FlatExchange, PendingTransfer
        from mc2.engine.transport.hierarchy import TwoStageExchange

        saved = [(cls, name, cls.__dict__[name]) for cls in (FlatExchange, TwoStageExchange)
                 for name in ("dispatch", "combine")]
        saved.append((PendingTransfer, "wait", PendingTransfer.__dict__["wait"]))
        for cls, name, fn in saved[:-1]:
            setattr(cls, name, self._issuing(fn, name, cls.__name__))
        PendingTransfer.wait = self._waiting(saved[-1][2])
        try:
            yield self
        finally:
            for cls, name, fn in saved:
                setattr(cls, name, fn)

    def _issuing(self, issue: Callable[..., Any], name: str, via: str) -> Callable[..., Any]:
        def recorded(exchange: Any, rows: torch.Tensor, *, async_op: bool,
                     on_complete: Any = None) -> Any:
            async_op = async_op and not self._blocking
            transfer = issue(exchange, rows, async_op=async_op,
                             on_complete=on_complete if self._observers else None)
            record = _Transfer(name, via, time.perf_counter(), transfer, async_op)
            self._live[id(transfer)] = record
            _on_completion(transfer, record)
            return transfer
        return recorded

    def _waiting(self, wait: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(transfer: Any, *, micro_batch: int | None = None,
                     phase: str | None = None) -> Any:
            record = self._live.get(id(transfer))
            if record is not None and record.transfer is transfer and micro_batch is not None:
                del self._live[id(transfer)]
                record.waited, record.micro_batch, record.phase = (time.perf_counter(),
                                                                   micro_batch, phase)
                record.transfer = None  # its buffers go back as they would unrecorded
                self._waited.append(record)
            return wait(transfer, micro_batch=micro_batch, phase=phase)
        return recorded


def _on_completion(transfer: Any, record: _Transfer) -> None:
    """File when ``transfer`` completes: from the backend's future (a flat exchange on Gloo),
    the communication thread's future (the 2-D exchange on Gloo), or now (synchronous)."""
    def done(_: Any) -> None:
        record.completed = time.perf_counter()

    if transfer.work is not None:
        transfer.work.get_future().then(done)
    elif transfer.future is not None:
        transfer.future.add_done_callback(done)
    else:
        done(None)


def record_schedules(rank: int, world: int, cases: list[tuple[Problem, dict[str, Any]]]
                     ) -> list[dict[str, Any]]:
    """Forward and backward of each ``(problem, fused_expert options)``, recorded: the
    exchanges, the experts' spans, and whether overlap fell back to synchronous. An option
    ``blocking_issues=True`` is the recorder's: every exchange is issued blocking;
    ``shared_experts=(up, gate, down)``: shared experts, trained. ``"local"``: the shared
    experts' spans."""
    import mc2

    results = []
    for problem, options in cases:
        options = dict(options)
        blocking = options.pop("blocking_issues", False)  # the recorder's, not the call's
        emulated = options.pop("emulated_stream", False)
        shared = options.pop("shared_experts", None)  # (up, gate, down), trained
        if shared is not None:
            names = ("shared_up", "shared_gate", "shared_down")
            options.update({n: t.clone().requires_grad_(True) for n, t in zip(names, shared)})
        x = problem.xs[rank].clone().requires_grad_(True)
        weights = [w.clone().requires_grad_(True) for w in problem.local_weights(rank)]
        timeline = mc2.Timeline()
        recorder = ScheduleRecorder(blocking, emulated)
        with recorder.installed():
            out = mc2.fused_expert(x, *weights, problem.ids[rank], problem.rws[rank],
                                   timeline=timeline, **options)
            out.backward(problem.grad_outs[rank])
        experts = [Experts(s.phase, s.micro_batch, s.start, s.end) for s in timeline.spans
                   if s.kind == "compute" and s.name == "experts"]
        local = [Experts(s.phase, s.micro_batch, s.start, s.end) for s in timeline.spans
                 if s.kind == "compute" and s.name == "local"]
        results.append({"exchanges": recorder.exchanges(), "experts": experts,
                        "local": local, "fell_back": timeline.sync_fallback})
    return results
