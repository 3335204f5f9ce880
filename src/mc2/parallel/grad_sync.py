"""Gradients of the mean loss over all ranks, for a model whose experts are sharded.

Each rank's loss covers its own tokens; the objective is the mean over the ``W`` ranks that
replicate the rest of the model. Then:

- A replicated parameter (attention, norms, router, embeddings) gets the average of the ranks'
  gradients: one flat all-reduce over the ``W`` ranks.
- An expert's gradient on one rank already sums the contributions of every token of its EP
  group: they travelled to it in the dispatch. The ranks of its ``dp`` group hold the same
  experts and saw the other EP groups' tokens, so their gradients are summed over ``dp``. The
  sum is then divided by ``W``, the same mean.

With ``group=`` (every rank in one EP group) the ``dp`` sum disappears and this is the
one-group rule: replicated averaged, experts divided by the group size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mc2.engine.transport.comm import group_size
from mc2.parallel.expert_shards import expert_shards
from mc2.parallel.mesh import resolve_layout


@dataclass
class SyncClass:
    """Parameters whose gradients take the same collective.

    Attributes:
        params: in the model's registration order.
        group: summed over this group; ``None`` when nothing is summed (experts without DP).
        divide_by: then divided by this (the number of ranks whose losses are averaged).
    """

    params: list[nn.Parameter]
    group: Any
    divide_by: int
    summed: bool = True


def sync_classes(model: nn.Module, group: Any = None, *, mesh: Any = None) -> list[SyncClass]:
    """The rule above, as lists of parameters; the same on every rank (empty for one rank).

    Raises:
        ValueError: a bad mesh (see :func:`mc2.parallel.mesh.resolve_layout`).
    """
    if mesh is not None:
        resolve_layout(mesh=mesh)  # the same checks, on every rank
        group = None
    world = group_size(group)
    if world == 1:
        return []
    shards = expert_shards(model)
    classes: dict[int, SyncClass] = {}
    for shard in shards:
        if not shard.param.requires_grad:  # frozen: no gradient to sync, none to write
            continue
        if shard.layout.dp_group is None and shard.layout.ep_size != world:
            raise ValueError(
                f"mc2 gradient sync: experts built on an expert-parallel group of "
                f"{shard.layout.ep_size} ranks in a world of {world}, without a mesh: the "
                "ranks that hold the same experts are not known, so their gradients could not "
                "be averaged; build the layers with mesh=mc2.expert_parallel_mesh(ep_size)")
        dp = shard.layout.dp_group
        cls = classes.setdefault(id(dp), SyncClass([], dp, world, summed=dp is not None))
        cls.params.append(shard.param)
    local = {id(s.param) for s in shards}
    replicated = [p for p in model.parameters() if id(p) not in local and p.requires_grad]
    return [SyncClass(replicated, group, world), *classes.values()]


def average_gradients(model: nn.Module, group: Any = None, *, mesh: Any = None) -> None:
    """Make every rank's gradients those of the mean of all ranks' losses (after ``backward``).

    Args:
        model: a model with MC2 modules (:class:`mc2.MoELayer` or ``enable_mc2``'s blocks).
        group: the ranks that replicate the non-expert parameters, when every rank of it is in
            one EP group (the one-group layout).
        mesh: instead, the ``("dp", "ep")`` mesh the model was built on; the non-expert
            parameters are then replicated over the whole mesh.

    Parameters without a gradient on this rank count as zero, so every rank makes the same
    collectives whatever its routing. To overlap the sync with the backward instead, see
    :class:`mc2.GradientSync`.
    """
    for cls in sync_classes(model, group, mesh=mesh):
        if cls.summed:
            _all_reduce_mean(cls.params, cls.group, cls.divide_by)
        else:
            divide_grads(cls.params, cls.divide_by)


def _all_reduce_mean(params: list[nn.Parameter], group: Any, divide_by: int) -> None:
    """Sum ``params``' gradients over ``group`` in one flat message, then divide."""
    by_dtype: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault((p.dtype, p.device), []).append(p)
    for same in by_dtype.values():
        flat = flat_grads(same)
        dist.all_reduce(flat, group=group)
        write_back(same, flat, divide_by)


def flat_grads(params: list[nn.Parameter]) -> Tensor:
    """The parameters' gradients in one flat tensor (a missing gradient counts as zeros)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in params])


def write_back(params: list[nn.Parameter], flat: Tensor, divide_by: int) -> None:
    """Divide the summed ``flat`` and make it the parameters' gradients again."""
    flat /= divide_by
    for p, chunk in zip(params, flat.split([p.numel() for p in params])):
        if p.grad is None:
            p.grad = chunk.view_as(p).clone()
        else:
            p.grad.copy_(chunk.view_as(p))


def divide_grads(params: list[nn.Parameter], divide_by: int) -> None:
    """Experts without DP replicas: nothing to sum, only the mean to take."""
    for p in params:
        if p.grad is not None:
            p.grad.div_(divide_by)
