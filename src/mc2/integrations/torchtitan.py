"""mc2 in TorchTitan (0.3.0): its routed-experts node with mc2's pipeline in place of the
token dispatcher's serial dispatch -> experts -> combine.

:class:`MC2RoutedExperts` replaces only that node, switched on by the ``mc2_routed_experts``
configuration override (no fork); router, shared experts, parameters, sharding and state-dict
keys stay TorchTitan's, so its checkpoints and Hugging Face conversion work as before. The
forward keeps ``RoutedExperts.forward``'s positional argument names because TorchTitan's
``parallelize`` ties its sharding configs to them. :class:`MC2SelectiveAC` (the
``mc2_selective_ac`` override) adds mc2's operators to the selective policy's save list, so its
recompute runs no exchange.

See docs/torchtitan.md, 'Switching it on', 'What runs', 'Activation checkpointing' and
'Refused'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mc2.engine.autograd.ops import fused_expert, fused_expert_module
from mc2.engine.autograd.recompute import SAVED_OPERATORS
from mc2.engine.autograd.staged import StagedCall, begin_module, begin_split
from mc2.engine.compute.module_experts import ModuleExperts
from mc2.engine.decide.config import MC2Config
from mc2.integrations.weight_reads import hook_problem, read_problem, user_hook_problem

from torchtitan.config import derive, override
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models.common.feed_forward import FeedForward, SigmoidGatedFeedForward
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts

# TorchTitan's dispatchers mc2 cannot stand in for: DeepEP and HybridEP own the exchange
# themselves (NVSHMEM / RDMA buffers), and TorchAO's pads each expert's rows to what its
# quantised grouped GEMMs need (16 for FP8, 32 for MXFP8), which mc2's call does not
_REFUSED_DISPATCHERS = {
    "DeepEPTokenDispatcher": "mc2 replaces the token exchange itself and cannot run beside "
                             "DeepEP/HybridEP",
    "HybridEPTokenDispatcher": "mc2 replaces the token exchange itself and cannot run beside "
                               "DeepEP/HybridEP",
    "TorchAOTokenDispatcher": "it pads each expert's rows for the quantised grouped GEMMs "
                              "(Float8/MXFP8 experts), which mc2's call does not",
}
# the dtype TorchTitan's GroupedExperts computes its grouped GEMMs in
COMPUTE_DTYPE = torch.bfloat16


def mc2_config_of(options: dict[str, Any]) -> MC2Config:
    """:class:`~mc2.MC2Config` from the override's keywords; ``ValueError`` naming a keyword
    that is no field (TorchTitan would raise ``TypeError`` from deep in its override code)."""
    try:
        return MC2Config.of(**options)
    except TypeError as exc:  # "unknown mc2 option(s) [...]; MC2Config has [...]"
        raise ValueError(f"mc2_routed_experts: {exc}") from None


def _refuse_dispatcher(dispatcher_config: Any) -> None:
    """``ValueError`` when the node's dispatcher is one of :data:`_REFUSED_DISPATCHERS`
    (checked on every rank from the same configuration, so every rank raises)."""
    for klass in type(dispatcher_config).__mro__:  # "DeepEPTokenDispatcher.Config", subclasses
        name = klass.__qualname__.split(".")[0]
        if name in _REFUSED_DISPATCHERS:
            raise ValueError(
                f"routed_experts.token_dispatcher is {name}: {_REFUSED_DISPATCHERS[name]}; "
                "configure the All-to-All dispatcher (or drop the mc2 override)")


class MC2RoutedExperts(RoutedExperts):
    """``RoutedExperts`` whose dispatch -> experts -> combine is mc2's pipeline (see the
    module docstring). Parameters and their names are the parent's."""

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        # MC2Config's fields, as the override received them (a plain dict: TorchTitan
        # serialises configs with to_dict)
        mc2: dict[str, Any] = field(default_factory=dict)

    def __init__(self, config: Config) -> None:
        _refuse_dispatcher(config.token_dispatcher)
        super().__init__(config)
        self.mc2_config = mc2_config_of(config.mc2)
        self.ep_group: Any = None

    def parallelize(self, parallel_dims: Any) -> None:
        """TorchTitan's parallelize (experts sharded over ``ep``, the dispatcher wired), then
        the ``ep`` mesh's group kept as mc2's EP group."""
        super().parallelize(parallel_dims)
        mesh = parallel_dims.get_optional_mesh("ep")
        self.ep_group = None if mesh is None else mesh.get_group()

    def forward(
        self,
        x_BLD: Tensor,
        topk_scores_BLK: Tensor,
        topk_expert_ids_BLK: Tensor,
        num_local_tokens_per_expert_E: Tensor,
    ) -> Tensor:
        """The routed experts' output ``(B, L, D)`` of this rank's tokens, through mc2.

        The names are ``RoutedExperts.forward``'s: TorchTitan's sharding configs name them.
        ``num_local_tokens_per_expert_E`` is not read (mc2 counts its routes itself).
        """
        if self.ep_group is None:  # EP = 1: no exchange to hide
            return super().forward(x_BLD, topk_scores_BLK, topk_expert_ids_BLK,
                                   num_local_tokens_per_expert_E)
        return self.with_shared(x_BLD, topk_scores_BLK, topk_expert_ids_BLK)

    def with_shared(self, x_BLD: Tensor, topk_scores_BLK: Tensor, topk_expert_ids_BLK: Tensor,
                    shared: tuple[Tensor | None, Tensor | None, Tensor | None] = (None, None,
                                                                                  None),
                    shared_scale: Tensor | None = None) -> Tensor:
        """:meth:`forward`'s call (EP > 1), with ``shared``: the MoE block's shared experts as
        ``(up, gate, down)`` views (:func:`shared_views`), computed inside the call where its
        pipeline waits, their output added to the routed experts'."""
        experts = self.inner_experts
        inside = {"shared_up": shared[0], "shared_gate": shared[1], "shared_down": shared[2],
                  "shared_scale": shared_scale}
        if _plain_grouped(experts):
            with torch.autocast(x_BLD.device.type, dtype=COMPUTE_DTYPE):
                out = fused_expert(x_BLD, *_split_weights(experts), topk_expert_ids_BLK,
                                   topk_scores_BLK, group=self.ep_group, config=self.mc2_config,
                                   **inside)
        else:
            local = _local_count(experts)
            out = fused_expert_module(x_BLD, experts, topk_expert_ids_BLK,
                                      topk_scores_BLK.to(x_BLD.dtype), group=self.ep_group,
                                      config=self.mc2_config, local_experts=local,
                                      forward=_stage_forward(experts, local), **inside)
        return out.to(x_BLD.dtype)

    def begin_staged(self, x_BLD: Tensor, topk_scores_BLK: Tensor, topk_expert_ids_BLK: Tensor,
                     shared: tuple[Tensor | None, Tensor | None, Tensor | None] = (None, None,
                                                                                   None),
                     shared_scale: Tensor | None = None) -> StagedCall:
        """:meth:`forward` in stages, for batch overlap
        (:mod:`mc2.integrations.torchtitan_overlap`): plans the call and issues its dispatch;
        ``.experts()`` then ``.end()`` (in the compute dtype: the caller casts back) finish
        it. ``shared``: the MoE block's shared experts as ``(up, gate, down)`` views, run
        inside the call (:func:`shared_views`). Needs the ``ep`` group (EP > 1)."""
        experts = self.inner_experts
        if _plain_grouped(experts):
            with torch.autocast(x_BLD.device.type, dtype=COMPUTE_DTYPE):
                return begin_split(x_BLD, *_split_weights(experts), topk_expert_ids_BLK,
                                   topk_scores_BLK, group=self.ep_group, config=self.mc2_config,
                                   shared=shared, shared_scale=shared_scale)
        local = _local_count(experts)
        module = ModuleExperts.of(experts, x_BLD.shape[-1], local_experts=local,
                                  forward=_stage_forward(experts, local))
        return begin_module(x_BLD, module, topk_expert_ids_BLK, topk_scores_BLK.to(x_BLD.dtype),
                            group=self.ep_group, config=self.mc2_config, shared=shared,
                            shared_scale=shared_scale)


