"""FSDP2 with expert parallelism: ``mc2.fully_shard``, on PyTorch's own ``fully_shard``.

Each MC2 block's routed experts are one unit sharded over ``mesh["dp"]`` (their gradient summed
over ``dp`` and divided by the world, as :func:`mc2.average_gradients` does); everything else is
sharded over the whole world, one unit per decoder layer and the root. FSDP2's hooks do all the
communication. :func:`clip_grad_norm_` exists because ``torch.nn.utils.clip_grad_norm_`` cannot
stack norms of DTensors on different meshes.

See docs/training_stack.md, 'FSDP2 with expert parallelism: `mc2.fully_shard`' (why the
gradient rule, the manual pattern a TorchTitan user writes).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mc2.parallel.expert_shards import expert_shards, mc2_modules


def _experts_module(block: nn.Module) -> nn.Module:
    """The submodule that holds the block's expert parameters (and runs the fused call)."""
    owners = {name.rpartition(".")[0] for name in block.mc2_expert_parameters()}
    if len(owners) != 1 or "" in owners:
        raise ValueError(f"mc2.fully_shard: {type(block).__name__} must keep its experts in one "
                         "called submodule (as mc2.layer.PackedExperts), got parameters "
                         f"{sorted(block.mc2_expert_parameters())}")
    return block.get_submodule(owners.pop())


def _layer_of(model: nn.Module, block_name: str) -> str:
    """The decoder layer that holds the block: the element of the nearest enclosing
    ``ModuleList``/``Sequential``; the block itself when it is in none."""
    parts = block_name.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        container = model.get_submodule(".".join(parts[:depth]))
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            return ".".join(parts[:depth + 1])
    return block_name


def _mesh_of(blocks: list[tuple[str, nn.Module]], mesh: Any) -> Any:
    """The ``("dp", "ep")`` mesh every block was built on (and ``mesh``, when given)."""
    meshes = {id(b.layout.mesh): b.layout.mesh for _, b in blocks}
    if mesh is not None:
        meshes.setdefault(id(mesh), mesh)
    if len(meshes) != 1 or None in meshes.values():
        raise ValueError("mc2.fully_shard needs every MC2 block built on one ('dp', 'ep') mesh "
                         "(enable_mc2(model, mesh=...) or MoELayer(..., mesh=...), with "
                         "mc2.expert_parallel_mesh); blocks built on a process group hold "
                         "experts that no FSDP mesh describes")
    found = meshes.popitem()[1]
    if tuple(found.mesh_dim_names or ()) != ("dp", "ep"):
        raise ValueError(f"mc2.fully_shard needs a 2-D ('dp', 'ep') mesh, got dimensions "
                         f"{found.mesh_dim_names} (mc2.expert_parallel_mesh makes one)")
    return found


def world_mesh(mesh: Any) -> Any:
    """``mesh`` flattened to one dimension over all its ranks: what non-expert parameters are
    sharded over."""
    return mesh._flatten("dp_ep") if hasattr(mesh, "_flatten") else mesh


