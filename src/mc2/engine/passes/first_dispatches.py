"""Passes that share one link take turns with their first dispatch.

Why: batch overlap's backward begins with both micro-batches' top-layer gradient dispatches,
issued back to back (one loss reaches both at once). On a host backend (Gloo's worker threads)
the two then share the link, so the first arrives after twice its own time, and nothing of
either micro-batch can compute until it does: at 200 Mbit the first gradient dispatch was
waited for 0.55 s with the cores idle (``docs/batch_overlap.md``, "Where the step's time
goes"). Issued one after the other, the first arrives in its own time and the second travels
while the first micro-batch's expert backward runs, as the forward's second dispatch already
does within a call (:mod:`mc2.engine.passes.pipeline`, ``first_alone``).

A pass handed a :class:`FirstDispatches` asks it to issue its first dispatch: at once when no
other pass's first dispatch is in flight, else once that one has arrived (its pass reports the
arrival), or when this pass itself must wait for it, whichever comes first. Every rank runs the
same passes in the same order, so the issues keep one order on every rank. On a stream backend
a wait returns at once (the collectives of one communicator run one after the other anyway),
so the turn passes on at once and nothing changes.
"""

from __future__ import annotations

from typing import Any, Callable


class FirstDispatches:
    """The turns of the passes that share it (see the module docstring)."""

    def __init__(self) -> None:
        self._in_flight: Any = None  # the pass whose first dispatch travels, not yet arrived
        self._queued: list[tuple[Any, Callable[[], None]]] = []

    def issue(self, owner: Any, issue: Callable[[], None]) -> None:
        """Issue ``owner``'s first dispatch now, or queue it behind the one in flight."""
        if self._in_flight is None:
            self._in_flight = owner
            issue()
        else:
            self._queued.append((owner, issue))

    def before_wait(self, owner: Any) -> None:
        """``owner`` is about to wait for its first dispatch: issue it now if still queued."""
        for index, (queued, issue) in enumerate(self._queued):
            if queued is owner:
                del self._queued[index]
                issue()
                return

    def arrived(self, owner: Any) -> None:
        """``owner``'s first dispatch arrived: the next queued one goes."""
        if self._in_flight is owner:
            self._in_flight = None
            if self._queued:
                self.issue(*self._queued.pop(0))
