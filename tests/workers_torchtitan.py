"""Rank functions for tests/test_torchtitan.py: TorchTitan 0.3.0's MoE block (router, routed
experts, shared experts as its own code builds them) with EP over the world, once with its
All-to-All token dispatcher and once with mc2's node switched on by TorchTitan's override
mechanism, from the same weights and the same tokens.

On CPU two shims stand where TorchTitan's trainer would: its mesh device falls back to "cuda"
when no accelerator is found (set to "cpu" here), and size-1 mesh axes take the "fake" c10d
backend, registered only once ``torch.testing._internal.distributed.fake_pg`` is imported.
The reference runs under ``partial_dtensor``: under ``spmd_types`` TorchTitan's dispatcher needs
the trainer's current SPMD mesh and sends a list ``all_to_all`` Gloo does not have.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend
from torch import Tensor

D, F, E, K = 16, 24, 4, 2  # hidden, ffn, experts, top-k
MC2 = "mc2.integrations.torchtitan.mc2_routed_experts"


def moe_config(*, shared: bool = False, dispatcher: Any = None, gpt_oss: bool = False,
               shape: tuple[int, int, int, int] = (D, F, E, K)) -> Any:
    """A TorchTitan ``MoE.Config`` (softmax top-k router, GroupedExperts or gpt-oss's experts
    with biases), EP sharding set as its models set it. ``shape``: hidden, ffn, experts, top-k."""
    D, F, E, K = shape  # noqa: N806  the module's constants by default
    import spmd_types as spmd
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import (
        MoE, GroupedExperts, RoutedExperts, TokenChoiceTopKRouter)
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
    from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts

    if dispatcher is None:
        dispatcher = AllToAllTokenDispatcher.Config(num_experts=E, top_k=K)
    shared_cfg = None
    if shared:
        shared_cfg = FeedForward.Config(
            w1=Linear.Config(in_features=D, out_features=F),
            w2=Linear.Config(in_features=F, out_features=D),
            w3=Linear.Config(in_features=D, out_features=F))
    cfg = MoE.Config(
        num_experts=E,
        routed_experts=RoutedExperts.Config(
            inner_experts=(GptOssGroupedExperts.Config if gpt_oss else GroupedExperts.Config)(
                dim=D, hidden_dim=F, num_experts=E),
            token_dispatcher=dispatcher),
        router=TokenChoiceTopKRouter.Config(
            num_experts=E, gate=Linear.Config(in_features=D, out_features=E), top_k=K,
            score_func="softmax"),
        load_balance_coeff=None, shared_experts=shared_cfg)
    layout = {"mlp1_weight_EGD": spmd.S(1), "mlp1_bias_EG": spmd.S(1),
              "mlp2_weight_EDF": spmd.S(2), "mlp2_bias_ED": spmd.R} if gpt_oss else {
        "w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)}
    set_moe_sharding_config(cfg, enable_ep=True, enable_sp=False, expert_param_layout=layout)
    return cfg


def build(world: int, *, mc2: dict | None, backend: str = "partial_dtensor",
          dtype: torch.dtype = torch.float32, shared: bool = False,
          gpt_oss: bool = False, shape: tuple[int, int, int, int] = (D, F, E, K)
          ) -> torch.nn.Module:
    """The block with seeded weights (the same on every rank and in every build), then
    TorchTitan's parallelize with EP = ``world``. ``mc2``: the override's keywords (``None``:
    TorchTitan's own dispatcher)."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import OverrideConfig, apply_overrides
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.utils import set_spmd_backend

    cfg = moe_config(shared=shared, gpt_oss=gpt_oss, shape=shape)
    if mc2 is not None:
        applied = apply_overrides(OverrideConfig(imports=[(MC2, mc2)]), cfg)
        assert len(applied) == 1, applied
    moe = _seeded(cfg).to(dtype)
    parallel_dims_module.device_type = "cpu"  # TorchTitan falls back to "cuda" without one
    dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=world,
                        world_size=world, spmd_backend=backend)
    set_spmd_backend(backend)
    dims.build_mesh()
    moe.parallelize(dims)
    return moe


def _seeded(cfg: Any) -> torch.nn.Module:
    """The block of ``cfg`` with the weights every build gets (seed 0, normal 0.3)."""
    torch.manual_seed(0)
    moe = cfg.build()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
    return moe


def _batch(rank: int, dtype: torch.dtype) -> Tensor:
    """Rank ``rank``'s tokens ``(2, 6, D)``, the same in every process."""
    torch.manual_seed(100 + rank)
    return torch.randn(2, 6, D, dtype=dtype)


