"""A framework's own layer loop, run with batch overlap without replacing the loop.

Megatron's ``TransformerBlock.forward`` and TorchTitan's ``Decoder.forward`` call their layers
one after the other (``h = layer(h, ...)``) and nothing else touches ``h`` in between.
Batch overlap needs every layer's arguments before the first one runs (it interleaves two
micro-batches across them), so each layer taking part hands its call to
:func:`record_layer_call`: the first (``index`` 0) opens a recording, the others add to it and
hand ``h`` back unchanged (the loop only threads it through), and the last runs them all.

A layer called with no recording open (called on its own, or in a pipeline stage whose first
layer is not this loop's first) is not recorded: :data:`NOT_RECORDED` tells it to run its
own forward. A call that breaks an open recording (out of order, or on another tensor than the
layers before handed back) raises: the recorded layers' work would otherwise be lost.

A recording whose last layer is never called (a loop that stops early, a layer after the
recorded ones that is no recording layer and so is not the last) would leave the forward's
output its input, unchanged. So a recording still open raises, naming the layer that never
ran, on every rank alike (every rank runs the same loop), at the first of:

- a module returning from its forward, other than the recorded layers, while the recording
  is open (a dense layer, a final norm run on the handed-back input): a global forward hook,
  held only while a recording is open;
- the block whose loop it is returning from its forward (the nearest module up the stack that
  holds the first layer, found at its first recording and hooked from then on: its first
  forward's own return was already under way, without hooks);
- the next forward's first layer, which finds the recording still open.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_hook

NOT_RECORDED = object()

_OPEN = threading.local()  # the recording of the forward running in this thread


class _Recording:
    def __init__(self, first: Tensor, count: int) -> None:
        self.first, self.count = first, count
        self.calls: list[tuple[Any, Any]] = []
        # while open: a module returning that is none of the recorded layers raises
        self.watch = register_module_forward_hook(self._returned)

    def never_ran(self) -> str:
        return (f"batch overlap: layers 0..{len(self.calls) - 1} of {self.count} were recorded "
                f"and layer {len(self.calls)} was never called, so they never ran and the "
                "loop's output was its input unchanged. Every recording layer of the loop "
                "must be called, in order, with the last one last")

    def _returned(self, module: nn.Module, args: Any, output: Any) -> None:
        if getattr(_OPEN, "current", None) is not self or \
                any(module is layer for layer, _ in self.calls):
            return
        _close()
        raise RuntimeError(f"{self.never_ran()} ({type(module).__name__} returned while the "
                           "recording was open)")


WATCHED = "_mc2_block_watched"  # set on a first layer once its block is hooked


def _watch_block(layer: Any) -> None:
    """Hook the block whose loop calls ``layer`` (the nearest module up the stack holding it),
    once: its forward returning with a recording open raises."""
    if not isinstance(layer, nn.Module) or layer.__dict__.get(WATCHED):
        return
    layer.__dict__[WATCHED] = True
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and owner is not layer and \
                any(m is layer for m in owner.modules()):
            owner.register_forward_hook(_block_returned)
            return
        frame = frame.f_back


def _block_returned(module: nn.Module, args: Any, output: Any) -> None:
    recording: _Recording | None = getattr(_OPEN, "current", None)
    if recording is not None:
        _close()
        raise RuntimeError(f"{recording.never_ran()} ({type(module).__name__}, the block, "
                           "returned while the recording was open)")


def _close() -> None:
    recording: _Recording | None = getattr(_OPEN, "current", None)
    _OPEN.current = None
    if recording is not None:
        recording.watch.remove()


def record_layer_call(layer: Any, index: int, count: int, hidden: Tensor, arguments: Any,
                      run: Callable[[Tensor, list[tuple[Any, Any]]], Tensor]) -> Any:
    """Record layer ``index`` of ``count`` called on ``hidden`` with ``arguments``; the last
    returns ``run(first input, [(layer, arguments), ...])``, the others ``hidden``;
    :data:`NOT_RECORDED` where this call is not the next of an open recording."""
    if index == 0:
        left: _Recording | None = getattr(_OPEN, "current", None)
        if left is not None:
            _close()
            raise RuntimeError(f"{left.never_ran()} (found at the next forward)")
        _OPEN.current = _Recording(hidden, count)
        _watch_block(layer)
    recording: _Recording | None = getattr(_OPEN, "current", None)
    if recording is None:
        return NOT_RECORDED
    if hidden is not recording.first or len(recording.calls) != index:
        _close()
        raise RuntimeError(
            f"batch overlap: layer {index} of {count} was called on another input than the "
            f"one layers 0..{len(recording.calls) - 1} handed back (or out of order); their "
            "work would be lost. The model's loop must call its layers in order and pass "
            "each one's output to the next unchanged")
    recording.calls.append((layer, arguments))
    if index < count - 1:
        return hidden
    _close()
    return run(recording.first, recording.calls)


def close_recording() -> None:
    """Close this thread's open recording, if any (a first layer that runs unrecorded: the
    ones after it then run their own forwards too)."""
    _close()
