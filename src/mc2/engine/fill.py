"""Work to run while a backward's transfers travel (cross-pass overlap).

A backward whose call stops before a wait (its transfers issued, not yet arrived) has nothing
of its own to compute until they arrive. Cross-pass overlap
(:mod:`mc2.integrations.cross_pass`) runs the *next* micro-batch's forward there, a stage at a
time: :func:`filling` installs that work for the length of one backward, and every backward
stop of a fused call (plain or staged) calls :func:`fill`.

A module global, not a context variable: on an accelerator the autograd engine runs the
backward on its own device thread, where a context variable set by the caller is not seen.
One backward fills at a time (the caller's), and a fill never fills again from inside itself
(the forward it runs has stops of its own).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

_filler: Callable[[], None] | None = None
_inside = False


@contextmanager
def filling(work: Callable[[], None]) -> Iterator[None]:
    """Run ``work()`` at every backward stop inside (one slice of work per call)."""
    global _filler
    if _filler is not None:
        raise RuntimeError("mc2: a backward is already being filled (cross-pass overlap "
                           "runs one at a time)")
    _filler = work
    try:
        yield
    finally:
        _filler = None


def fill() -> None:
    """At a backward stop: the installed work's next slice, if any (never reentered)."""
    global _inside
    if _filler is None or _inside:
        return
    _inside = True
    try:
        _filler()
    finally:
        _inside = False
