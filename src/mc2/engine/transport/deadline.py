"""Deadlines on every wait, so that a silent peer becomes an error instead of a hang.

A peer that dies is caught by the backend (Gloo sees the connection reset). A peer that is alive
but silent (stopped, stuck in a long pause, a wedged driver) is not: the others wait inside the
collective until the process group's own timeout, 30 minutes for a plain
``init_process_group("gloo")``. So every wait of ``fused_expert`` has a deadline of its own
(``timeout=`` argument, else ``MC2_TIMEOUT`` seconds, else :data:`DEFAULT_TIMEOUT_S`); on expiry
it raises :class:`CommTimeout`, which names the operation, the micro-batch and the phase, and
says what to do next.

The deadline is carried in a context variable for the duration of one call (and set again for
its backward from the call's plan), so the helpers in :mod:`mc2.engine.transport.comm` read it without every
function growing a parameter. It is not global state: each call sets and restores it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

DEFAULT_TIMEOUT_S = 300.0  # 5 minutes: far above any single exchange, far below Gloo's 30
_CURRENT: contextvars.ContextVar[float | None] = contextvars.ContextVar("mc2_deadline",
                                                                        default=None)

RECOVERY = ("the process group is not usable after a timed-out collective (Gloo and NCCL "
            "alike): end this process, and let the launcher restart the job from its last "
            "checkpoint (torchrun --max-restarts N with mc2.parallel.checkpoint / mc2 train --resume)")


class CommTimeout(RuntimeError):
    """A wait of ``fused_expert`` passed its deadline: a peer is stalled or gone.

    Attributes:
        operation: what was waited for (``"dispatch"``, ``"combine"``, ``"handshake"``, ...).
        micro_batch: the micro-batch, or ``None`` for per-call operations.
        phase: ``"forward"``, ``"backward"`` or ``"plan"``.
        waited_s: how long it waited.
    """

    def __init__(self, operation: str, waited_s: float, *, micro_batch: int | None = None,
                 phase: str | None = None) -> None:
        self.operation, self.waited_s = operation, waited_s
        self.micro_batch, self.phase = micro_batch, phase
        where = operation
        if micro_batch is not None:
            where += f" of micro-batch {micro_batch}"
        if phase is not None:
            where += f" in the {phase}"
        super().__init__(f"mc2: the {where} waited {waited_s:.1f}s for a peer and passed its "
                         f"deadline (timeout=, MC2_TIMEOUT); {RECOVERY}")

    def at(self, *, micro_batch: int | None = None, phase: str | None = None,
           operation: str | None = None) -> "CommTimeout":
        """The same timeout, told where in the pipeline it happened."""
        return CommTimeout(operation or self.operation, self.waited_s,
                           micro_batch=self.micro_batch if micro_batch is None else micro_batch,
                           phase=self.phase if phase is None else phase)


def resolve_timeout(timeout: float | None) -> float | None:
    """Seconds for this call: the argument, else ``MC2_TIMEOUT``, else the default; ``0`` (or a
    negative value) means no deadline of mc2's own (the process group's timeout applies).

    Raises:
        ValueError: ``MC2_TIMEOUT`` is not a number.
    """
    if timeout is None:
        text = os.environ.get("MC2_TIMEOUT", "").strip()
        if text:
            try:
                timeout = float(text)
            except ValueError:
                raise ValueError(f"MC2_TIMEOUT must be a number of seconds, got {text!r}") \
                    from None
        else:
            timeout = DEFAULT_TIMEOUT_S
    return None if timeout <= 0 else float(timeout)


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Waits inside the block use ``seconds`` (``None``: no deadline of mc2's own)."""
    token = _CURRENT.set(seconds)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> float | None:
    """The deadline (seconds) of the call being run, ``None`` outside one."""
    return _CURRENT.get()


def wait_work(work: Any, operation: str) -> None:
    """``work.wait()`` with the current deadline; a :class:`CommTimeout` on expiry."""
    seconds = current()
    if seconds is None:
        work.wait()
        return
    start = time.monotonic()
    try:
        completed = work.wait(timeout=timedelta(seconds=seconds))
    except RuntimeError as exc:  # Gloo: "Operation timed out!"; a dead peer raises otherwise
        waited = time.monotonic() - start
        if waited >= seconds * 0.99 or "timed out" in str(exc).lower():
            raise CommTimeout(operation, waited) from exc
        raise
    if completed is False:  # backends that report expiry instead of raising
        raise CommTimeout(operation, time.monotonic() - start)


def wait_future(future: Any, operation: str) -> Any:
    """``future.result()`` with the current deadline (the 2-D exchange's thread)."""
    seconds = current()
    start = time.monotonic()
    try:
        return future.result(timeout=seconds)
    except concurrent.futures.TimeoutError:
        raise CommTimeout(operation, time.monotonic() - start) from None