def _loss_weight(out: Tensor) -> Tensor:
    """The weights of the loss ``sum(out * weight)``: every output element counts, differently."""
    return torch.linspace(-1.0, 1.0, out.numel()).view_as(out).to(out.dtype)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _run(moe: torch.nn.Module, rank: int, dtype: torch.dtype, checkpoint: bool = False
         ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Forward and backward of a rank-seeded batch (a loss that weighs every output)."""
    x = _batch(rank, dtype).requires_grad_()
    if checkpoint:
        from torch.utils.checkpoint import checkpoint as full_ac
        out = full_ac(moe, x, use_reentrant=False)
    else:
        out = moe(x)
    (out.float() * _loss_weight(out).float()).sum().backward()
    grads = {n: _local(p.grad).detach().clone() for n, p in moe.named_parameters()}
    return out.detach().clone(), x.grad.detach().clone(), grads


def relative_errors(ref: tuple, got: tuple) -> dict[str, float]:
    """max |got - ref| / max |ref| per tensor: output, input gradient, every parameter's."""
    def rel(a: Tensor, b: Tensor) -> float:
        return float((b.double() - a.double()).abs().max() / a.double().abs().max().clamp_min(1e-12))
    errors = {"output": rel(ref[0], got[0]), "grad x": rel(ref[1], got[1])}
    assert ref[2].keys() == got[2].keys(), (sorted(ref[2]), sorted(got[2]))
    for name in ref[2]:
        assert ref[2][name].shape == got[2][name].shape, name
        errors[f"grad {name}"] = rel(ref[2][name], got[2][name])
    return errors


def equal_to_torchtitan(rank: int, world: int, dtype_name: str, options: dict,
                        mc2_backend: str, shared: bool, checkpoint: bool,
                        gpt_oss: bool = False, hooked: bool = False) -> dict:
    """TorchTitan's dispatcher and mc2's node, same weights and tokens: the relative errors,
    the node type that ran and the parameter names of both (state-dict keys). ``hooked``: a
    forward hook on both nodes' experts modules, scaling what they return."""
    dtype = getattr(torch, dtype_name)
    def scaled(node: torch.nn.Module) -> torch.nn.Module:
        if hooked:
            node.routed_experts.inner_experts.register_forward_hook(
                lambda module, args, out: out * 1.5)
        return node

    ref_moe = scaled(build(world, mc2=None, dtype=dtype, shared=shared, gpt_oss=gpt_oss))
    ref = _run(ref_moe, rank, dtype)
    moe = scaled(build(world, mc2=options, backend=mc2_backend, dtype=dtype, shared=shared,
                       gpt_oss=gpt_oss))
    got = _run(moe, rank, dtype, checkpoint=checkpoint)
    experts = moe.routed_experts.inner_experts
    weight = experts.mlp1_weight_EGD if gpt_oss else experts.w1_EFD
    return {"errors": relative_errors(ref, got), "node": type(moe.routed_experts).__name__,
            "ref_keys": sorted(ref_moe.state_dict()), "keys": sorted(moe.state_dict()),
            "dtensor": hasattr(weight, "to_local"), "local_experts": _local(weight).shape[0],
            "group_size": moe.routed_experts.ep_group.size()}


def equal_to_ep1(rank: int, world: int, options: dict) -> dict:
    """mc2's node with EP = ``world`` against the same block unsharded (EP = 1, TorchTitan's
    local path, no collective) in this process, fed every rank's batch at once: this rank's
    output and input gradient, the experts it holds (their gradients collect every rank's
    tokens) and the replicated parameters (their gradients summed over the ranks); that the
    node ran mc2's call on a group of ``world`` ranks, and the host reads of that call and of
    the whole backward (:func:`tests.call_counting.counted_calls`)."""
    import torch.distributed as dist

    import mc2.integrations.torchtitan as node
    from tests.call_counting import counted_calls

    moe = build(world, mc2=options)
    with counted_calls(node) as seen:
        got = _run(moe, rank, torch.float32)
    ref_moe = _seeded(moe_config())
    x = torch.cat([_batch(r, torch.float32) for r in range(world)]).requires_grad_()
    out = ref_moe(x)
    (out.view(world, *out[:2].shape) * _loss_weight(out[:2])).sum().backward()
    local = E // world
    grads = {}
    for name, p in ref_moe.named_parameters():
        if name.startswith("routed_experts.inner_experts."):
            grads[name] = p.grad[rank * local:(rank + 1) * local]
        else:  # replicated: this rank's gradient is its tokens' share
            summed = got[2][name].clone()
            dist.all_reduce(summed)
            got[2][name] = summed
            grads[name] = p.grad
    ref = (out[2 * rank:2 * rank + 2].detach(), x.grad[2 * rank:2 * rank + 2], grads)
    group = moe.routed_experts.ep_group  # None would mean TorchTitan's own EP = 1 forward
    return {"errors": relative_errors(ref, got), "node": type(moe.routed_experts).__name__,
            "group_size": None if group is None else group.size(), **seen}


def weights_passed_without_copy(rank: int, world: int) -> dict:
    """The tensors the node hands to ``fused_expert`` for bf16 GroupedExperts: whether each
    shares the parameter's memory (a view) and is its transpose."""
    import mc2.integrations.torchtitan as tt

    moe = build(world, mc2={"micro_batches": 2}, dtype=torch.bfloat16)
    seen: dict[str, Any] = {}
    real = tt.fused_expert

    def spy(x: Tensor, up: Tensor, gate: Tensor, down: Tensor, *args: Any, **kw: Any) -> Tensor:
        seen.update(up=up, gate=gate, down=down)
        return real(x, up, gate, down, *args, **kw)

    tt.fused_expert = spy
    try:
        _run(moe, rank, torch.bfloat16)
    finally:
        tt.fused_expert = real
    experts = moe.routed_experts.inner_experts
    params = {"gate": _local(experts.w1_EFD), "up": _local(experts.w3_EFD),
              "down": _local(experts.w2_EDF)}
    return {name: {"same_memory": seen[name].data_ptr() == p.data_ptr(),
                   "transposed": torch.equal(seen[name], p.transpose(-2, -1)),
                   "shape": tuple(seen[name].shape)} for name, p in params.items()}


def refusals(rank: int, world: int) -> dict[str, str]:
    """The ValueError messages this rank gets for a DeepEP/HybridEP/TorchAO dispatcher under
    the mc2 override, an option that is no MC2Config field and one MC2Config rejects."""
    from torchtitan.config import OverrideConfig, apply_overrides
    from torchtitan.models.common.token_dispatcher import (
        DeepEPTokenDispatcher, HybridEPTokenDispatcher, TorchAOTokenDispatcher)

    out: dict[str, str] = {}
    cases = {
        "deepep": (DeepEPTokenDispatcher.Config(num_experts=E, top_k=K), {}),
        "hybridep": (HybridEPTokenDispatcher.Config(num_experts=E, top_k=K), {}),
        "torchao": (TorchAOTokenDispatcher.Config(num_experts=E, top_k=K, pad_multiple=16), {}),
        "unknown option": (None, {"micro_batch": 2}),
        "bad value": (None, {"micro_batches": 0}),
    }
    for case, (dispatcher, options) in cases.items():
        cfg = moe_config(dispatcher=dispatcher)
        try:
            apply_overrides(OverrideConfig(imports=[(MC2, options)]), cfg)
            out[case] = "no error"
        except ValueError as exc:
            out[case] = str(exc)
    return out


def _ac_holder(policy: Any) -> Any:
    """A config tree holding an activation-checkpointing policy config, as TorchTitan's
    ``Trainer.Config.activation_checkpoint`` does (``apply_overrides`` needs a parent)."""
    from dataclasses import dataclass

    from torchtitan.config.configurable import Configurable

    class _Job(Configurable):
        @dataclass(kw_only=True, slots=True)
        class Config(Configurable.Config):
            activation_checkpoint: Any = None

    return _Job.Config(activation_checkpoint=policy)


def under_selective_ac(rank: int, world: int) -> dict:
    """TorchTitan's block through mc2 (K = 2) under TorchTitan's own ``SelectiveAC`` policy,
    as it is and with the ``mc2_selective_ac`` override, against TorchTitan's dispatcher
    without checkpointing: the relative errors and the collectives each backward issued."""
    from torchtitan.config import OverrideConfig, apply_overrides
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    from tests.workers_recompute import CollectiveCounter

    dtype = torch.float32
    ref = _run(build(world, mc2=None), rank, dtype)
    found: dict[str, Any] = {}
    for mode in ("none", "selective", "mc2_selective"):
        moe = build(world, mc2={"micro_batches": 2})
        holder = _ac_holder(SelectiveAC.Config())
        if mode == "mc2_selective":
            applied = apply_overrides(OverrideConfig(
                imports=["mc2.integrations.torchtitan.mc2_selective_ac"]), holder)
            assert len(applied) == 1, applied
        policy = holder.activation_checkpoint.build()
        block = moe if mode == "none" else policy._wrap_block(moe, base_fqn="layers.0")
        torch.manual_seed(100 + rank)
        x = torch.randn(2, 6, D, dtype=dtype).requires_grad_()
        out = block(x)
        weight = torch.linspace(-1.0, 1.0, out.numel()).view_as(out)
        counter = CollectiveCounter()
        try:
            (out * weight).sum().backward()
        finally:
            counter.close()
        grads = {n.replace("_checkpoint_wrapped_module.", ""): _local(p.grad).detach().clone()
                 for n, p in block.named_parameters()}
        found[mode] = {"errors": relative_errors(ref, (out.detach(), x.grad, grads)),
                       "backward_collectives": counter.count,
                       "policy": type(policy).__name__}
    return found
