"""Which parameters of a model are expert shards, and how they are laid out over the ranks.

An MC2 module (:class:`mc2.MoELayer`, the Hugging Face adapter's block) holds a contiguous
block of the experts of this rank's EP group. It reports them through
``mc2_expert_parameters()``, and its ``layout`` (:class:`~mc2.parallel.mesh.ParallelLayout`) says which
ranks share the block. Gradient sync and checkpoints read that, so neither has to know one
module class from another.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from mc2.parallel.mesh import ParallelLayout


@dataclass(frozen=True)
class ExpertShard:
    """One expert tensor of one module on this rank.

    Attributes:
        name: the parameter's fully qualified name in the model.
        param: this rank's block ``[local_experts, ...]``.
        layout: the groups of its module.
        num_experts: the global expert count (the full tensor is ``[num_experts, ...]``).
    """

    name: str
    param: nn.Parameter
    layout: ParallelLayout
    num_experts: int


def mc2_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The MC2 modules of ``model`` (those reporting expert shards), named, in module order."""
    return [(name, m) for name, m in model.named_modules()
            if callable(getattr(m, "mc2_expert_parameters", None))]


def expert_shards(model: nn.Module) -> list[ExpertShard]:
    """Every expert shard of ``model``, in module order (the same order on every rank)."""
    shards = []
    for prefix, module in mc2_modules(model):
        for name, param in module.mc2_expert_parameters().items():
            full = f"{prefix}.{name}" if prefix else name
            total = getattr(module, "global_num_experts", None) or module.num_experts
            shards.append(ExpertShard(full, param, module.layout, total))
    return shards
