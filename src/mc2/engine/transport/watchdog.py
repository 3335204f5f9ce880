"""Deadlines for stream backends, kept by a thread instead of a blocking wait.

On NCCL or HCCL a wait with a timeout would poll the host until the transfer is done and stop
it from queueing the next micro-batch, so every wait is stream-ordered and hands its work to the
process's :class:`Watchdog`, a daemon thread that polls ``is_completed()``. A deadline counts
from a device event recorded before the collective (:func:`start_stamp`), not from the host's
issue: the host runs far ahead of the device, and a short ``timeout=`` must not abort a healthy
job. On expiry it records a :class:`~mc2.engine.transport.deadline.CommTimeout`, aborts every
process group at once (:func:`abort_groups`: aborts one by one can deadlock each other), and ends
the process after :data:`ABORT_GRACE_S` if that abort hangs or is impossible, since a thread
blocked behind the collective would otherwise wait forever. The caller raises at its next
:func:`check`. Inside a CUDA-graph capture nothing may poll, so :meth:`Watchdog.pause` stops
the thread.

See docs/faults.md, 'Deadlines', and docs/accelerators.md (the capture: what to drain first).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from mc2.device.streams import full_device
from mc2.engine.transport.deadline import CommTimeout
from mc2.engine.transport.env import abort_grace_s

# seconds the abort of every group may take (or, without an abort, a caller has to report the
# timeout) before the process is ended; MC2_ABORT_GRACE_S overrides it
ABORT_GRACE_S = 30.0
EXIT_CODE = 124  # the process's exit status when the watchdog ends it (as timeout(1))


def start_stamp(device: torch.device | str | None, stream: bool) -> Any:
    """Where the deadline of a collective about to be issued starts.

    On a stream backend on an accelerator: a device event recorded on the current stream (the
    collective starts when the device gets there). Elsewhere the host's ``time.monotonic()``:
    on CPU the host is the device, and host backends wait with their own deadline.
    """
    if stream and device is not None and torch.device(device).type not in ("cpu", "meta"):
        event = torch.Event(device=full_device(device))
        event.record()
        return event
    return time.monotonic()


def _reached(start: Any, now: float) -> float | None:
    """The host time the deadline of a work counts from, ``None`` while its start event is not
    reached (``start``: host seconds, or an event with ``query()``)."""
    if isinstance(start, (int, float)):
        return float(start)
    return now if start.query() else None


@dataclass
class _Watched:
    work: Any
    operation: str
    micro_batch: int | None
    phase: str | None
    deadline_s: float
    start: Any  # host seconds, or a device event recorded before the collective
    group: Any
    device_index: int | None = None  # the accelerator the work's events live on
    started_at: float | None = None  # host time the start was found reached


def process_groups() -> list[Any]:
    """Every process group registered with ``torch.distributed`` in this process (the default
    group, sub-groups, control groups), in the order ``torch.distributed``'s own abort of the
    world uses; empty without an initialised default group."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    try:
        names = dict(dist.distributed_c10d._world.pg_names)
    except AttributeError:  # a torch without the registry: the default group at least
        return [dist.distributed_c10d._get_default_group()]
    return sorted(names, key=lambda pg: names[pg], reverse=True)


def _nccl_of_default_group() -> Any:
    """The default group's NCCL backend, or ``None`` (no NCCL, or not initialised)."""
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda"))
    except (RuntimeError, ValueError, AttributeError):
        return None
    return backend if dist.is_nccl_available() and isinstance(backend, dist.ProcessGroupNCCL) \
        else None


def abort_groups(groups: list[Any]) -> None:
    """Abort ``groups`` together: their pending collectives end with an error.

    One action from one place: on NCCL inside one ``ncclGroupStart``/``ncclGroupEnd`` (aborts of
    communicators in sequence can deadlock each other, pytorch#119797), as
    ``torch.distributed``'s abort of the world does. The registry of groups is left as it is
    (the caller's thread may be in the middle of a call; it raises the timeout at its next
    check, and the process must end anyway).

    Raises:
        RuntimeError: a group could not be aborted (its backend has no abort); every other
            group was aborted first.
    """
    nccl = _nccl_of_default_group()
    failures = []
    if nccl is not None:
        nccl._group_start()
    try:
        for group in groups:
            try:
                group.abort()
            except Exception as exc:  # noqa: BLE001 - reported together below
                failures.append(f"{getattr(group, 'group_name', group)}: {exc!r}")
    finally:
        if nccl is not None:
            nccl._group_end()
    if failures:
        raise RuntimeError("cannot abort " + "; ".join(failures))