def _split_weights(experts: Any) -> tuple[Tensor, Tensor, Tensor]:
    """A plain ``GroupedExperts``' local ``(up, gate, down)`` as mc2's layout: transposed
    views of ``w3``, ``w1``, ``w2`` (no copy)."""
    return tuple(_local(w).transpose(-2, -1)  # type: ignore[return-value]
                 for w in (experts.w3_EFD, experts.w1_EFD, experts.w2_EDF))


def _local_count(experts: Any) -> int:
    """Experts held here: every TorchTitan experts module stacks them on dim 0."""
    return _local(next(iter(experts.parameters()))).shape[0]


def shared_views(shared: Any, x: Tensor) -> tuple[tuple[Tensor, Tensor, Tensor],
                                                  Tensor | None] | None:
    """TorchTitan's shared experts (``FeedForward``: ``w2(silu(w1 x) * w3 x)``, or
    ``SigmoidGatedFeedForward``: that times ``sigmoid(gate x)``) as mc2's in-call shared
    experts: ``((up, gate, down), scale)``, views of their weights (gradients land on
    them), the scale ``[..., 1]`` or ``None``; ``None`` for any other module, one with biases
    or converted linears, or weights in another dtype than the call's bfloat16 (it then runs
    beside the call, as TorchTitan runs it)."""
    if type(shared) not in (FeedForward, SigmoidGatedFeedForward) or hook_problem(shared):
        return None
    linears = [shared.w1, shared.w2, shared.w3] + ([shared.gate] if hasattr(shared, "gate")
                                                   else [])
    # TorchTitan's own Linear (no converter's, no adapter, hook or parametrization: checked
    # at every call, weight_reads), bias-free, in the dtype the call computes in (TorchTitan
    # runs the shared experts in their parameters' dtype, the routed in bfloat16)
    if any(read_problem(m, (Linear,)) is not None or m.bias is not None
           or m.weight.dtype != COMPUTE_DTYPE for m in linears):
        return None
    w1, w2, w3 = (m.weight for m in linears[:3])
    views = (w3.t().unsqueeze(0), w1.t().unsqueeze(0), w2.t().unsqueeze(0))
    scale = torch.sigmoid(shared.gate(x)) if hasattr(shared, "gate") else None
    return views, scale


