"""Autograd run inside a forward, where a paired forward could not run it.

On an accelerator autograd runs a backward in a device thread of its own (one per device).
Under a pairing that thread runs micro-batch n's backward, and it stops, inside the backward,
each time it gives way to micro-batch n+1's forward in the partner thread. A forward that
runs autograd itself (``torch.autograd.grad`` for a chunked loss, ``.backward()`` of a part,
``torch.func.grad``) hands its accelerator work to that same device thread, which is stopped
until the forward hands back: neither moves again, and the step hangs. On a CPU autograd
runs in the calling thread, and nothing waits.

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
import threading
from typing import Any, Callable, Iterator

import torch

def watched() -> bool:
    """Whether a paired step watches autograd at all: only where an accelerator is present
    (on a CPU autograd runs in the calling thread, and a paired forward may run it)."""
    return torch.accelerator.is_available()


class EngineWatch:
    """The process's wrap of autograd's engine entry: one per process (the entry is the
    process's), held by the pairings' process record, wrapped while any step watches."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._checks: list[Callable[[], None]] = []  # the running steps', newest last
        self._original: Any = None

    def _entry(self, *args: Any, **kwargs: Any) -> Any:
        for check in list(self._checks):
            check()
        return self._original(*args, **kwargs)

    @contextlib.contextmanager
    def watching(self, check: Callable[[], None]) -> Iterator[None]:
        """``check()`` called at every entry into autograd's engine, from any thread, while
        the block runs (it may raise, refusing the call). Blocks of several steps nest."""
        import torch.autograd.graph as graph

        with self._lock:
            if not self._checks:
                self._original = graph._engine_run_backward
                graph._engine_run_backward = torch.autograd._engine_run_backward = self._entry
            self._checks.append(check)
        try:
            yield
        finally:
            with self._lock:
                self._checks.remove(check)
                if not self._checks:
                    graph._engine_run_backward = self._original
                    torch.autograd._engine_run_backward = self._original
                    self._original = None