def fully_shard(model: nn.Module, mesh: Any = None, *, mp_policy: Any = None,
                reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``model`` with FSDP2: routed experts over ``mesh["dp"]``, the rest over the world.

    Works on ``enable_mc2`` models and on stacks of :class:`mc2.MoELayer` built on a
    ``("dp", "ep")`` mesh. Every rank calls it on its model; afterwards the parameters are
    DTensors, gradients come out reduced (no :class:`mc2.GradientSync` or
    :func:`mc2.average_gradients`), and the optimizer is built on ``model.parameters()`` as
    usual. Clip with :func:`mc2.clip_grad_norm_`; save and load with :mod:`mc2.checkpoint`.

    Args:
        model: the model; its MC2 blocks must all be built on one mesh.
        mesh: that mesh (default: the blocks' own).
        mp_policy: a :class:`torch.distributed.fsdp.MixedPrecisionPolicy` for every unit
            (e.g. bf16 parameters, fp32 gradient reduction).
        reshard_after_forward: as ``torch.distributed.fsdp.fully_shard`` (free the gathered
            parameters after each unit's forward, gather again for its backward).

    Returns:
        ``model`` (now an ``FSDPModule``).

    Raises:
        ValueError: no MC2 block, blocks on several meshes or on a plain process group, or an
            experts module that is not called (raised alike on every rank: it reads only the
            model's structure).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    blocks = mc2_modules(model)
    if not blocks:
        raise ValueError(f"mc2.fully_shard: {type(model).__name__} has no MC2 block "
                         "(enable_mc2 or MoELayer first)")
    mesh = _mesh_of(blocks, mesh)
    everywhere = world_mesh(mesh)
    options = dict(mp_policy=mp_policy or MixedPrecisionPolicy(),
                   reshard_after_forward=reshard_after_forward)
    world = mesh.size()
    for _, block in blocks:
        experts = torch_fully_shard(_experts_module(block), mesh=mesh["dp"], **options)
        experts.set_gradient_divide_factor(float(world))
        if mesh["dp"].size() > 1:
            # a sum, then one division: the custom factor would otherwise be NCCL's
            # PREMUL_SUM, which Gloo does not have (one division of the reduced shard costs
            # next to nothing). Not on one rank: FSDP2 divides there already, once more would
            # divide twice.
            experts.set_force_sum_reduction_for_comms(True)
    layers = dict.fromkeys(_layer_of(model, name) for name, _ in blocks)
    for name in layers:
        if name:
            torch_fully_shard(model.get_submodule(name), mesh=everywhere, **options)
    torch_fully_shard(model, mesh=everywhere, **options)
    return model


# Where a parameter's local norm must still be reduced, by role; the same roles, in this
# order, on every rank (they follow from the model's structure, not from which grads exist).
ROLES = ("dense", "dense_sharded", "experts", "experts_sharded")


def _role(p: nn.Parameter, is_expert: bool) -> tuple[str, Any]:
    """``(role, the group its sharding adds)`` of one parameter."""
    from torch.distributed.tensor import DTensor

    sharded = isinstance(p, DTensor)
    group = None
    if sharded:
        if p.device_mesh.ndim != 1:
            raise ValueError("mc2.clip_grad_norm_: a parameter on a multi-dimensional mesh "
                             "(HSDP); shard with mc2.fully_shard")
        group = p.device_mesh.get_group()
    return ("experts" if is_expert else "dense") + ("_sharded" if sharded else ""), group


def _norm_and_grads(model: nn.Module, norm_type: float) -> tuple[Tensor, list[Tensor]]:
    """The global gradient norm of ``model`` (each parameter counted once over the world) and
    the local gradient tensors to scale."""
    from torch.distributed.tensor import DTensor

    shards = {id(s.param): s for s in expert_shards(model)}
    inf = norm_type == float("inf")
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device if params else torch.device("cpu")
    sums = {role: torch.zeros((), device=device) for role in ROLES}
    groups: dict[str, list[Any]] = {role: [] for role in ROLES}
    local_grads = []
    for p in params:
        role, group = _role(p, id(p) in shards)
        wanted = [group] if group is not None else []
        if id(p) in shards:  # each EP rank holds other experts: summed over the EP group too
            ep_group = shards[id(p)].layout.ep_group  # None: the default group, every rank
            wanted.append(ep_group if ep_group is not None or not dist.is_initialized()
                          else dist.group.WORLD)
        if not groups[role]:
            groups[role] = wanted
        elif [id(g) for g in groups[role]] != [id(g) for g in wanted]:
            raise ValueError("mc2.clip_grad_norm_: parameters of one kind on different groups "
                             "(build every MC2 block on one mesh)")
        g = p.grad
        if g is None:
            continue  # a missing gradient counts as zero; the role's collectives still run
        local = g.to_local() if isinstance(g, DTensor) else g
        local_grads.append(local)
        if local.numel() == 0:
            continue  # an empty FSDP chunk (fewer rows than ranks)
        value = torch.linalg.vector_norm(  # float32 at least, float64 kept
            local if local.dtype == torch.float64 else local.float(), norm_type)
        sums[role] = torch.maximum(sums[role], value) if inf else sums[role] + value ** norm_type
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    total = torch.zeros((), device=device)
    for role in ROLES:
        value = sums[role]
        if dist.is_initialized():
            for group in groups[role]:
                if group is not None:
                    dist.all_reduce(value, op=op, group=group)
        total = torch.maximum(total, value) if inf else total + value
    return (total if inf else total ** (1.0 / norm_type)), local_grads


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> Tensor:
    """Clip every gradient of ``model`` by one global norm; returns that norm (a tensor).

    Works with and without :func:`fully_shard`: FSDP2 gradients (DTensors on the world mesh and
    on ``mesh["dp"]``) and plain ones (after :class:`mc2.GradientSync`, where replicated
    gradients are equal on every rank and each EP rank holds its own experts). An expert
    counts once: its norm is summed over the EP group, and over ``dp`` only where FSDP shards
    it. Nothing is read back to the host (the scale stays on the device).

    Every rank must call it (it runs collectives). ``norm_type``: 2, any p, or ``inf``.
    """
    total, grads = _norm_and_grads(model, float(norm_type))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total
