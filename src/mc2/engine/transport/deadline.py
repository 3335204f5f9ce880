"""Deadlines on every wait, so that a silent peer becomes an error instead of a hang.

A peer that dies is caught by the backend (Gloo sees the connection reset). A peer that is alive
but silent (stopped, stuck in a long pause, a wedged driver) is not: the others wait inside the
collective until the process group's own timeout. So every wait of ``fused_expert`` has a
deadline, and on expiry it raises :class:`CommTimeout`, which names the operation, the
micro-batch and the phase, and says what to do next.

**How long** (:func:`wait_deadline`): the ``timeout=`` argument, else ``MC2_TIMEOUT`` seconds,
else the group's own timeout, the one the user gave ``init_process_group`` / ``new_group``
(torch's defaults: 10 minutes for NCCL, 30 for Gloo), read from the group's backend options
(:func:`group_timeout`). By default mc2 is never stricter than the backend would be: a job the
backend keeps waiting for, mc2 keeps too. An explicit ``timeout=`` shorter than the group's is
the user's choice and holds; a longer one is cut to the group's (the backend ends the
collective there anyway, with a raw error instead of a :class:`CommTimeout`). ``0`` means no
deadline of mc2's own: waits are plain synchronous collectives under the group's timeout.

**What an expiry ends.** On a host backend (Gloo) the waiting thread raises; nothing is aborted
(Gloo has already given up on that collective), but the group and its control group (same
ranks, same backend) are left out of step with the late peer, so mc2 refuses them from then on.
On a stream backend (NCCL, HCCL) the watchdog (:mod:`mc2.engine.transport.watchdog`) aborts
*every* process group of the process (expert-parallel, control, data-parallel, FSDP's: any
group may share the stalled peer, and aborts one by one can deadlock) and ends the process if
that abort hangs. Either way, every later call of mc2 on a refused group raises a
:class:`CommTimeout` that names the first one (:attr:`CommTimeout.first`) before it issues
anything: no raw error of a dead communicator, and no wait on one.

The deadline is carried in a context variable for the duration of one call (and set again for
its backward from the call's plan), so the helpers in :mod:`mc2.engine.transport.comm` read it
without every function growing a parameter. It is not global state: each call sets and
restores it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import math
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

from mc2.engine.transport.group_state import group_state, known_state, live_states

# no deadline of mc2's own beyond the group's: every wait is cut to its group's own timeout
DEFAULT_TIMEOUT_S = math.inf
_CURRENT: contextvars.ContextVar[float | None] = contextvars.ContextVar("mc2_deadline",
                                                                        default=None)

RECOVERY = ("the process group is not usable after a timed-out collective (Gloo and NCCL "
            "alike): end this process, and let the launcher restart the job from its last "
            "checkpoint (torchrun --max-restarts N with mc2.parallel.checkpoint / mc2 train --resume)")


class Abandoned(BaseException):
    """Raised into a pass that is given up half-way (a paired forward whose step failed
    elsewhere): it unwinds without waiting for the transfers it left in flight, which are
    kept alive for good (:func:`~mc2.engine.transport.comm.abandon`): its peers may never
    complete them."""


class CommTimeout(RuntimeError):
    """A wait of ``fused_expert`` passed its deadline: a peer is stalled or gone.

    Also raised where a host backend's wait fails because a peer's connection closed (Gloo's
    read or write error): a peer that passed its own deadline first, died or was killed. Its
    waiting peers learn it so, before their own deadlines; the backend's words are in
    ``lost``, and the group is refused from then on, as after a timeout.

    Attributes:
        operation: what was waited for (``"dispatch"``, ``"combine"``, ``"handshake"``, ...).
        micro_batch: the micro-batch, or ``None`` for per-call operations.
        phase: ``"forward"``, ``"backward"`` or ``"plan"``.
        waited_s: how long it waited (0 for a refused operation).
        first: for an operation refused because its group had already timed out, that
            first timeout; ``None`` for the first one itself.
        lost: the backend's error where a peer's connection closed, else ``None``.
    """

    def __init__(self, operation: str, waited_s: float, *, micro_batch: int | None = None,
                 phase: str | None = None, first: "CommTimeout | None" = None,
                 lost: str | None = None) -> None:
        self.operation, self.waited_s = operation, waited_s
        self.micro_batch, self.phase, self.first, self.lost = micro_batch, phase, first, lost
        where = _where(operation, micro_batch, phase)
        if first is None and lost is not None:
            after = f" after {waited_s:.1f}s" if waited_s else ""
            message = (f"mc2: the {where} lost its connection to a peer{after} (that peer "
                       f"timed out, died or was stopped; the backend said: {lost})")
        elif first is not None and first.lost is not None:
            message = (f"mc2: the {where} was not started: its process group lost a peer "
                       f"before (the {_where(first.operation, first.micro_batch, first.phase)}"
                       f" lost its connection to it)")
        elif first is None:
            message = (f"mc2: the {where} waited {waited_s:.1f}s for a peer and passed its "
                       f"deadline (timeout=, MC2_TIMEOUT, else the process group's timeout)")
        else:
            message = (f"mc2: the {where} was not started: its process group timed out "
                       f"before (the {_where(first.operation, first.micro_batch, first.phase)}"
                       f" waited {first.waited_s:.1f}s for a peer)")
        super().__init__(f"{message}; {RECOVERY}")

    def at(self, *, micro_batch: int | None = None, phase: str | None = None,
           operation: str | None = None) -> "CommTimeout":
        """The same timeout, told where in the pipeline it happened (a group's first timeout
        is then known by these words too: later refusals name where it happened)."""
        told = CommTimeout(operation or self.operation, self.waited_s,
                           micro_batch=self.micro_batch if micro_batch is None else micro_batch,
                           phase=self.phase if phase is None else phase, first=self.first,
                           lost=self.lost)
        for state in live_states():
            if state.failure is self:
                state.failure = told
        return told

    def refused(self, operation: str) -> "CommTimeout":
        """What a later ``operation`` on a group that timed out raises: a timeout naming this
        one (or the one this one names), without waiting."""
        return CommTimeout(operation, 0.0, first=self.first or self)


def _where(operation: str, micro_batch: int | None, phase: str | None) -> str:
    return (operation + ("" if micro_batch is None else f" of micro-batch {micro_batch}")
            + ("" if phase is None else f" in the {phase}"))


def resolve_timeout(timeout: float | None) -> float | None:
    """Seconds for this call: the argument, else ``MC2_TIMEOUT``, else :data:`DEFAULT_TIMEOUT_S`
    (infinite: each wait is then its group's own timeout, :func:`wait_deadline`); ``0`` (or a
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


def group_timeout(group: Any, device: torch.device | str | None = None) -> float | None:
    """The process group's own timeout in seconds (what ``init_process_group`` /
    ``new_group`` / ``_set_pg_timeout`` gave its backend serving ``device``), or ``None`` when
    torch does not say (a backend without options).

    ``group``: a ``ProcessGroup``, or ``None`` for the default group.
    """
    if group is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = dist.distributed_c10d._get_default_group()
    backend = group
    get = getattr(group, "_get_backend", None)
    if get is not None:
        kind = torch.device(device or "cpu").type
        try:
            backend = get(torch.device(kind))
        except (RuntimeError, ValueError):  # a Python backend is its own group
            backend = group
    timeout = getattr(getattr(backend, "options", None), "_timeout", None)
    return timeout.total_seconds() if isinstance(timeout, timedelta) and timeout > timedelta(0) \
        else None


def wait_deadline(seconds: float | None, group: Any, device: torch.device | str | None = None
                  ) -> float | None:
    """The deadline of one wait on ``group``: the call's ``seconds``
    (:func:`resolve_timeout`), cut to the group's own timeout (:func:`group_timeout`), so that
    by default (``seconds`` infinite) it is exactly the group's; ``None``: no deadline of
    mc2's own (``seconds`` is ``None``, or infinite on a group whose timeout torch does not
    tell)."""
    if seconds is None:
        return None
    own = group_timeout(group, device)
    if own is not None:
        seconds = min(seconds, own)
    return None if math.isinf(seconds) else seconds


def timeout_code(seconds: float | None) -> int:
    """``seconds`` (:func:`resolve_timeout`) as the handshake carries it: milliseconds, ``0``
    for no deadline of mc2's own, ``-1`` for the groups' own timeouts (the default)."""
    if seconds is None:
        return 0
    return -1 if math.isinf(seconds) else round(seconds * 1000)


def record_failure(group: Any, timeout: CommTimeout) -> None:
    """``group`` passed a deadline: later operations on it are refused (its state holds its
    first timeout: the communicator is dead, and knowing so goes with it)."""
    state = group_state(group).owner()
    if state.failure is None:
        state.failure = timeout.first or timeout


def failure(group: Any) -> CommTimeout | None:
    """The first timeout of ``group``, or ``None``."""
    state = known_state(group)
    return state.owner().failure if state is not None else None


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


def wait_work(work: Any, operation: str, seconds: float | None) -> None:
    """``work.wait()`` with the deadline ``seconds`` (``None``: none of mc2's own); a
    :class:`CommTimeout` on expiry, and where a peer's connection closed
    (:func:`lost_connection`); the wait's other errors as they are."""
    # no clock read without a deadline: this wait may be inside a graph capture
    start = None if seconds is None else time.monotonic()
    try:
        completed = work.wait() if seconds is None else \
            work.wait(timeout=timedelta(seconds=seconds))
    except RuntimeError as exc:  # Gloo: "Operation timed out!"; a dead peer raises otherwise
        waited = 0.0 if start is None else time.monotonic() - start
        if seconds is not None and (waited >= seconds * 0.99 or "timed out" in str(exc).lower()):
            raise CommTimeout(operation, waited) from exc
        if (lost := lost_connection(exc)) is not None:
            raise CommTimeout(operation, waited, lost=lost) from exc
        raise
    if completed is False and start is not None:  # backends that report expiry, not raise
        raise CommTimeout(operation, time.monotonic() - start)


# how Gloo's TCP transport words a peer's connection gone (its pair's read or write failed)
_LOST_CONNECTION = ("Connection closed", "Connection reset", "Read error", "Write error",
                    "Broken pipe")


def lost_connection(exc: BaseException) -> str | None:
    """The backend's first line where ``exc`` says a peer's connection closed, else ``None``:
    on Gloo a peer whose wait passed its deadline first (or that died, or was killed) closes
    its sockets, and a peer still waiting reads that, not a timeout of its own."""
    text = str(exc)
    if not any(words in text for words in _LOST_CONNECTION):
        return None
    return text.splitlines()[0][:300]


def wait_future(future: Any, operation: str) -> Any:
    """``future.result()`` with the current deadline (the 2-D exchange's thread, whose
    collectives keep their groups' deadlines themselves: without a finite deadline of the
    call's own, the future waits for them)."""
    seconds = current()
    if seconds is not None and math.isinf(seconds):
        seconds = None
    start = time.monotonic()
    try:
        return future.result(timeout=seconds)
    except concurrent.futures.TimeoutError:
        raise CommTimeout(operation, time.monotonic() - start) from None
