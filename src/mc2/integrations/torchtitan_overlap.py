"""Batch overlap in TorchTitan: a Qwen3 MoE or DeepSeek-V3 model's decoder layers run as two
micro-batches, stage by stage, so that one micro-batch's All-to-Alls travel under the other's
attention, router, shared experts and experts, across layer boundaries (the schedule is
:mod:`mc2.integrations.batch_overlap`'s, the engine's :func:`run_overlapped`).

The ``mc2_batch_overlap`` override makes every decoder layer an :class:`MC2Qwen3TransformerBlock`
/ :class:`MC2DeepSeekV3TransformerBlock`, which records its call and hands ``h`` back; the last
runs them all (:mod:`~mc2.integrations.layer_recording`) through the blocks' own parts. Recorded
calls do not run the blocks' hooks, so FSDP2's gathers and reduce-scatters run at the schedule's
own points (:class:`mc2.parallel.layer_gather.LayerGathers`). Blocks TorchTitan did not
parallelize are not recorded: there is nothing to overlap, and no check of the parallelisms ran.

See docs/torchtitan.md, 'Batch overlap across layers' (switching it on, what runs unsplit,
what is refused and why).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mc2.engine.autograd.function import saved_tensor_hooks_active
from mc2.engine.autograd.layer_schedule import LayerStages
from mc2.engine.decide.batch_split import MIN_TOKENS, SPLITS, BatchOverlapDecision, check_mode, say_once
from mc2.engine.decide.planner import planner_for
from mc2.integrations.layer_loop import run_layer_loop, split_sizes
from mc2.integrations.layer_recording import NOT_RECORDED, close_recording, record_layer_call
from mc2.integrations.torchtitan import (
    MC2RoutedExperts, mc2_config_of, mc2_routed_experts, shared_views)
from mc2.integrations.weight_reads import first_user_hook, user_hook_problem
from mc2.parallel.layer_gather import LayerGathers

from torchtitan.config import derive, override
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.moe import MoE
from torchtitan.models.deepseek_v3.model import DeepSeekV3TransformerBlock
from torchtitan.models.qwen3.model import Qwen3TransformerBlock


def split_block_mask(mask: Any, sizes: list[int]) -> list[Any]:
    """A flex-attention ``BlockMask`` of the whole batch as one per micro-batch (``sizes``
    sequences each, in order): its block tables sliced by batch, and its ``mask_mod`` (which
    indexes the batch: TorchTitan's document masks read ``positions[b]``) shifted to the
    slice's first sequence. A mask broadcast over the batch (batch dimension 1) is shared."""
    if mask.kv_num_blocks.shape[0] == 1:
        return [mask] * len(sizes)
    parts, start = [], 0
    for n in sizes:
        part = mask[start:start + n]
        part.mask_mod = partial(_shifted, mask.mask_mod, start)
        parts.append(part)
        start += n
    return parts


def _shifted(mask_mod: Any, offset: int, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return mask_mod(b + offset, h, q, kv)


def _split_masks(masks: Any, batch: int, sizes: list[int]) -> list[Any] | str:
    """The attention masks per micro-batch, or why they cannot be split."""
    if masks is None:
        return [None] * len(sizes)
    if hasattr(masks, "kv_num_blocks") and hasattr(masks, "mask_mod"):  # a BlockMask
        return split_block_mask(masks, sizes)
    return (f"batch overlap is off for this forward: {type(masks).__name__} attention masks "
            "(varlen) pack the batch's sequences together and are not split")


def titan_layer_stages(block: nn.Module, h: Tensor, *, masks: Any,
                       positions: Tensor | None) -> LayerStages:
    """A TorchTitan decoder block in stages, from its own parts, as its ``forward`` computes
    it: attention with its residual, the FFN norm, and the MoE block (router, token counters,
    the staged routed call with the shared experts inside; a dense block's FFN runs whole)."""
    h = h + block.attention(block.attention_norm(h), masks, positions)
    x = block.ffn_norm(h)
    if not block.moe_enabled:
        return h + block.feed_forward(x)
    moe = block.moe
    scores, ids, shared, scale = _routed(moe, x)
    call = moe.routed_experts.begin_staged(x, scores, ids, shared=shared, shared_scale=scale)
    beside = _beside(moe, x, shared)  # under the dispatch just issued
    out = (yield call).view_as(x).to(x.dtype)
    return h + (out if beside is None else out + beside)


def titan_block_forward(block: nn.Module, h: Tensor, masks: Any,
                        positions: Tensor | None) -> Tensor:
    """The block unsplit, as TorchTitan's ``forward`` computes it, with mc2's in-layer call
    and the shared experts inside it (EP > 1; with EP = 1, TorchTitan's MoE block)."""
    h = h + block.attention(block.attention_norm(h), masks, positions)
    x = block.ffn_norm(h)
    if not block.moe_enabled:
        return h + block.feed_forward(x)
    moe = block.moe
    if not isinstance(moe.routed_experts, MC2RoutedExperts) or \
            moe.routed_experts.ep_group is None or _moe_hook_problem(block) is not None:
        return h + moe(x)  # called: its hooks, and its routed experts' hooks, run
    scores, ids, shared, scale = _routed(moe, x)
    out = moe.routed_experts.with_shared(x, scores, ids, shared, scale)
    beside = _beside(moe, x, shared)
    return h + (out if beside is None else out + beside)


def _moe_hook_problem(block: nn.Module) -> str | None:
    """Where a block's MoE module or its routed experts has a hook of the user's, or the MoE
    computes with a forward other than TorchTitan's own (:func:`titan_layer_stages` and
    :func:`titan_block_forward` run their parts, not them), what; else ``None``."""
    if not block.moe_enabled:
        return None
    if type(block.moe).forward is not MoE.forward:  # a subclass's would be skipped, silently
        return f"moe: {type(block.moe).__name__} has a forward of its own"
    return first_user_hook((("moe", block.moe), ("moe.routed_experts", block.moe.routed_experts)))


def _hook_problem(blocks: list[nn.Module]) -> str | None:
    """Why this forward runs unsplit because of a hook: a block's own (the stages call its
    parts) or one :func:`_moe_hook_problem` finds; else ``None``."""
    for index, block in enumerate(blocks):
        if (problem := user_hook_problem(block) or _moe_hook_problem(block)) is not None:
            return f"block {index}: {problem}, which batch overlap would not call"
    return None


def _routed(moe: nn.Module, x: Tensor) -> tuple[Tensor, Tensor, tuple, Tensor | None]:
    """``MoE.forward``'s router and expert-usage counter (additive over micro-batches), and
    the shared experts as in-call views where they can be (:func:`shared_views`): ``(scores,
    ids, (up, gate, down) or Nones, scale)``."""
    scores, ids, scores_all = moe.router(x, moe.expert_bias_E)
    if moe.training:
        with torch.no_grad():
            routed = torch.zeros_like(scores_all, dtype=torch.bool).scatter_(-1, ids, True)
            moe.tokens_per_expert_E.add_(routed.sum(dim=(0, 1)))
    inside = shared_views(moe.shared_experts, x) if moe.shared_experts is not None else None
    shared, scale = inside if inside is not None else ((None, None, None), None)
    return scores, ids, shared, scale


def _beside(moe: nn.Module, x: Tensor, shared: tuple) -> Tensor | None:
    """The shared experts' output where they could not run inside the call, else ``None``."""
    return moe.shared_experts(x) if moe.shared_experts is not None and shared[0] is None \
        else None


def _run_layers(x: Tensor, calls: list[tuple[Any, tuple[Any, Tensor | None]]]) -> Tensor:
    """The recorded blocks of one ``Decoder.forward`` on its input ``x``: split in two along
    the batch and run stage by stage, or, where this forward cannot be split, each block as
    TorchTitan calls it (with its hooks)."""
    first: _OverlapBlock = calls[0][0]
    masks, positions = calls[0][1]
    batch = x.shape[0]
    decision, problem = first.decision_for(calls)
    masks_split = _split_masks(masks, batch, split_sizes(batch)) if batch >= SPLITS else []
    if problem is None and isinstance(masks_split, str):
        problem = masks_split
    problem = problem or _hook_problem([block for block, _ in calls])

    def plain() -> Tensor:  # TorchTitan's own loop
        h = x
        for block, (masks, positions) in calls:
            h = nn.Module.__call__(block, h, masks, positions)
        return h

    def stages(sizes: list[int]) -> list[list[Any]]:
        assert not isinstance(masks_split, str)
        pos = [None] * len(sizes) if positions is None or positions.shape[0] != batch \
            else list(positions.split(sizes))
        return [[partial(titan_layer_stages, block, masks=masks_split[i], positions=pos[i])
                 for block, _ in calls] for i in range(len(sizes))]

    blocks = [block for block, _ in calls]
    return run_layer_loop(decision, x, plain=plain, stages=stages, problem=problem,
                          gathers=LayerGathers(blocks), layers=blocks)


class _OverlapBlock:
    """What both of TorchTitan's decoder blocks get under batch overlap: the call recorded
    (see the module docstring). ``config``: the block's, with the fields of
    :func:`_overlap_config`."""

    def _setup(self, config: Any) -> None:
        self.index, self.stage_layers = config.index, config.stage_layers
        self.overlap_mode, self.min_tokens = config.batch_overlap, config.min_tokens
        self.decision: BatchOverlapDecision | None = None
        # set by parallelize, after its refusals: only then is the block recorded
        self.parallel_checked = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``block(h, attention_masks, positions)`` recorded, or run unsplit
        (:meth:`forward`)."""
        if self.overlap_mode is not False and not self.parallel_checked:
            say_once("the decoder blocks were not parallelized by TorchTitan (EP = 1 and no "
                     "TP under partial_dtensor), so no pipeline / tensor / context "
                     "parallelism was checked: each block runs whole")
        if kwargs or len(args) not in (2, 3) or self.stage_layers < 2 or \
                self.overlap_mode is False or not self.parallel_checked or (
                    self.index == 0 and self.decision is not None
                    and self.decision.chosen is False):
            if self.index == 0:
                close_recording()
            return nn.Module.__call__(self, *args, **kwargs)
        if self.index == 0 and saved_tensor_hooks_active():
            raise ValueError(
                "mc2_batch_overlap: the decoder blocks run under activation checkpointing "
                "(TorchTitan's activation_checkpoint.mode 'full' or 'selective'), whose "
                "recompute would run the recorded layers' All-to-Alls again; set mode='none' "
                "or switch to mc2_routed_experts")
        h, masks, positions = (*args, None)[:3]
        out = record_layer_call(self, self.index, self.stage_layers, h, (masks, positions),
                                _run_layers)
        return nn.Module.__call__(self, *args) if out is NOT_RECORDED else out

    def forward(self, x: Tensor, attention_masks: Any,
                positions: Tensor | None = None) -> Tensor:
        """The block unsplit (:func:`titan_block_forward`): where batch overlap is off, or
        this forward cannot be split, the shared experts still run inside the call."""
        return titan_block_forward(self, x, attention_masks, positions)

    def parallelize(self, parallel_dims: Any) -> None:
        """TorchTitan's parallelize, after refusing (every rank alike) the parallelisms the
        recorded stack does not run: pipeline stages (a stage's blocks would wait for a last
        block it does not hold), tensor and context parallelism (their sharded activations
        and masks are not split by batch here). Only a block checked here is recorded."""
        for name, field in (("pp", "pipeline_parallel_degree"), ("tp", "tensor_parallel_degree"),
                            ("cp", "context_parallel_degree")):
            if getattr(parallel_dims, f"{name}_enabled", False):
                raise ValueError(f"mc2_batch_overlap: {name} > 1 (parallelism.{field}) is not "
                                 "supported (the decoder blocks run as one recorded stack, "
                                 "split by batch); use mc2_routed_experts with it")
        super().parallelize(parallel_dims)  # type: ignore[misc]
        self.parallel_checked = True

    def decision_for(self, calls: list[tuple[Any, Any]]) -> tuple[BatchOverlapDecision,
                                                                   str | None]:
        """This stack's decision (made on the first forward) and why this forward cannot be
        split, if it cannot.

        The decision is agreed on every rank, not on the EP group of its MoE blocks: FSDP's
        gathers and reduce-scatters span the EP groups, and a group that split while another
        did not would issue them at other points of the step (seen: a reduce-scatter that
        never met its peers). Every rank runs these blocks (pipeline stages with EP are
        refused), so every rank reaches the agreement."""
        groups = [block.moe.routed_experts.ep_group for block, _ in calls if block.moe_enabled
                  and isinstance(block.moe.routed_experts, MC2RoutedExperts)]
        group = groups[0] if groups else None
        if self.decision is None:
            world = dist.group.WORLD
            self.decision = planner_for(world).batch_overlap(
                self.overlap_mode, min_tokens=self.min_tokens, group=world)
        problem = None
        if group is None:
            problem = "batch overlap is off: no MoE block has an expert-parallel group (EP = 1)"
        return self.decision, problem


def _overlap_config(base: type) -> type:
    """``base.Config`` with batch overlap's fields (where the block sits in the stack, its
    mode, the tokens below which a forward runs unsplit)."""
    @dataclass(kw_only=True, slots=True)
    class Config(base.Config):  # type: ignore[name-defined]
        index: int = 0
        stage_layers: int = 1
        batch_overlap: bool | str = True
        min_tokens: int = MIN_TOKENS
    return Config


class MC2Qwen3TransformerBlock(_OverlapBlock, Qwen3TransformerBlock):
    """TorchTitan's Qwen3 block taking part in batch overlap (module docstring)."""

    Config = _overlap_config(Qwen3TransformerBlock)

    def __init__(self, config: Any) -> None:
        Qwen3TransformerBlock.__init__(self, config)
        self._setup(config)


class MC2DeepSeekV3TransformerBlock(_OverlapBlock, DeepSeekV3TransformerBlock):
    """TorchTitan's DeepSeek-V3 block taking part in batch overlap (module docstring)."""

    Config = _overlap_config(DeepSeekV3TransformerBlock)

    def __init__(self, config: Any) -> None:
        DeepSeekV3TransformerBlock.__init__(self, config)
        self._setup(config)


_BLOCKS = {Qwen3TransformerBlock.Config: MC2Qwen3TransformerBlock,
           DeepSeekV3TransformerBlock.Config: MC2DeepSeekV3TransformerBlock}


@override(target=Decoder.Config,
          description="mc2: batch overlap, two micro-batches through the decoder layers")
def mc2_batch_overlap(cfg: Decoder.Config, *, batch_overlap: bool | str = True,
                      min_tokens: int = MIN_TOKENS, **options: Any) -> Decoder.Config:
    """TorchTitan override factory: the model's decoder layers (``cfg.layers``, replaced in
    place: the trainer builds the model config object it holds) become batch-overlap blocks
    and their routed experts mc2's; ``options`` are :class:`~mc2.MC2Config` fields. Checked
    here, so that a bad value fails at configuration, on every rank.

    Raises:
        ValueError: ``batch_overlap`` not ``True``, ``False`` or ``"auto"``; an option that is
            no MC2Config field; a layer of a block type other than Qwen3's or DeepSeek-V3's.
    """
    check_mode(batch_overlap, "batch_overlap", "mc2_batch_overlap")
    mc2_config_of(options)
    layers = []
    for index, layer in enumerate(cfg.layers):
        block = next((b for c, b in _BLOCKS.items() if type(layer) in (c, b.Config)), None)
        if block is None:
            raise ValueError(f"mc2_batch_overlap: layers[{index}] is "
                             f"{type(layer).__qualname__}; batch overlap runs Qwen3's and "
                             "DeepSeek-V3's decoder blocks")
        moe = layer.moe
        if moe is not None and not isinstance(moe.routed_experts, MC2RoutedExperts.Config):
            moe.routed_experts = mc2_routed_experts(moe.routed_experts, **options)
        layers.append(derive(layer, block.Config, index=index, stage_layers=len(cfg.layers),
                             batch_overlap=batch_overlap, min_tokens=min_tokens))
    cfg.layers[:] = layers
    return cfg
