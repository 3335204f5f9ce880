"""Batch overlap in Megatron-Core: a ``GPTModel``'s decoder layers run as two micro-batches,
stage by stage, so that one micro-batch's All-to-Alls travel under the other's attention,
router and experts, across layer boundaries (the schedule is
:mod:`mc2.integrations.batch_overlap`'s, the engine's :func:`run_overlapped`).

``use_mc2(spec, batch_overlap=True)`` builds every ``TransformerLayer`` as
:class:`MC2TransformerLayer` (``TransformerLayer``'s keys), which records its call and hands
the hidden states back; the stage's last layer runs them all, split along the batch (dim 1 of
``[s, b, h]``), through Megatron's own parts of each layer. The split step equals the unsplit
one because every part acts on each sequence alone; router terms that average over the whole
batch would not, so :func:`batch_overlap_problem` refuses them, and the paths this schedule does
not run.

See docs/megatron.md, 'Batch overlap across layers' (what runs unsplit, what is refused).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import Tensor

from mc2.engine.autograd.layer_schedule import LayerStages
from mc2.engine.autograd.pairing import current_pairing
from mc2.engine.decide.batch_split import MIN_TOKENS, BatchOverlapDecision
from mc2.engine.decide.planner import planner_for
from mc2.integrations.layer_loop import run_layer_loop, split_value
from mc2.integrations.weight_reads import first_user_hook
from mc2.integrations.layer_recording import (
    NOT_RECORDED, close_recording, record_layer_call)

from torch.distributed.fsdp import FSDPModule

from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import get_pg_rank

# the layer arguments whose first dimension is the batch (``[b, ...]``); every other one is
# the same for both micro-batches (rotary embeddings ``[s, 1, 1, d]``, a ``[1, 1, s, s]`` mask)
BATCH_FIRST = ("attention_mask", "attention_bias", "padding_mask")


def batch_overlap_problem(config: Any) -> str | None:
    """Why a ``TransformerConfig`` cannot run with batch overlap, or ``None``; the reason names
    the field to change."""
    def nonzero(value: Any) -> bool:
        return any(float(v) != 0.0 for v in (value if isinstance(value, (list, tuple))
                                              else [value or 0.0]))

    why = "batch overlap routes each half of the batch by itself, so"
    if getattr(config, "recompute_granularity", None) == "full":
        return ("recompute_granularity='full' checkpoints whole layers, which batch overlap "
                "runs in parts: use 'selective' or None")
    parts = {"mlp", "layernorm"} & set(getattr(config, "recompute_modules", None) or ())
    if parts and getattr(config, "recompute_granularity", None) == "selective":
        # 'layernorm': the layer keeps its pre-MLP norm's checkpoint on itself from the norm
        # to the MLP's bias-dropout-add, and the other half's norm runs in between
        return (f"recompute_modules must not hold {sorted(parts)} under batch overlap (it "
                "runs a layer's MLP part for two micro-batches in turn)")
    if getattr(config, "cpu_offloading", False) or getattr(
            config, "fine_grained_activation_offloading", False):
        return ("cpu_offloading and fine_grained_activation_offloading must be off under batch "
                "overlap")
    if getattr(config, "mtp_num_layers", None):
        return ("mtp_num_layers must be None under batch overlap (the multi-token-prediction "
                "block calls its layers outside the decoder's loop)")
    if (getattr(config, "context_parallel_size", 1) or 1) > 1:
        return ("context_parallel_size must be 1 under batch overlap (not checked with it)")
    if nonzero(getattr(config, "moe_aux_loss_coeff", 0.0)):
        return (f"{why} a load-balancing loss over the batch would be another loss: set "
                "moe_aux_loss_coeff=0 (the aux-loss-free expert bias, "
                "moe_router_enable_expert_bias, is per token and runs)")
    if nonzero(getattr(config, "moe_z_loss_coeff", None)):
        return f"{why} the z loss's batch mean would be another loss: set moe_z_loss_coeff=None"
    if getattr(config, "moe_expert_capacity_factor", None) is not None:
        return (f"{why} a capacity over the batch would drop other tokens: set "
                "moe_expert_capacity_factor=None")
    if "sinkhorn" in str(getattr(config, "moe_router_load_balancing_type", "")):
        return (f"{why} Sinkhorn's normalisation over the batch would route otherwise: use "
                "another moe_router_load_balancing_type")
    return None


def megatron_layer_stages(layer: TransformerLayer, hidden_states: Tensor, *,
                          kwargs: dict[str, Any]) -> LayerStages:
    """A Megatron ``TransformerLayer`` in stages, from its own parts, as its ``forward``
    computes it: attention (with its residual), the pre-MLP norm, the MoE layer's staged call
    (a dense MLP runs whole), and the MLP's bias-dropout-add."""
    h, _ = layer._forward_attention(hidden_states, **kwargs)
    x = layer._forward_pre_mlp_layernorm(h)
    begin = getattr(layer.mlp, "begin_staged", None)
    if begin is None:
        return layer._forward_post_mlp(layer.mlp(x, padding_mask=kwargs.get("padding_mask")), h)
    call = begin(x, kwargs.get("padding_mask"))
    shared = layer.mlp.shared_beside(x)  # under the dispatch just issued
    out = (yield call).view_as(x)
    return layer._forward_post_mlp((out if shared is None else out + shared, None), h)


