"""The one driver of a layer loop under batch overlap, for every framework.

Hugging Face's decoder loop, Megatron's ``TransformerBlock``, TorchTitan's ``Decoder`` and
:class:`~mc2.integrations.batch_overlap.BatchOverlapStack` each hand one forward of their
layers here, as two things only the framework knows: how its layers run one after the other
(``plain``: its own loop, hooks and all) and how each micro-batch's layers run in stages
(``stages(sizes)``: its layers' parts with each micro-batch's arguments). The rest is the same
for all of them, so it is written once: the decision agreed on every rank
(:class:`~mc2.engine.decide.batch_split.BatchOverlapDecision`), the split along the batch, the
engine's schedule (:func:`~mc2.engine.autograd.layer_schedule.run_overlapped`), the join, and
``"auto"``'s timing (:func:`~mc2.engine.decide.batch_split.timed_forward`).
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Sequence

import torch
from torch import Tensor, nn

from mc2.engine.autograd.layer_schedule import LayerGathers, LayerStages, run_overlapped
from mc2.engine.autograd.pairing import current_pairing
from mc2.engine.autograd.staged import micro_batch_label
from mc2.engine.decide.batch_split import SPLITS, BatchOverlapDecision, timed_forward
from mc2.engine.decide.config import MC2Config

StageLists = list[list[Callable[[Tensor], LayerStages]]]
"""Per micro-batch, its layers as ``h -> stages`` (the same layers, its own arguments)."""


def split_sizes(batch: int, parts: int = SPLITS) -> list[int]:
    """Sequences in each of ``parts`` micro-batches: as equal as they can be, so the token
    counts balance (equal lengths); the first ones take the remainder."""
    return [batch // parts + (i < batch % parts) for i in range(parts)]


def split_value(value: Any, batch: int, sizes: Sequence[int], dim: int = 0) -> list[Any]:
    """A layer argument for each micro-batch: tensors (and tuples of them) whose dimension
    ``dim`` is the batch are cut into ``sizes``; everything else goes to all."""
    if isinstance(value, Tensor) and value.dim() > dim and value.shape[dim] == batch:
        return list(value.split(list(sizes), dim=dim))
    if isinstance(value, tuple) and value and all(isinstance(v, Tensor) for v in value):
        parts = [split_value(v, batch, sizes, dim) for v in value]
        return [tuple(p[i] for p in parts) for i in range(len(sizes))]
    return [value] * len(sizes)


def capacity_problem(layers: Sequence[nn.Module], tokens: int) -> str | None:
    """Why ``tokens`` tokens through ``layers`` cannot be split: a call of theirs in capacity
    mode with fewer rows a destination than the tokens. Which rows fit its slabs depends on
    how many tokens each call holds, so a split forward would drop other rows than the
    unsplit one, and ``"auto"`` would choose results by timing (measured: 12 and 10 rows
    dropped unsplit, none split, outputs up to 11.9 apart). Where every call's capacity holds
    the tokens, nothing drops either way. ``None`` where nothing is in capacity mode."""
    for index, layer in enumerate(layers):
        for module in layer.modules():
            for name in ("config", "mc2_config"):  # MoELayer, HF's block; Megatron's layer
                config = vars(module).get(name)  # a plain attribute: no property of another's
                if isinstance(config, MC2Config) and config.capacity is not None \
                        and tokens > config.capacity:
                    return (f"layer {index} runs mc2 in capacity mode with capacity="
                            f"{config.capacity} under {tokens} tokens: which rows fit depends "
                            "on each call's tokens, so a split forward would drop other rows")
    return None


def run_layer_loop(decision: BatchOverlapDecision, x: Tensor, *, plain: Callable[[], Tensor],
                   stages: Callable[[list[int]], StageLists], batch_dim: int = 0,
                   problem: str | None = None, gathers: LayerGathers | None = None,
                   layers: Sequence[nn.Module] = (),
                   label: Callable[[int], ContextManager[None]] = micro_batch_label,
                   joined: Callable[[], None] | None = None) -> Tensor:
    """One forward of a layer loop on its input ``x`` (``[..., H]``, the batch along
    ``batch_dim``): split in two and run stage by stage where the decision wants it this
    forward, else ``plain()``; timed for an undecided ``"auto"``.

    Args:
        plain: the layers one after the other, as the framework runs them.
        stages: each micro-batch's layers in stages, for the given sequences per micro-batch.
        problem: why the framework cannot split this forward (said once), if it cannot.
        layers: the layers, whose calls in capacity mode may forbid a split
            (:func:`capacity_problem`).
        gathers: the layers' FSDP2 units, gathered and freed at the schedule's points.
        label: the context each micro-batch's parts run in (its trace label, and what else
            the framework keeps per micro-batch).
        joined: called after a split forward's outputs are joined (caches, records).
    """
    batch = x.shape[batch_dim]
    if current_pairing() is not None:
        # under forward_backward: the layers whole, as the framework runs them; their eager
        # calls pair between their own steps (mc2.engine.autograd.function)
        return plain()
    tokens = x.numel() // x.shape[-1]
    if problem is None and decision.chosen is not False:  # no scan where nothing would split
        problem = capacity_problem(layers, tokens)
    overlapped = decision.wanted(batch, tokens, problem)

    def split() -> Tensor:
        sizes = split_sizes(batch)
        layers = stages(sizes)
        parts = [p.contiguous() for p in x.split(sizes, dim=batch_dim)]
        out = torch.cat(run_overlapped(layers, parts, gathers, label), dim=batch_dim)
        if joined is not None:
            joined()
        return out

    return timed_forward(decision, overlapped, split if overlapped else plain, x.device,
                         first=x)
