"""Deadlines for stream backends, kept by a thread instead of a blocking wait.

On NCCL or HCCL a wait is stream-ordered: ``work.wait()`` returns at once and only the device
waits. A wait with a timeout would poll the host until the transfer is done, which stops the
host from queueing the next micro-batch (no overlap at all). So on those backends every wait of
a call hands its work to the process's :class:`Watchdog`: a daemon thread that polls
``is_completed()`` a few times a second, and when a work passes its deadline

1. records a :class:`~mc2.engine.transport.deadline.CommTimeout` naming the operation, the micro-batch and
   the phase of the transfer that stalled, and
2. aborts the work's process group (``ProcessGroup.abort``), so that a host thread blocked in a
   device synchronisation behind the stalled collective wakes up instead of hanging.

The caller's thread raises the recorded timeout at its next check: every later wait, every host
read of a call and the end of every pass (:func:`check`). This is what NCCL's own watchdog does
with the group's timeout, with mc2's deadline and mc2's words.

The deadline counts from the host's issue of the collective. On a stream backend the transfer
starts only when the device reaches it, so a deadline must also cover the work queued before it:
the default (300 s) is far above any queue; a ``timeout=`` of seconds on a busy device could
abort a healthy group, and an abort is fatal to the group.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from mc2.engine.transport.deadline import CommTimeout


@dataclass
class _Watched:
    work: Any
    operation: str
    micro_batch: int | None
    phase: str | None
    deadline_s: float
    issued_at: float
    group: Any
    device_index: int | None = None  # the accelerator the work's events live on


def abort_group(group: Any) -> None:
    """Abort ``group`` (the default group for ``None``): its pending collectives end with an
    error. Best effort: a backend without ``abort`` is left to its own timeout."""
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        pg.abort()
    except Exception:  # noqa: BLE001 - nothing better to do from a watchdog
        pass


class Watchdog:
    """Watches stream-ordered works against their deadlines (see the module docstring).

    Args:
        poll_s: seconds between two polls of the works in flight.
        abort: called with the group of a work that passed its deadline.
    """

    def __init__(self, poll_s: float = 0.05,
                 abort: Callable[[Any], None] = abort_group) -> None:
        self.poll_s = poll_s
        self.abort = abort
        self._watched: list[_Watched] = []
        self._expired: CommTimeout | None = None
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def watch(self, work: Any, operation: str, *, deadline_s: float, issued_at: float,
              micro_batch: int | None = None, phase: str | None = None,
              group: Any = None) -> None:
        """Watch ``work`` until it completes or ``deadline_s`` after ``issued_at``
        (``time.monotonic``). The caller's current accelerator is noted: the thread polls on
        it (a fresh thread would otherwise query on device 0 and open a context there)."""
        index = None
        if torch.accelerator.is_available():
            index = torch.accelerator.current_device_index()
        with self._wake:
            self._watched.append(_Watched(work, operation, micro_batch, phase, deadline_s,
                                          issued_at, group, index))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="mc2-watchdog",
                                                daemon=True)
                self._thread.start()
            self._wake.notify()

    def check(self) -> None:
        """Raise the timeout a watched work ran into, once."""
        expired, self._expired = self._expired, None
        if expired is not None:
            raise expired

    @property
    def in_flight(self) -> int:
        """Works still watched."""
        with self._wake:
            return len(self._watched)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._watched:
                    self._wake.wait()
                watched = list(self._watched)
            done, expired = [], None
            now = time.monotonic()
            for item in watched:
                if item.device_index is not None:
                    torch.accelerator.set_device_index(item.device_index)
                if item.work.is_completed():
                    done.append(item)
                elif now - item.issued_at > item.deadline_s and expired is None:
                    expired = item
            if expired is not None:
                self._expired = CommTimeout(expired.operation, now - expired.issued_at,
                                            micro_batch=expired.micro_batch,
                                            phase=expired.phase)
                self.abort(expired.group)
                done = [w for w in watched if w.group is expired.group] + done
            with self._wake:
                self._watched = [w for w in self._watched if all(w is not d for d in done)]
            time.sleep(self.poll_s)


@functools.cache
def watchdog() -> Watchdog:
    """The process's watchdog (its thread starts with the first watched work)."""
    return Watchdog()


def check() -> None:
    """Raise a stream wait's timeout in the caller's thread, if one expired."""
    watchdog().check()


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


def stream_wait(work: Any, operation: str, *, deadline_s: float | None, issued_at: float,
                micro_batch: int | None = None, phase: str | None = None,
                group: Any = None) -> None:
    """A stream backend's wait: the current stream waits for ``work``; the host does not, and
    never with a timeout. The deadline (if any) goes to the watchdog (before the wait, so that
    a backend whose wait does block the host is watched too)."""
    check()
    if deadline_s is not None:
        watchdog().watch(work, operation, deadline_s=deadline_s, issued_at=issued_at,
                         micro_batch=micro_batch, phase=phase, group=group)
    with surfaced():
        work.wait()