def _run_block(decision: BatchOverlapDecision, x: Tensor,
               calls: list[tuple[TransformerLayer, dict[str, Any]]]) -> Tensor:
    """The recorded layers of one block forward, on its input ``x`` (``[s, b, h]``): split in
    two along the batch and run stage by stage, or (where this forward cannot be split) one
    after the other, as Megatron's loop runs them."""
    batch = x.shape[1]

    def plain() -> Tensor:  # Megatron's own layer loop
        h = x
        for layer, kwargs in calls:
            h, _ = TransformerLayer.forward(layer, **{**kwargs, "hidden_states": h})
        return h

    def stages(sizes: list[int]) -> list[list[Any]]:
        layers: list[list[Any]] = [[] for _ in sizes]
        for layer, kwargs in calls:
            pieces = {k: split_value(v, batch, sizes) if k in BATCH_FIRST else [v] * len(sizes)
                      for k, v in kwargs.items() if k != "hidden_states"}
            for i in range(len(sizes)):
                part = {k: values[i] for k, values in pieces.items()}
                layers[i].append(partial(megatron_layer_stages, layer, kwargs=part))
        return layers

    # no gathers: layers sharded by FSDP2 are refused (MC2TransformerLayer.forward)
    layers = [layer for layer, _ in calls]
    _refuse_layer_hooks(layers)
    return run_layer_loop(decision, x, plain=plain, stages=stages, batch_dim=1,
                          problem=_forward_problem(calls[0][1]) or _mlp_hook_problem(layers),
                          layers=layers)


def is_param_gather_hook(hook: Any) -> bool:
    """Whether ``hook`` is the forward pre-hook of Megatron's ``DistributedDataParallel`` with
    ``use_distributed_optimizer`` and ``overlap_param_gather``: it waits for the all-gather of
    the module's own parameters (and dispatches the next bucket's)."""
    return getattr(hook, "__qualname__", "").startswith(
        "DistributedDataParallel._make_forward_pre_hook")


def _refuse_layer_hooks(layers: list[TransformerLayer]) -> None:
    """``ValueError`` where a layer has a hook of the user's: batch overlap records the
    layers' calls and runs the block's layers together at the last one, so a layer's own
    hooks would see stand-ins for its input and output, split or not (every rank alike,
    before any collective of this forward)."""
    # Megatron DDP's parameter gather is no hook of the user's: the staged call runs it itself
    named = ((f"layer {index}", layer) for index, layer in enumerate(layers))
    if (problem := first_user_hook(named, is_param_gather_hook)) is not None:
        raise ValueError(
            f"use_mc2(batch_overlap=...): {problem}; batch overlap records the layers' calls "
            "and runs them together, so its hooks would see stand-ins for the layer's input "
            "and output: register it on a part of the layer, or use batch_overlap=False")


def _mlp_hook_problem(layers: list[TransformerLayer]) -> str | None:
    """Why this forward runs unsplit because an MoE layer run in stages has a hook of the
    user's (the stages call its parts, not it; unsplit, the layer calls it), or ``None``."""
    staged = ((f"layer {index}'s mlp", layer.mlp) for index, layer in enumerate(layers)
              if getattr(layer.mlp, "begin_staged", None) is not None)
    if (problem := first_user_hook(staged, is_param_gather_hook)) is not None:
        return (f"batch overlap is off for this forward: {problem}, which the staged call "
                "would not call")
    return None


