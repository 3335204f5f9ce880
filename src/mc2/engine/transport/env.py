"""Environment variables mc2 reads, all in one place (for debugging and emergencies only).

* ``MC2_FORCE_SYNC=1``: never issue asynchronous collectives; ``fused_expert`` runs its
  micro-batches synchronously (nothing overlaps), warns once, and marks the timeline. Use it to
  rule out an overlap problem, or on a backend whose asynchronous path misbehaves. Waits are
  then plain synchronous collectives, bounded only by the process group's timeout.
* ``MC2_TIMEOUT=<seconds>``: the deadline of every wait of ``fused_expert`` when its
  ``timeout=`` is not given (default: each wait's process group's own timeout, never more than
  that; ``0``: none of mc2's own). Read by
  :func:`mc2.engine.transport.deadline.resolve_timeout`.
* ``MC2_ABORT_GRACE_S=<seconds>``: on a stream backend, how long the watchdog lets the abort
  of every process group take after a deadline passed (or, on a backend without abort, lets
  the caller report the timeout) before it ends the process (default
  :data:`mc2.engine.transport.watchdog.ABORT_GRACE_S`, 30). Read by :func:`abort_grace_s`.
* ``MC2_DEBUG_FORCE_COLLECTIVES=1``: a group of one rank runs the distributed path anyway
  (handshake, counts exchange, All-to-Alls to itself) instead of computing locally; for a
  device check on a machine with one accelerator (an NCCL world of one exercises the streams,
  the waits and the host reads of the real path). Never needed otherwise.
* ``MC2_DEBUG_SAVE_DELAY_S=<seconds>``: ``mc2.checkpoint.save`` (and so ``mc2 train``) waits
  this long between writing a checkpoint and publishing it (the rename), so that a test, or a
  user rehearsing recovery, can kill the job in the middle of a save. Never needed otherwise.
"""

from __future__ import annotations

import os
import warnings

class SyncFallbackWarning(UserWarning):
    """Overlap was requested but communication runs synchronously."""


def flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to a true value (1, true, yes, on)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def force_sync() -> bool:
    return flag("MC2_FORCE_SYNC")


def force_collectives() -> bool:
    return flag("MC2_DEBUG_FORCE_COLLECTIVES")


def warn_sync_fallback(reason: str) -> None:
    """Say once (per reason) that the pipeline fell back to synchronous communication."""
    warnings.warn(f"mc2: overlap requested but {reason}; communication runs synchronously "
                  "and nothing is hidden", SyncFallbackWarning, stacklevel=3)


def debug_save_delay() -> float:
    """``MC2_DEBUG_SAVE_DELAY_S`` in seconds (0 when unset)."""
    text = os.environ.get("MC2_DEBUG_SAVE_DELAY_S", "").strip()
    return float(text) if text else 0.0


def abort_grace_s(default: float) -> float:
    """``MC2_ABORT_GRACE_S`` in seconds, else ``default``.

    Raises:
        ValueError: the variable is not a non-negative number.
    """
    text = os.environ.get("MC2_ABORT_GRACE_S", "").strip()
    if not text:
        return default
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"MC2_ABORT_GRACE_S must be a number of seconds >= 0, got {text!r}")
    return seconds
