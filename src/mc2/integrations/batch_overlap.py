"""Batch overlap: two micro-batches through the decoder layers, stage by stage.

Overlap inside one MoE layer hides an All-to-All behind that layer's experts at best, and pays a
pipeline fill and drain in every layer; during attention the link is idle. Here the batch is
split into two micro-batches (whole sequences) and every decoder layer runs as stages, so each
transfer of one micro-batch travels while the other computes, across layer boundaries. Results
are those of the unsplit batch: attention, norms, router and experts act on each sequence or
token alone.

A layer's stages are a generator (:data:`LayerStages`): it runs the layer up to its MoE block,
yields the begun call (:class:`mc2.engine.autograd.staged.StagedCall`), receives the block's
output and returns the layer's output. :func:`hf_layer_stages` does that for Hugging Face
decoder layers; a layer of your own gives a ``forward_staged(x)`` method (see
:class:`BatchOverlapStack`). When it runs is the engine's decision
(:mod:`mc2.engine.decide.batch_split`) and the schedule is the engine's
(:mod:`mc2.engine.autograd.layer_schedule`); this module adds the framework's side (the
caches, :mod:`.split_cache`; the recorded router logits, :mod:`.split_records`).

See docs/batch_overlap.md, 'The schedule' and 'When it runs'.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial, reduce
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from mc2.engine.autograd.layer_schedule import LayerStages
from mc2.engine.autograd.pairing import current_pairing
from mc2.engine.autograd.staged import micro_batch_label
from mc2.engine.decide.batch_split import MIN_TOKENS, BatchOverlapDecision, BatchOverlapWarning
from mc2.engine.decide.planner import planner_for
from mc2.parallel.layer_gather import LayerGathers
from mc2.integrations import split_cache
from mc2.integrations.layer_loop import run_layer_loop, split_value
from mc2.integrations.layer_recording import NOT_RECORDED, record_layer_call
from mc2.integrations.split_records import SplitRecords
from mc2.integrations.weight_reads import first_user_hook

__all__ = ["BatchOverlapStack", "BatchOverlapWarning", "MIN_TOKENS", "OverlappedLayers",
           "hf_layer_stages", "stage_problem"]

class BatchOverlapStack(nn.Module):
    """A stack of your own layers, run with batch overlap.

    Each layer gives ``forward_staged(x)``: a generator that runs the layer up to its MoE
    block, yields the block's begun call (``MoELayer.begin_staged(h)``), receives its output
    and returns the layer's output::

        def forward_staged(self, x):
            h = x + self.attention(self.norm1(x))
            out = yield self.moe.begin_staged(self.norm2(h))
            return h + out

    and a plain ``forward`` (used when batch overlap is off). ``x`` is ``[batch, seq, H]``;
    batches are split by sequence.
    """

    def __init__(self, layers: Sequence[nn.Module], *, batch_overlap: bool | str = True,
                 min_tokens: int = MIN_TOKENS, group: Any = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        for layer in self.layers:
            if not callable(getattr(layer, "forward_staged", None)):
                raise ValueError(f"BatchOverlapStack: {type(layer).__name__} has no "
                                 "forward_staged(x) (see the class docstring)")
        self.decision = planner_for(group).batch_overlap(batch_overlap, min_tokens=min_tokens,
                                                         group=group)

    def forward(self, x: Tensor) -> Tensor:
        stages = [layer.forward_staged for layer in self.layers]
        return run_layer_loop(
            self.decision, x, plain=lambda: reduce(lambda h, layer: layer(h), self.layers, x),
            stages=lambda sizes: [stages] * len(sizes), gathers=LayerGathers(self.layers),
            layers=self.layers)


def hf_layer_stages(layer: nn.Module, hidden_states: Tensor, *, kwargs: dict[str, Any]
                    ) -> LayerStages:
    """A Hugging Face decoder layer (``input_layernorm``, ``self_attn``,
    ``post_attention_layernorm``, ``mlp``; Mixtral, Qwen2-MoE, Qwen3-MoE) in stages, as its
    own ``forward`` computes it. With gradient checkpointing on, the part before the MoE block
    is checkpointed (the block's rows are kept, as :func:`mc2.checkpoint_policy` keeps them)."""

    def attention(h: Tensor) -> tuple[Tensor, Tensor]:
        x, _ = layer.self_attn(hidden_states=layer.input_layernorm(h), **kwargs)
        h = h + x
        return h, layer.post_attention_layernorm(h)

    if getattr(layer, "gradient_checkpointing", False) and layer.training \
            and torch.is_grad_enabled():
        h, x = layer._gradient_checkpointing_func(attention, hidden_states)
    else:
        h, x = attention(hidden_states)
    begin = getattr(layer.mlp, "begin_staged", None)
    if begin is None:
        return h + layer.mlp(x)
    out = yield begin(x)
    return h + out.view_as(h)  # an MC2 block's staged call ends with [tokens, H]


CACHE_KEYS = ("cache", "past_key_values")  # the name of the KV cache argument, new and old

STAGED_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def stage_problem(layer: nn.Module) -> str | None:
    """Why :func:`hf_layer_stages` cannot run ``layer``, or ``None``."""
    missing = [p for p in STAGED_PARTS if not isinstance(getattr(layer, p, None), nn.Module)]
    return f"{type(layer).__name__} has no {missing}" if missing else None


class _LayerCall:
    """What the model's loop calls for one layer: the call recorded
    (:func:`~mc2.integrations.layer_recording.record_layer_call`), so that the last one runs
    every layer (:class:`OverlappedLayers`); the others hand their input back unchanged, as
    the loop only threads it through."""

    def __init__(self, loop: "_Loop", index: int) -> None:
        self.loop, self.index = loop, index

    def __call__(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        layers = self.loop.layers
        out = record_layer_call(layers[self.index], self.index, len(layers), hidden_states,
                                (args, kwargs), self.loop.run)
        return layers[self.index](hidden_states, *args, **kwargs) if out is NOT_RECORDED \
            else out


def _hook_problem(layers: list[nn.Module]) -> str | None:
    """Where a decoder layer, or the MoE block it runs in stages, or that block's experts, has
    a forward hook of the user's: batch overlap calls their parts, not them, so the hook would
    not run, and that forward runs unsplit; else ``None``."""
    for index, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        parts = [(f"layer {index}", layer)]
        if getattr(mlp, "begin_staged", None) is not None:
            parts += [(f"layer {index}.mlp", mlp),
                      (f"layer {index}.mlp.experts", getattr(mlp, "experts", None))]
        if (problem := first_user_hook(parts)) is not None:
            return f"{problem}, which batch overlap would not call"
    return None


def _split_problem(calls: list[tuple[tuple, dict[str, Any]]], caches: list[tuple[str, Any]]
                   ) -> str | None:
    """Why the layer calls of one forward cannot be split into micro-batches, or ``None``."""
    if any(args for args, _ in calls):
        return "a decoder layer was given positional arguments besides hidden_states"
    if len(caches) > 1:
        return "the decoder layers were given different KV caches"
    return split_cache.unsplittable(caches[0][1]) if caches else None


class _Loop:
    """One pass of the model's layer loop over ``layers``."""

    def __init__(self, layers: list[nn.Module], decision: BatchOverlapDecision) -> None:
        self.layers, self.decision = layers, decision

    def run(self, hidden_states: Tensor, recorded: list[tuple[nn.Module, Any]]) -> Tensor:
        calls = [arguments for _, arguments in recorded]
        batch = hidden_states.shape[0]
        caches = {id(kw[k]): (k, kw[k]) for _, kw in calls for k in CACHE_KEYS
                  if kw.get(k) is not None}
        key, cache = next(iter(caches.values()), (None, None))
        records = SplitRecords()
        cache_parts: list[Any] = []

        def plain() -> Tensor:  # the layers one after the other, each its own forward
            h = hidden_states
            for layer, (args, kwargs) in zip(self.layers, calls):
                h = layer(h, *args, **kwargs)
            return h

        def stages(sizes: list[int]) -> list[list[Callable[[Tensor], LayerStages]]]:
            if cache is not None:
                cache_parts.extend(split_cache.split(cache, len(sizes)))
            layers: list[list[Callable[[Tensor], LayerStages]]] = [[] for _ in sizes]
            for layer, (_, kwargs) in zip(self.layers, calls):
                pieces = {name: split_value(value, batch, sizes) for name, value in kwargs.items()}
                for i in range(len(sizes)):
                    part = {name: values[i] for name, values in pieces.items()}
                    if cache is not None:
                        part[key] = cache_parts[i]
                    layers[i].append(partial(hf_layer_stages, layer, kwargs=part))
            return layers

        def joined() -> None:
            if cache is not None:
                split_cache.join(cache, cache_parts)
            records.join()

        return run_layer_loop(
            self.decision, hidden_states, plain=plain, stages=stages,
            problem=records.problem() or _split_problem(calls, list(caches.values()))
            or _hook_problem(self.layers),
            gathers=LayerGathers(self.layers), layers=self.layers,
            label=partial(_recording, records),
            joined=joined)


@contextmanager
def _recording(records: SplitRecords, label: int) -> Iterator[None]:
    """Micro-batch ``label``'s part: traced under its label, recording into its own lists."""
    with micro_batch_label(label), records.of(label):
        yield


class _LoopView:
    """``layers[:n]`` of :class:`OverlappedLayers`, as the model's forward loops over it."""

    def __init__(self, layers: list[nn.Module], decision: BatchOverlapDecision) -> None:
        self.loop = _Loop(layers, decision)

    def __iter__(self) -> Iterator[_LayerCall]:
        return iter([_LayerCall(self.loop, i) for i in range(len(self.loop.layers))])

    def __len__(self) -> int:
        return len(self.loop.layers)


class OverlappedLayers(nn.ModuleList):
    """A Hugging Face model's decoder layers with batch overlap.

    The same modules under the same names (state dicts and checkpoints do not change, and
    iterating it gives the layers). What differs is the slice the model's forward loops over
    (``for layer in self.layers[:n]: h = layer(h, **kwargs)``): its items record each layer's
    arguments, and the last runs the whole stack through :func:`run_overlapped` (or layer by
    layer when batch overlap is off for that forward). The runner calls the layers' parts,
    not the layers: a forward where a layer, its MoE block or the block's experts has a
    forward hook runs unsplit, said once (FSDP2's hooks are done by
    :class:`mc2.parallel.layer_gather.LayerGathers`; Hugging Face's output capturing records
    per micro-batch).
    """

    def __init__(self, modules: Any = None, *, decision: BatchOverlapDecision | None = None) -> None:
        super().__init__(modules)
        self.decision = decision if decision is not None else BatchOverlapDecision(False)

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, slice):
            layers = list(self._modules.values())[idx]
            plain = self.decision.chosen is False and current_pairing() is None
            return nn.ModuleList(layers) if plain else _LoopView(layers, self.decision)
        return super().__getitem__(idx)