def _forward_problem(kwargs: dict[str, Any]) -> str | None:
    """Why this forward of the block cannot be split, or ``None``."""
    for name, why in (("inference_context", "a KV cache (inference) is not split"),
                      ("packed_seq_params", "packed sequences are not split"),
                      ("context", "cross attention is not split")):
        if kwargs.get(name) is not None:
            return f"batch overlap is off for this forward: {why}"
    if kwargs["hidden_states"].dim() != 3:
        return "batch overlap is off for this forward: hidden states are not [s, b, h]"
    return None


class MC2TransformerLayer(TransformerLayer):
    """Megatron's ``TransformerLayer`` taking part in batch overlap (see the module docstring);
    its parameters and computations are ``TransformerLayer``'s.

    Args:
        config, submodules, layer_number, hidden_dropout, pg_collection, vp_stage: as
            ``TransformerLayer``.
        batch_overlap: ``True`` or ``"auto"`` (measured, :mod:`mc2.engine.decide.batch_split`);
            ``False``: every forward unsplit.
        min_tokens: tokens per rank below which a forward runs unsplit.
        stage_layers: layers of this pipeline stage's block (default: Megatron's count).

    Raises:
        ValueError: for a config :func:`batch_overlap_problem` refuses (every rank, at build).
    """

    def __init__(self, config: Any, submodules: Any, layer_number: int = 1,
                 hidden_dropout: float | None = None, pg_collection: Any = None,
                 vp_stage: int | None = None, *, batch_overlap: bool | str = True,
                 min_tokens: int = MIN_TOKENS, stage_layers: int | None = None) -> None:
        problem = batch_overlap_problem(config) if batch_overlap else None
        if problem is not None:
            raise ValueError(problem)
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         hidden_dropout=hidden_dropout, pg_collection=pg_collection,
                         vp_stage=vp_stage)
        self.local_number = layer_number  # 1-based within this stage's block
        self.stage_layers = stage_layers or get_num_layers_to_build(
            config, vp_stage, get_pg_rank(self.pg_collection.pp))
        # the stage's first layer holds the decision (every rank builds the same layers),
        # agreed on the stage's data-parallel ranks, not its EP group: the DDP buckets span
        # the EP groups, and groups that split differently would reduce at other points
        agree = getattr(self.pg_collection, "dp", None)
        if not batch_overlap:  # unsplit: nothing to agree
            self.decision = BatchOverlapDecision(False) if layer_number == 1 else None
            return
        if agree is None and layer_number == 1:
            raise ValueError("batch overlap: the layer's pg_collection has no data-parallel "
                             "group (dp), where its decision is agreed (DDP's buckets span the "
                             "EP groups); pass a ProcessGroupCollection with dp")
        self.decision = planner_for(agree).batch_overlap(
            batch_overlap, min_tokens=min_tokens, group=agree) if layer_number == 1 else None

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        """As ``TransformerLayer.forward``, or, under batch overlap, recorded (see the module
        docstring): the stage's last layer returns the output of them all."""
        kwargs.pop("dynamic_inference_decode_only", None)
        hidden_states = kwargs.get("hidden_states")
        if args or hidden_states is None or self.stage_layers < 2:
            return super().forward(*args, **kwargs)
        if self.local_number == 1:
            assert self.decision is not None
            if isinstance(self, FSDPModule):  # its hooks would run at every recorded call
                raise ValueError("use_mc2(batch_overlap=...): the layers are sharded by torch "
                                 "FSDP2 (use_torch_fsdp2 / Megatron-FSDP), which batch overlap "
                                 "does not run with; use Megatron's DDP or batch_overlap=False")
            if self.decision.chosen is False and current_pairing() is None:
                close_recording()
                return super().forward(**kwargs)
        out = record_layer_call(self, self.local_number - 1, self.stage_layers, hidden_states,
                                kwargs, self._run)
        if out is NOT_RECORDED:
            return super().forward(**kwargs)
        return out, None

    @staticmethod
    def _run(x: Tensor, calls: list[tuple[Any, dict[str, Any]]]) -> Tensor:
        return _run_block(calls[0][0].decision, x, calls)
