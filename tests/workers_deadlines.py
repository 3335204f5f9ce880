"""Rank functions for the deadline tests: a peer late by less or more than the group's own
timeout, the calls after a timeout, and a capacity call made while "capturing" a CUDA graph."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

import mc2
from tests.problems import make_problem
from tests.workers_recompute import CollectiveCounter


def _call(p, rank: int, **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A call without ``timeout=``: the default deadline. ``(x, out)``."""
    x = p.xs[rank].clone().requires_grad_(True)
    ws = [w.clone().requires_grad_(True) for w in p.local_weights(rank)]
    return x, mc2.fused_expert(x, *ws, p.ids[rank], p.rws[rank], micro_batches=2, **options)


class _Collectives(CollectiveCounter):
    """Counts every collective (and group creation) issued through ``torch.distributed``."""

    NAMES = ("all_reduce", "all_to_all_single", "all_gather", "all_gather_object", "new_group",
             "barrier")


def _outcome(fn: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        fn()
        return {"raised": None, "after_s": time.monotonic() - start}
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        first = getattr(exc, "first", None)
        return {"raised": type(exc).__name__, "message": str(exc),
                "after_s": time.monotonic() - start,
                "operation": getattr(exc, "operation", None),
                "first": None if first is None else first.operation}


def late_peer(rank: int, world: int, short_s: float, long_s: float) -> dict[str, Any]:
    """The last rank comes ``short_s`` late to one call, then ``long_s`` late to the next (no
    ``timeout=`` anywhere); then every rank runs a backward and a forward more, counting the
    collectives they issue."""
    from mc2.engine.transport.comm import control_group
    from mc2.engine.transport.deadline import group_timeout

    p = make_problem(world, "uniform", tokens=16)
    late = rank == world - 1
    _, first = _call(p, rank)  # a good call: the control group is made
    out: dict[str, Any] = {"control_timeout_s": group_timeout(control_group(None), "cpu")}
    pending_x, pending = _call(p, rank)  # its backward runs after the timeout

    def short() -> None:
        if late:
            time.sleep(short_s)  # the lateness under test
        _, again = _call(p, rank)
        out["same_result"] = torch.equal(again.detach(), first.detach())

    out["short"] = _outcome(short)

    def long() -> None:
        if late:
            time.sleep(long_s)
        _call(p, rank)

    out["long"] = _outcome(long)
    counter = _Collectives()
    try:
        out["backward_after"] = _outcome(lambda: pending.sum().backward())
        out["forward_after"] = _outcome(lambda: _call(p, rank))
    finally:
        counter.close()
    out["collectives_after"] = counter.count
    return out


class CaptureProbe:
    """Counts what a CUDA-graph capture forbids, made by mc2 in this process: works handed to
    the watchdog (``watch``), device-event starts of deadlines (``start_stamp``), observer
    forks (``observe``), host clock reads from mc2's code in the caller's thread (``clock``),
    and what the watchdog's thread does while it is paused (``is_completed()`` of a work, a
    start event's ``query()``, a host clock). The watchdog's thread before the pause is not
    counted: it may poll works of earlier calls until mc2's first call in a capture pauses it.

    Installed for good (module attributes replaced, in a rank process or a script);
    :meth:`measured` runs a function with the counts from zero.
    """

    NAMES = ("is_completed", "watch", "observe", "start_stamp", "clock", "query")

    def __init__(self) -> None:
        import threading

        from mc2.engine.transport import comm, watchdog

        self.counts = dict.fromkeys(self.NAMES, 0)
        self.clock_callers: set[str] = set()
        self._threading = threading
        self.wd = wd = watchdog.watchdog()
        real_poll = wd.poll

        def poll(now: Any = None) -> Any:  # what the thread's polls touch
            for item in list(wd._watched):
                if not isinstance(item.work, _CountedWork):
                    item.work = _CountedWork(item.work, self._counted(
                        "is_completed", item.work.is_completed))
            return real_poll(now)

        wd.poll = poll
        wd.watch = self._counted("watch", wd.watch)
        comm._observe = self._counted("observe", comm._observe)
        comm.start_stamp = self._counted("start_stamp", comm.start_stamp)
        time.monotonic = self._clock(time.monotonic)
        time.perf_counter = self._clock(time.perf_counter)
        real_reached = watchdog._reached

        def reached(start: Any, now: float) -> Any:
            if not isinstance(start, (int, float)) and self._seen():
                self.counts["query"] += 1
            return real_reached(start, now)

        watchdog._reached = reached

    def _seen(self) -> bool:
        """In the caller's thread always; in the watchdog's only while it is paused."""
        return self._threading.current_thread().name != "mc2-watchdog" or self.wd.paused

    def _counted(self, name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._seen():
                self.counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    def _clock(self, fn: Any) -> Any:
        def wrapper() -> float:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("mc2.") and self._seen():
                self.counts["clock"] += 1
                self.clock_callers.add(caller)
            return fn()
        return wrapper

    def measured(self, fn: Any) -> tuple[Any, dict[str, int]]:
        """``(fn(), the counts it made)``."""
        self.counts.update(dict.fromkeys(self.NAMES, 0))
        self.clock_callers.clear()
        result = fn()
        return result, dict(self.counts)


class _CountedWork:
    """A work whose ``is_completed`` is counted (a binding's object takes no attribute)."""

    def __init__(self, work: Any, is_completed: Any) -> None:
        self.work, self.is_completed = work, is_completed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def captured_capacity(rank: int, world: int) -> dict[str, Any]:
    """On the emulated stream backend: a capacity call (forward and backward, a timeline, the
    default deadline) eagerly, then the same call while mc2 is told the current stream is
    capturing a CUDA graph; :class:`CaptureProbe`'s counts of each.

    (The emulated works never report completion to the watchdog, so the eager call's works
    are still watched when the capture starts: the thread polls them until mc2's first call
    inside the capture pauses it, and must not once after.)"""
    from mc2.device import streams

    probe = CaptureProbe()
    p = make_problem(world, "uniform", tokens=12)
    grad = p.grad_outs[rank]

    def call() -> dict[str, Any]:
        tl = mc2.Timeline()
        x, out = _call(p, rank, capacity=16, timeline=tl)
        out.backward(grad)
        return {"out": out.detach(), "x": x.grad, "spans": len(tl.spans)}

    eager, eager_counts = probe.measured(call)
    real_capturing = streams.capturing
    streams.capturing = lambda device: True  # what a CUDA graph's capture makes it say
    try:
        captured, captured_counts = probe.measured(call)
        try:  # check_finite reads the device in every capacity call: refused in a capture
            _call(p, rank, capacity=16, check_finite=True)
            finite_captured = None
        except ValueError as exc:
            finite_captured = str(exc)
    finally:
        streams.capturing = real_capturing
    return {"eager": eager, "eager_counts": eager_counts, "captured": captured,
            "finite_captured": finite_captured,
            "captured_counts": captured_counts,
            "captured_clock_callers": sorted(probe.clock_callers), "paused": probe.wd.paused}