def _plain_grouped(experts: Any) -> bool:
    """TorchTitan's own ``GroupedExperts`` with its own grouped GEMM (a converter that swaps
    ``_grouped_mm`` for a quantised one computes something mc2's SwiGLU does not), and no
    forward hook of the user's (its weights are read, the module not called: a hooked one
    runs as the experts stage, called)."""
    return (type(experts) is GroupedExperts
            and "_grouped_mm" not in vars(experts)
            and type(experts)._grouped_mm is GroupedExperts._grouped_mm
            and user_hook_problem(experts) is None)


def _local(weight: Tensor) -> Tensor:
    """This rank's experts of a weight: a ``Shard(0)`` DTensor's local shard (a view, no
    copy, differentiable back to the DTensor parameter) or the plain shard itself."""
    to_local = getattr(weight, "to_local", None)
    return weight if to_local is None else to_local()


def _stage_forward(experts: Any, local: int) -> Any:
    """TorchTitan's experts call ``(rows, tokens per local expert)`` in mc2's experts-stage
    call ``(rows grouped by local expert, local ids [R, 1], unit weights)``. The counts are
    summed on the device (no host read)."""
    def forward(rows: Tensor, local_ids: Tensor, weights: Tensor) -> Tensor:
        del weights  # unit: mc2 applies the routing weights after the combine
        ids = torch.arange(local, device=rows.device)
        counts = (local_ids.reshape(-1, 1) == ids).sum(0)
        return experts(rows, counts)
    return forward


@override(target=RoutedExperts.Config,
          description="mc2: dispatch -> experts -> combine as an overlapped micro-batch pipeline")
def mc2_routed_experts(cfg: RoutedExperts.Config, **options: Any) -> MC2RoutedExperts.Config:
    """TorchTitan override factory: every ``RoutedExperts`` node becomes
    :class:`MC2RoutedExperts`, its fields (experts, dispatcher, sharding config) carried over
    by ``derive``; ``options`` are :class:`~mc2.MC2Config` fields, checked here so that a bad
    one fails at configuration, on every rank."""
    mc2_config_of(options)
    _refuse_dispatcher(cfg.token_dispatcher)
    return derive(cfg, MC2RoutedExperts.Config, mc2=dict(options))


class MC2SelectiveAC(SelectiveAC):
    """TorchTitan's per-op selective activation checkpointing, saving mc2's fused call too:
    its output and saved state come back in the recompute, which runs no All-to-All. Every
    other choice (the operators saved, every second matmul recomputed, the router's matmul
    forced to recompute) is TorchTitan's."""

    @dataclass(kw_only=True, slots=True)
    class Config(SelectiveAC.Config):
        pass

    def get_save_ops(self) -> set:
        """TorchTitan's save list and mc2's operators."""
        return set(super().get_save_ops()) | set(SAVED_OPERATORS)


@override(target=SelectiveAC.Config,
          description="mc2: selective activation checkpointing saves mc2's fused call")
def mc2_selective_ac(cfg: SelectiveAC.Config) -> MC2SelectiveAC.Config:
    """TorchTitan override factory: the ``selective`` activation-checkpointing policy becomes
    :class:`MC2SelectiveAC`, its fields carried over by ``derive``."""
    return derive(cfg, MC2SelectiveAC.Config)
