"""Batch overlap's schedule across layers: micro-batches through their layers, stage by stage.

A layer's stages are a generator (:data:`LayerStages`): it runs the layer up to its MoE call,
yields the begun call (:class:`mc2.engine.autograd.staged.StagedCall`), receives the call's
output and returns the layer's output. :func:`run_overlapped` interleaves two (or more)
micro-batches' layers so that each transfer of one travels while another computes, across
layer boundaries (the picture is in :mod:`mc2.integrations.batch_overlap`); within a call the
pass's own schedule (:mod:`mc2.engine.passes.pipeline`) is three plain steps, one per staged
Function (:mod:`mc2.engine.autograd.staged`), and between them the other micro-batch's work runs. The
backward interleaves the same way by itself. Framework code only hands it layers as stages
(:func:`mc2.integrations.batch_overlap.hf_layer_stages`).
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Generator, Protocol, Sequence

from torch import Tensor

from mc2.engine.autograd.staged import micro_batch_label

LayerStages = Generator[Any, Tensor, Tensor]
"""A layer run in stages: yields one begun MoE call (or none), is sent its output, returns the
layer's output."""


def advance(stages: LayerStages) -> tuple[Any, Any]:
    """Run a layer's stages to its MoE call: ``(the begun call, None)``, or ``(None, the
    layer's output)`` where it ends without one."""
    try:
        return next(stages), None
    except StopIteration as stop:
        return None, stop.value


class LayerGathers(Protocol):
    """Where a layer's parameters are gathered and freed around its turn (FSDP2 units:
    :class:`mc2.parallel.layer_gather.LayerGathers`)."""

    def gather(self, index: int) -> None: ...

    def done(self, index: int, outputs: list[Tensor]) -> None: ...


def finish_stages(stages: LayerStages, call: Any) -> Tensor:
    """Wait for the call's combine and run the rest of the layer."""
    out = call.end()
    try:
        stages.send(out)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("a layer's stages yielded more than one MoE call")


def run_overlapped(layers: Sequence[Sequence[Callable[[Tensor], LayerStages]]],
                   inputs: Sequence[Tensor], gathers: LayerGathers | None = None,
                   label: Callable[[int], ContextManager[None]] = micro_batch_label
                   ) -> list[Tensor]:
    """The micro-batches ``inputs`` through their layers (``layers[i]``: micro-batch ``i``'s,
    each ``h -> stages``; the same layers, with each micro-batch's own arguments) in the
    schedule of the module docstring, round robin; their outputs.

    In every layer each micro-batch in turn waits for its previous combine (which travelled
    while the others computed), runs its attention and issues its dispatch; then each runs
    its experts and issues its combine. ``gathers``: the layers' FSDP2 units, gathered and
    freed at the schedule's points (:class:`mc2.parallel.layer_gather.LayerGathers`);
    ``label(i)``: the context micro-batch ``i``'s parts run in (its trace label, and what
    else the caller keeps per micro-batch)."""
    count = len(inputs)
    if count < 2 or len(layers) != count:
        raise ValueError(f"run_overlapped: {count} inputs for {len(layers)} lists of layers "
                         "(two or more of each, as many of one as of the other)")
    h = list(inputs)
    pending: list[tuple[LayerStages, Any] | None] = [None] * count
    through: dict[int, list[Tensor]] = {}  # layer -> outputs of the micro-batches through it

    def leave(index: int, i: int, out: Tensor) -> None:  # micro-batch i is through a layer
        h[i] = out
        outs = through.setdefault(index, [])
        outs.append(out)
        if len(outs) == count:
            del through[index]
            if gathers:
                gathers.done(index, outs)

    def finish(index: int, i: int) -> None:  # wait for i's combine, run the rest of its layer
        if pending[i] is not None:
            stages, call = pending[i]
            pending[i] = None
            with label(i):
                leave(index, i, finish_stages(stages, call))

    depth = 0
    for depth, row in enumerate(zip(*layers)):
        for i, layer in enumerate(row):
            finish(depth - 1, i)  # its combine travelled under the others' work
            if i == 0 and gathers:
                gathers.gather(depth)
            with label(i):
                stages = layer(h[i])
                call, done = advance(stages)  # up to its MoE call (none: its output)
            if call is None:
                leave(depth, i, done)
            else:
                pending[i] = (stages, call)
        for entry in pending:
            if entry is not None:
                entry[1].experts()
    for i in range(count):
        finish(depth, i)
    return h