class Watchdog:
    """Watches stream-ordered works against their deadlines (see the module docstring).

    Args:
        poll_s: seconds between two polls of the works in flight.
        abort: called once with every group to abort when a deadline passes
            (default :func:`abort_groups`).
        groups: the process's groups (default :func:`process_groups`); the groups of the
            works in flight are added.
        grace_s: seconds the abort may take before the process is ended (default
            ``MC2_ABORT_GRACE_S``, else :data:`ABORT_GRACE_S`).
    """

    def __init__(self, poll_s: float = 0.05,
                 abort: Callable[[list[Any]], None] = abort_groups,
                 groups: Callable[[], list[Any]] = process_groups,
                 grace_s: float | None = None) -> None:
        self.poll_s = poll_s
        self.abort = abort
        self.groups = groups
        self.grace_s = abort_grace_s(ABORT_GRACE_S) if grace_s is None else grace_s
        self._watched: list[_Watched] = []
        self._expired: CommTimeout | None = None
        self._reported = False  # the first check raised the timeout itself
        self._paused = False  # a capture is running: poll nothing
        self._wake = threading.Condition()
        self._polling = threading.Lock()  # held by a poll in progress
        self._thread: threading.Thread | None = None

    def watch(self, work: Any, operation: str, *, deadline_s: float, start: Any,
              micro_batch: int | None = None, phase: str | None = None,
              group: Any = None) -> None:
        """Watch ``work`` until it completes or ``deadline_s`` after ``start`` is reached
        (:func:`start_stamp`: host ``time.monotonic`` seconds, or a device event that counts
        from when the device reaches it). The caller's current accelerator is noted: the thread
        polls on it (a fresh thread would otherwise query on device 0 and open a context
        there)."""
        index = torch.accelerator.current_device_index() if torch.accelerator.is_available() \
            else None
        with self._wake:
            self._paused = False  # a call outside a capture: polling is safe again
            self._watched.append(_Watched(work, operation, micro_batch, phase, deadline_s,
                                          start, group, index))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="mc2-watchdog",
                                                daemon=True)
                self._thread.start()
            self._wake.notify()

    def check(self, operation: str = "wait") -> None:
        """Raise the timeout a watched work ran into: the first check raises it, every later
        one (``operation``: what was about to run) a :class:`CommTimeout` naming it, since
        every group was aborted with it."""
        expired = self._expired
        if expired is None:
            return
        if not self._reported:
            self._reported = True
            raise expired
        raise expired.refused(operation)

    @property
    def expired(self) -> CommTimeout | None:
        """The timeout that aborted every group, ``None`` while none did."""
        return self._expired

    @property
    def in_flight(self) -> int:
        """Works still watched."""
        with self._wake:
            return len(self._watched)

    def pause(self) -> None:
        """Poll nothing until the next :meth:`watch` (a CUDA-graph capture is running: no
        ``is_completed()`` or ``query()`` may run, from any thread). Returns once a poll in
        progress has ended, so that none runs after it."""
        with self._polling, self._wake:
            self._paused = True

    @property
    def paused(self) -> bool:
        """Whether polling is paused (:meth:`pause`)."""
        return self._paused

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no work is watched (every work seen completed, or aborted), at most
        ``timeout_s`` seconds; whether it is. Before a capture: the thread then has nothing
        left to poll."""
        with self._wake:
            return self._wake.wait_for(lambda: not self._watched, timeout_s)

    def poll(self, now: float | None = None) -> _Watched | None:
        """One poll: drop the completed works, start the clocks of works whose start was
        reached, and return the first work past its deadline (``None`` if none)."""
        with self._polling:
            if self._paused:
                return None
            now = time.monotonic() if now is None else now
            with self._wake:
                watched = list(self._watched)
            done, expired = [], None
            for item in watched:
                if item.device_index is not None:
                    torch.accelerator.set_device_index(item.device_index)
                if item.work.is_completed():
                    done.append(item)
                    continue
                if item.started_at is None:
                    item.started_at = _reached(item.start, now)
                if item.started_at is not None and now - item.started_at > item.deadline_s \
                        and expired is None:
                    expired = item
            with self._wake:
                self._watched = [w for w in self._watched if all(w is not d for d in done)]
                if not self._watched:
                    self._wake.notify_all()  # wait_idle
        return expired

    def expire(self, item: _Watched, now: float | None = None) -> None:
        """``item`` passed its deadline: record the timeout, abort every group in one action,
        and end the process if that abort hangs or fails for longer than the grace period."""
        now = time.monotonic() if now is None else now
        waited = now - (item.started_at if item.started_at is not None else now)
        self._expired = CommTimeout(item.operation, waited, micro_batch=item.micro_batch,
                                    phase=item.phase)
        with self._wake:  # every group goes down: nothing in flight is worth watching
            watched, self._watched = self._watched, []
            self._wake.notify_all()
        default = dist.distributed_c10d._get_default_group() \
            if dist.is_available() and dist.is_initialized() else None
        every = [g if g is not None else default
                 for g in [*self.groups(), item.group, *(w.group for w in watched)]]
        groups = list({id(g): g for g in every if g is not None}.values())  # each once
        ends = time.monotonic() + self.grace_s
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                self.abort(groups)
                outcome["done"] = True
            except BaseException as exc:  # noqa: BLE001 - a backend without abort
                outcome["error"] = exc

        aborter = threading.Thread(target=run, name="mc2-abort", daemon=True)
        aborter.start()
        aborter.join(self.grace_s)
        if outcome.get("done"):
            return
        if aborter.is_alive():
            why = f"aborting the process groups did not return within {self.grace_s:g}s"
        else:
            why = f"the process groups could not be aborted ({outcome.get('error')!r})"
            time.sleep(max(0.0, ends - time.monotonic()))  # the caller's grace to report
        try:  # say why on stderr and end the process at once (no cleanup: threads may be blocked)
            sys.stderr.write(f"{self._expired} -- and {why}, so a thread blocked behind the "
                             "stalled collective would wait forever: mc2 ends this process "
                             f"(exit status {EXIT_CODE}; grace period "
                             f"MC2_ABORT_GRACE_S={self.grace_s:g}s)\n")
            sys.stderr.flush()
        finally:
            os._exit(EXIT_CODE)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._watched or self._paused:
                    self._wake.wait()
            expired = self.poll()
            if expired is not None:
                self.expire(expired)
            time.sleep(self.poll_s)


@functools.cache
def watchdog() -> Watchdog:
    """The process's watchdog (its thread starts with the first watched work)."""
    return Watchdog()


