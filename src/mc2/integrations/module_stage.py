"""``enable_mc2`` for the experts it does not compute itself: the model's own experts module,
this rank's share of it, run as the experts stage of mc2's pipeline.

:class:`~mc2.integrations.transformers.MC2SparseMoeBlock` replaces a whole block and runs mc2's
SwiGLU, the fast path, where the block is exactly that. Every other block whose experts the
model's own expert-parallel plan names (``base_model_ep_plan``'s ``ep_dispatch_experts`` rules:
gpt-oss's clamped activation with biases, DeepSeek's correction bias and shared experts, ...)
keeps its own forward: its router, shared experts and corrections run as they are, and only
its experts module changes. It holds this rank's experts (every parameter whose first dimension
is the expert count, sliced to this rank's block, under the same names), and its forward runs
:func:`mc2.fused_expert_module` with the module's own forward (whatever
``experts_implementation``) as the stage. State-dict keys do not change.
"""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

import torch
from torch import Tensor, nn

from mc2.engine.autograd.ops import fused_expert_module
from mc2.engine.decide.config import MC2Config
from mc2.parallel.mesh import resolve_layout


class ModuleStageExperts:
    """Mixed into a copy of a model's experts class (see :func:`shard_experts`): the copy
    holds this rank's experts, and its forward goes through mc2's pipeline."""

    layout: Any
    mc2_config: MC2Config
    global_num_experts: int
    expert_names: tuple[str, ...]
    first_expert: int

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
                ) -> Tensor:
        own = super().forward  # type: ignore[misc]  # the experts class's own forward
        return fused_expert_module(hidden_states, self, top_k_index, top_k_weights,
                                   group=self.layout.ep_group, config=self.mc2_config,
                                   local_experts=self.num_experts, forward=own)

    def mc2_expert_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's expert shards (see :mod:`mc2.parallel.expert_shards`)."""
        return {name: self._parameters[name] for name in self.expert_names}  # type: ignore

    @property
    def expert_index(self) -> Any:
        return torch.arange(self.first_expert, self.first_expert + self.num_experts)


@functools.cache
def _stage_class(cls: type) -> type:
    return type(f"MC2{cls.__name__}", (ModuleStageExperts, cls), {})


def experts_problem(experts: nn.Module) -> str | None:
    """Why ``experts`` cannot be split by expert, or ``None``."""
    n = getattr(experts, "num_experts", None)
    if not isinstance(n, int) or n < 1:
        return f"{type(experts).__name__} has no integer num_experts"
    shared = [name for name, p in experts.named_parameters(recurse=False)
              if p.dim() == 0 or p.shape[0] != n]
    if shared or any(True for _ in experts.children() if any(_.parameters())):
        return (f"{type(experts).__name__} holds tensors not indexed by expert "
                f"({shared or 'in a submodule'}): they could not be split over the ranks")
    return None


def shard_experts(experts: nn.Module, *, group: Any = None, mesh: Any = None,
                  config: MC2Config) -> nn.Module:
    """This rank's share of ``experts`` as a module whose forward runs mc2's pipeline."""
    n = experts.num_experts
    layout = resolve_layout(group, mesh, num_experts=n)
    mine = layout.experts_of_this_rank(n)
    local = copy.copy(experts)
    local.__class__ = _stage_class(type(experts))
    with torch.no_grad():
        local._parameters = {name: nn.Parameter(p[mine.start:mine.stop].clone(),
                                                requires_grad=p.requires_grad)
                             for name, p in experts._parameters.items() if p is not None}
    local._buffers = dict(experts._buffers)
    local._modules = dict(experts._modules)
    local.num_experts = len(mine)
    local.global_num_experts, local.first_expert = n, mine.start
    local.expert_names = tuple(local._parameters)
    local.layout, local.mc2_config = layout, config
    return local


def ep_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules the model's own expert-parallel plan names (its config's
    ``base_model_ep_plan`` rules of style ``ep_dispatch_experts``), by name."""
    plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {}
    rules = [re.compile(r"(?:^|\.)" + re.escape(k).replace(r"\*", r"\d+") + "$")
             for k, style in plan.items() if style == "ep_dispatch_experts"]
    return [(name, m) for name, m in model.named_modules()
            if any(rule.search(name) for rule in rules)]
