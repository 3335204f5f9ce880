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
recorded ones that is no recording layer and so is not the last) left the forward's output
its input, unchanged, and nothing said so. The next forward's first layer finds it still open
and raises, naming the layer that never ran, on every rank alike (every rank runs the same
loop): one forward late, since nothing of the loop's own marks its end, but never silent
for a training run.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from torch import Tensor

NOT_RECORDED = object()

_OPEN = threading.local()  # the recording of the forward running in this thread


class _Recording:
    def __init__(self, first: Tensor, count: int) -> None:
        self.first, self.count = first, count
        self.calls: list[tuple[Any, Any]] = []


def record_layer_call(layer: Any, index: int, count: int, hidden: Tensor, arguments: Any,
                      run: Callable[[Tensor, list[tuple[Any, Any]]], Tensor]) -> Any:
    """Record layer ``index`` of ``count`` called on ``hidden`` with ``arguments``; the last
    returns ``run(first input, [(layer, arguments), ...])``, the others ``hidden``;
    :data:`NOT_RECORDED` where this call is not the next of an open recording."""
    if index == 0:
        left: _Recording | None = getattr(_OPEN, "current", None)
        if left is not None:
            _OPEN.current = None
            raise RuntimeError(
                f"batch overlap: the previous forward recorded layers 0..{len(left.calls) - 1} "
                f"of {left.count} and layer {len(left.calls)} was never called, so they never "
                "ran and that forward's output was its input unchanged. Every recording layer "
                "of the loop must be called, in order, with the last one last")
        _OPEN.current = _Recording(hidden, count)
    recording: _Recording | None = getattr(_OPEN, "current", None)
    if recording is None:
        return NOT_RECORDED
    if hidden is not recording.first or len(recording.calls) != index:
        _OPEN.current = None
        raise RuntimeError(
            f"batch overlap: layer {index} of {count} was called on another input than the "
            f"one layers 0..{len(recording.calls) - 1} handed back (or out of order); their "
            "work would be lost. The model's loop must call its layers in order and pass "
            "each one's output to the next unchanged")
    recording.calls.append((layer, arguments))
    if index < count - 1:
        return hidden
    _OPEN.current = None
    return run(recording.first, recording.calls)


def close_recording() -> None:
    """Close this thread's open recording, if any (a first layer that runs unrecorded: the
    ones after it then run their own forwards too)."""
    _OPEN.current = None
