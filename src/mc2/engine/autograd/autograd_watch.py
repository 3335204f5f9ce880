"""Autograd run inside a forward, where a paired forward could not run it.

On an accelerator autograd runs a backward in a device thread of its own (one per device).
Under a pairing that thread runs micro-batch n's backward, and it stops, inside the backward,
each time it gives way to micro-batch n+1's forward in the partner thread. A forward that
runs autograd itself (``torch.autograd.grad`` for a chunked loss, ``.backward()`` of a part,
``torch.func.grad``) hands its accelerator work to that same device thread, which is stopped
until the forward hands back: neither moves again, and the step hangs. On a CPU autograd
runs in the calling thread, and nothing waits; so it does on an accelerator where the caller
turned autograd's threads off (``torch.autograd.set_multithreading_enabled(False)``, as
TorchTitan's trainer does), and then nothing is watched.

Every such call enters autograd's engine through one Python function,
``torch.autograd.graph._engine_run_backward`` (``Tensor.backward``, ``torch.autograd.backward``
and ``.grad``, and what calls them: ``torch.func``, ``torch.autograd.functional``). While a
paired step runs where an accelerator is present, :class:`EngineWatch` wraps it (as torch's
own ``torch.compiler`` does for its tracing), so that the step can see such a call: in its
first forward, which runs alone in the caller's thread, to run the step unpaired (or refuse)
before any forward runs beside a backward; and in a paired forward, to raise a clear error
instead of hanging. Nothing is wrapped on a CPU-only machine, and no tensor operation pays
anything (a ``TorchFunctionMode`` would: a Python call per operation, and a second
compilation of every compiled region, whose guards check the mode stack).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator

import torch


def accelerator_present() -> bool:
    """Whether this process has an accelerator (apart, so that a test can emulate one)."""
    return torch.accelerator.is_available()


def watched() -> bool:
    """Whether a paired step, asked in its caller's thread, watches autograd at all: only
    where an accelerator is present (on a CPU autograd runs in the calling thread, and a
    paired forward may run it) and autograd runs a backward in device threads there. Not
    under ``torch.autograd.set_multithreading_enabled(False)`` (thread-local; TorchTitan's
    trainer sets it): the paired backward then runs in the caller's thread, and a forward's
    own autograd (the partner carries the switch) in the forward's."""
    return accelerator_present() and torch.autograd.is_multithreading_enabled()


class EngineWatch:
    """The process's wrap of autograd's engine entry: one per process (the entry is the
    process's), held by the pairings' process record. Installed at the first step that
    watches and never taken off (with no step watching it only forwards), so that another
    wrap of the same entry (``torch.compiler``'s, for its tracing) is never overwritten by a
    restore of ours, nor ours by theirs: a step finding the entry not ours wraps again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._checks: list[Callable[[Any], None]] = []  # the running steps', newest last
        self._inside = threading.local()  # a check running in this thread (wraps nest)

    def _install(self) -> None:
        """Our wrap at the entry: kept where it is there (under another's or not), else
        wrapped around whatever is there now. Ours inside another wrap inside ours checks
        once: the inner one sees the outer one's check running in its thread."""
        import torch.autograd.graph as graph

        current = graph._engine_run_backward
        if getattr(current, "_mc2_watch", None) is self:
            torch.autograd._engine_run_backward = current
            return
        checks, inside = self._checks, self._inside

        @functools.wraps(current)
        def entry(outputs: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(inside, "checking", False):
                return current(outputs, *args, **kwargs)
            inside.checking = True
            try:
                for check in list(checks):
                    check(outputs)
                return current(outputs, *args, **kwargs)
            finally:
                inside.checking = False

        entry._mc2_watch = self  # type: ignore[attr-defined]
        graph._engine_run_backward = torch.autograd._engine_run_backward = entry

    @contextlib.contextmanager
    def watching(self, check: Callable[[Any], None]) -> Iterator[None]:
        """``check(outputs)`` called at every entry into autograd's engine, from any thread,
        while the block runs (it may raise, refusing the call). Blocks of several steps
        nest."""
        with self._lock:
            self._install()
            self._checks.append(check)
        try:
            yield
        finally:
            with self._lock:
                self._checks.remove(check)