def expired() -> CommTimeout | None:
    """The timeout that made the process's watchdog abort every group, ``None`` if none did
    (nor was a watchdog ever needed: it is not made for the asking)."""
    return watchdog().expired if watchdog.cache_info().currsize else None


def check(operation: str = "wait") -> None:
    """Raise a stream wait's timeout in the caller's thread, if one expired (and, after the
    first, a timeout naming it at every check: ``operation`` is what was about to run)."""
    watchdog().check(operation)


@contextlib.contextmanager
def surfaced() -> Iterator[None]:
    """Raise a watched timeout instead of what it caused: after the watchdog aborted a group,
    a host synchronisation behind the stalled collective fails with the backend's own error;
    the timeout, which names the stalled transfer, is the one to report."""
    try:
        yield
    except CommTimeout:
        raise
    except RuntimeError as exc:
        try:
            check()
        except CommTimeout as timeout:
            raise timeout from exc
        raise
    check()


def stream_wait(work: Any, operation: str, *, deadline_s: float | None, start: Any,
                micro_batch: int | None = None, phase: str | None = None,
                group: Any = None) -> None:
    """A stream backend's wait: the current stream waits for ``work``; the host does not, and
    never with a timeout. The deadline (if any) goes to the watchdog, counted from ``start``
    (:func:`start_stamp`, taken before the collective was issued), before the wait, so that a
    backend whose wait does block the host is watched too."""
    check(operation)
    if deadline_s is not None:
        watchdog().watch(work, operation, deadline_s=deadline_s, start=start,
                         micro_batch=micro_batch, phase=phase, group=group)
    with surfaced():
        work.wait()
