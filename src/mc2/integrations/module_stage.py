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

One exception to "keeps its own forward": a block whose forward is exactly ``routed(x) +
shared_experts(x)`` with a plain SwiGLU shared MLP (:data:`SHARED_SWIGLU_BLOCKS`: DeepSeek-V3's
and GLM-4-MoE's, each checked against the model's own block by the tests) runs its router as
it is and hands the shared MLP's weights, as views, to the experts' call, which computes it
where its pipeline would wait (:func:`shared_inside`).
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
from mc2.integrations.weight_reads import first_problem, hook_problem, say_once, user_hook_problem
from mc2.parallel.mesh import resolve_layout


class ModuleStageExperts:
    """Mixed into a copy of a model's experts class (see :func:`shard_experts`): the copy
    holds this rank's experts, and its forward goes through mc2's pipeline."""

    layout: Any
    mc2_config: MC2Config
    global_num_experts: int
    expert_names: tuple[str, ...]
    first_expert: int

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                shared: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
        """The routed experts' output (plus, with ``shared``, a SwiGLU shared MLP's as
        ``(up, gate, down)`` views, computed inside the call)."""
        own = super().forward  # type: ignore[misc]  # the experts class's own forward
        up, gate, down = shared if shared is not None else (None, None, None)
        return fused_expert_module(hidden_states, self, top_k_index, top_k_weights,
                                   group=self.layout.ep_group, config=self.mc2_config,
                                   local_experts=self.num_experts, forward=own,
                                   shared_up=up, shared_gate=gate, shared_down=down)

    def mc2_expert_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's expert shards (see :mod:`mc2.parallel.expert_shards`)."""
        return {name: self._parameters[name] for name in self.expert_names}  # type: ignore

    @property
    def expert_index(self) -> Any:
        return torch.arange(self.first_expert, self.first_expert + self.num_experts)


SHARED_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# sparse-MoE blocks whose forward is ``_, w, ids = gate(h); experts(h, ids, w) +
# shared_experts(h)`` (transformers 5), so that the shared MLP may run inside the call
SHARED_SWIGLU_BLOCKS = ("DeepseekV3MoE", "Glm4MoeMoE")


def is_silu(act: Any) -> bool:
    """Whether an MLP's ``act_fn`` is exactly SiLU (``None``: the default): ``nn.SiLU`` or
    transformers' ``SiLUActivation`` themselves, not a subclass (it may compute more, a clamp
    say), and without a hook (mc2 computes SiLU, not the module)."""
    if act is None:
        return True
    cls = type(act)
    exact = cls is nn.SiLU or (cls.__name__ == "SiLUActivation"
                               and cls.__module__.startswith("transformers."))
    return exact and hook_problem(act) is None


class SharedInsideBlock:
    """Mixed into a copy of a :data:`SHARED_SWIGLU_BLOCKS` class: the block's forward with its
    shared MLP inside the experts' call (see the module docstring), where the MLP reads as a
    plain SwiGLU at this forward (:func:`shared_swiglu_problem`); else the model's own forward,
    said once."""

    def forward(self, hidden_states: Tensor) -> Tensor:
        views = shared_views(self.shared_experts, self.experts,  # type: ignore[attr-defined]
                             f"the shared_experts of {type(self).__name__} run beside the "
                             "experts' call, as the model runs them")
        if views is None:
            return super().forward(hidden_states)  # type: ignore[misc]
        shape = hidden_states.shape
        _, weights, ids = self.gate(hidden_states)  # type: ignore[attr-defined]
        return self.experts(hidden_states.view(-1, shape[-1]), ids,  # type: ignore[attr-defined]
                            weights, shared=views).view(shape)


def shared_views(mlp: Any, experts: Any, beside: str) -> tuple[Tensor, Tensor, Tensor] | None:
    """A shared SwiGLU ``mlp``'s weights as ``(up [1,H,F], gate [1,H,F], down [1,F,H])`` views
    for the ``experts``' call; ``None``, said once (``beside``), where they are not what it computes
    (:func:`shared_swiglu_problem`) or a hook on ``experts`` would see them added inside the call."""
    if (problem := shared_swiglu_problem(mlp) or user_hook_problem(experts)) is not None:
        say_once(f"mc2: {beside}: {problem}")
        return None
    return tuple(m.weight.t().unsqueeze(0) for m in (mlp.up_proj, mlp.gate_proj, mlp.down_proj))


