"""Where a model's experts live: expert parallelism (EP) inside data parallelism (DP).

A job of ``W`` ranks runs as a ``dp x ep`` grid: ranks ``d * ep .. d * ep + ep - 1`` form one
EP group, which splits the experts and exchanges tokens (``mc2.fused_expert``). The ``dp``
groups hold the same experts and only sync their gradients. Everything that is not an expert
is replicated on all ``W`` ranks. This is the layout Megatron-Core and DeepSpeed-MoE build for
their users: EP inside a node, where the link is fast, and DP across nodes.

PyTorch's :class:`~torch.distributed.device_mesh.DeviceMesh` names the grid. This module only
reads it. :func:`expert_parallel_mesh` makes one from an EP size, and :func:`resolve_layout`
turns a mesh or a plain group into the groups a layer needs. Every check runs before any
collective and reads only the mesh's shape and names, which all ranks share. So a bad mesh
raises the same ``ValueError`` on every rank, and no rank is left waiting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from mc2.engine.transport.backend import mesh_device_type
from mc2.engine.transport.comm import group_rank, group_size, initialized

MESH_DIMS = ("dp", "ep")


def expert_parallel_mesh(ep_size: int, device_type: str | None = None, *,
                         num_experts: int | None = None) -> Any:
    """A ``("dp", "ep")`` :class:`DeviceMesh` over the whole world, with EP groups of ``ep_size``.

    Call after ``torch.distributed.init_process_group`` on every rank (it creates the sub-groups,
    a collective). Ranks are numbered node by node under ``torchrun``, so an ``ep_size`` that
    divides the ranks per node keeps every EP group inside one node. ``device_type``: what the
    mesh's tensors live on; by default the current accelerator when the process group has a
    backend for it (``"cuda"`` under NCCL), else ``"cpu"``.

    Raises:
        ValueError: the world size is not a multiple of ``ep_size``, or ``num_experts`` (when
            given) is not.
        RuntimeError: ``torch.distributed`` is not initialised.
    """
    if not initialized():
        raise RuntimeError("expert_parallel_mesh needs torch.distributed: call "
                           "init_process_group first (or use torchrun / mc2.run_local)")
    world = dist.get_world_size()
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size ({ep_size}) must divide the world size ({world})")
    if num_experts is not None and num_experts % ep_size:
        raise ValueError(f"ep_size ({ep_size}) must divide the number of experts ({num_experts})")
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type or mesh_device_type(), (world // ep_size, ep_size),
                            mesh_dim_names=MESH_DIMS)


@dataclass(frozen=True)
class ParallelLayout:
    """The groups one MoE layer works with, resolved once from a mesh or a group.

    Attributes:
        ep_group: the expert-parallel group (``None``: the default group, or one process).
        dp_group: the ranks that hold the same experts (``None`` when there is no DP).
        ep_size, ep_rank, dp_size: sizes and this rank's place.
        mesh: the :class:`DeviceMesh` the layout came from (``None`` for a plain group); the
            checkpoint code describes expert tensors on it.
    """

    ep_group: Any
    dp_group: Any
    ep_size: int
    ep_rank: int
    dp_size: int
    mesh: Any = None

    def experts_of_this_rank(self, num_experts: int) -> range:
        """Global indices of the experts this rank holds (a contiguous block)."""
        local = num_experts // self.ep_size
        return range(self.ep_rank * local, (self.ep_rank + 1) * local)


def resolve_layout(group: Any = None, mesh: Any = None, *,
                   num_experts: int | None = None) -> ParallelLayout:
    """The :class:`ParallelLayout` for ``group=`` or ``mesh=`` (not both).

    ``mesh`` is 1-D (its only dimension is EP, as a ``group`` is) or 2-D with dimensions named
    ``"dp"`` and ``"ep"``. A 2-D mesh must cover the whole world.

    Raises:
        ValueError: both given; unnamed or misnamed dimensions; a mesh that does not cover the
            world; ``num_experts`` not a multiple of the EP size.
    """
    if mesh is None:
        ep = group_size(group)
        _check_experts(num_experts, ep)
        return ParallelLayout(group, None, ep, group_rank(group), 1)
    if group is not None:
        raise ValueError("pass group= or mesh=, not both")
    names = getattr(mesh, "mesh_dim_names", None)
    shape = tuple(mesh.shape)
    world = dist.get_world_size() if initialized() else 1
    if len(shape) == 2 and (names is None or set(names) != set(MESH_DIMS)):
        raise ValueError(f"a 2-D mesh needs dimensions named ('dp', 'ep'); got {names}")
    if len(shape) not in (1, 2):
        raise ValueError(f"mesh must be 1-D (ep) or 2-D ('dp', 'ep'); got shape {shape}")
    if mesh.size() != world:
        raise ValueError(f"the mesh covers {mesh.size()} ranks, the world has {world}: "
                         "every rank must be in it")
    if len(shape) == 1:
        ep_mesh, dp_group, dp = mesh, None, 1
    else:
        ep_mesh, dp_mesh = mesh["ep"], mesh["dp"]
        dp = dp_mesh.size()
        dp_group = dp_mesh.get_group() if dp > 1 else None
    ep = ep_mesh.size()
    _check_experts(num_experts, ep)
    return ParallelLayout(ep_mesh.get_group(), dp_group, ep, ep_mesh.get_local_rank(), dp, mesh)


def _check_experts(num_experts: int | None, ep: int) -> None:
    if num_experts is not None and num_experts % ep:
        raise ValueError(f"{num_experts} experts do not split over an EP size of {ep}")