def shared_swiglu_problem(mlp: Any) -> str | None:
    """Why ``mlp`` does not read as the bias-free SwiGLU ``down(silu(gate x) * up x)`` of its
    ``gate_proj``, ``up_proj`` and ``down_proj`` weights, or ``None``: the forward of
    Hugging Face's class (not a subclass's, not one replaced on the instance), each a plain
    ``nn.Linear`` without bias, hook or parametrization (:func:`~mc2.integrations.
    weight_reads.read_problem`), matching shapes, a SiLU, no other tensor. Cheap enough for
    every forward (attribute reads only)."""
    forward = getattr(type(mlp), "forward", None)
    if not getattr(forward, "__module__", "").startswith("transformers."):
        # a subclass with a forward of its own (a GELU, say) reads the same (found by a review)
        return f"{type(mlp).__name__}'s forward is not the model's own (it may compute more)"
    linears = [(name, getattr(mlp, name, None)) for name in SHARED_PROJECTIONS]
    if (problem := first_problem(linears)) is not None:
        return problem
    if any(m.bias is not None for _, m in linears):
        return "a projection has a bias (mc2's SwiGLU has none)"
    if (problem := hook_problem(mlp)) is not None:
        return problem
    g, u, d = (m.weight for _, m in linears)
    if g.shape != u.shape or tuple(d.shape) != tuple(g.shape)[::-1]:
        return (f"weights {tuple(g.shape)}, {tuple(u.shape)}, {tuple(d.shape)} are not [F, H], "
                "[F, H], [H, F]")
    if _tensors(mlp) or any(_tensors(m) != 1 or m._modules for _, m in linears):
        return f"{type(mlp).__name__} holds tensors beside the three weights"
    if len(mlp._modules) != 3 + ("act_fn" in mlp._modules):
        return f"{type(mlp).__name__} holds submodules beside the three projections"
    if not is_silu(getattr(mlp, "act_fn", None)):
        return f"act_fn {type(mlp.act_fn).__name__} (mc2 computes SiLU)"
    return None


def _tensors(module: nn.Module) -> int:
    """The module's own parameters and buffers (a ``None`` slot, nn.Linear's absent bias, is
    none)."""
    return sum(t is not None for t in (*module._parameters.values(), *module._buffers.values()))


def shared_inside(block: nn.Module) -> bool:
    """Run ``block``'s shared MLP inside its experts' call, where the block is one of
    :data:`SHARED_SWIGLU_BLOCKS` with module-stage experts (whether its MLP reads as a SwiGLU
    is asked at every forward, :class:`SharedInsideBlock`); whether it does."""
    if (type(block).__name__ not in SHARED_SWIGLU_BLOCKS
            or not isinstance(getattr(block, "experts", None), ModuleStageExperts)
            or not isinstance(getattr(block, "shared_experts", None), nn.Module)):
        return False
    block.__class__ = _shared_class(type(block))
    return True


@functools.cache
def _shared_class(cls: type) -> type:
    return type(f"MC2{cls.__name__}", (SharedInsideBlock, cls), {})


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
    if shared or any(True for child in experts.children()
                     for _ in child.parameters()):
        wrapped = (f" (it wraps {type(experts.base_layer).__name__}: an adapter on the experts' "
                   "tensors, e.g. PEFT's target_parameters, which mc2 cannot split)"
                   if isinstance(getattr(experts, "base_layer", None), nn.Module) else "")
        return (f"{type(experts).__name__} holds tensors not indexed by expert "
                f"({shared or 'in a submodule'}): they could not be split over the ranks"
                + wrapped)
    # only parameters are split by expert: a buffer, or weights kept as plain attributes
    # (transformers' MXFP4 loading moves gate_up_proj/down_proj out of the parameters into
    # kernel tensors), would stay whole while num_experts shrinks to the local count
    unsplit = sorted(name for name, b in experts.named_buffers(recurse=False)) + sorted(
        name for name, value in vars(experts).items()
        if not name.startswith("_") and _tensor_like(value))
    if unsplit:
        return (f"{type(experts).__name__} holds tensors outside its parameters ({unsplit}): "
                "mc2 splits only parameters over the ranks")
    return None


def _tensor_like(value: Any) -> bool:
    """A tensor, or a kernel library's tensor (a shape and a storage of its own)."""
    return isinstance(value, Tensor) or (hasattr(value, "shape") and hasattr(value, "storage"))


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
