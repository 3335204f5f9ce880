"""Hugging Face ``transformers`` (>= 5): swap sparse-MoE blocks for MC2 blocks in one line.

``enable_mc2(model, group=None)`` finds every sparse-MoE block whose router returns
``(logits, top_k_weights, top_k_index)`` and whose experts keep fused ``gate_up_proj
[E, 2F, H]`` and ``down_proj [E, H, F]`` weights with SiLU (Mixtral, Qwen3-MoE in transformers
5.x), and replaces it with an :class:`MC2SparseMoeBlock` that keeps the original router (so
router-logit outputs and the auxiliary loss keep working) and holds only this rank's experts.

The rest of the model stays as it is on every rank: its parameters are replicated, so train it
data-parallel: :func:`mc2.average_gradients` turns per-rank gradients into those of the mean
loss. With ``mesh=`` the experts are split over the mesh's ``"ep"`` dimension and replicated
over ``"dp"``; :mod:`mc2.parallel.checkpoint` saves and reshards such a model with
``torch.distributed.checkpoint``.
No hub access is needed: the function works on any model object, including one built from a
local config.
"""

from __future__ import annotations

from typing import Any, Unpack

import torch
from torch import Tensor, nn

from ..engine.config import ConfigOptions, MC2Config
from ..parallel.expert_shards import expert_shards
from ..parallel.grad_sync import average_gradients
from ..layer import PackedExperts
from ..parallel.mesh import resolve_layout

__all__ = ["enable_mc2", "average_gradients", "expert_parameters", "MC2SparseMoeBlock",
           "LocalExperts"]


class LocalExperts(PackedExperts):
    """This rank's block of a model's experts, under the model's own names and layout.

    ``gate_up_proj [L, 2F, H]`` (gate rows first) and ``down_proj [L, H, F]``, held at
    ``<block>.experts`` as in the unpatched model: the state dict keeps Hugging Face's keys, and
    :mod:`mc2.parallel.checkpoint` writes files the unpatched model loads. Its forward runs the
    fused call (so FSDP2 gathers it, see :class:`mc2.layer.PackedExperts`).
    """

    names = ("gate_up_proj", "down_proj")


class MC2SparseMoeBlock(nn.Module):
    """A sparse-MoE block running through :func:`mc2.fused_expert` with this rank's experts.

    The experts keep the model's own packed layout and names (:class:`LocalExperts`), this
    rank's ``L`` experts sliced out once; :func:`mc2.fused_expert_packed` runs them as they
    are, with no split or transpose.
    """

    def __init__(self, block: nn.Module, *, group: Any = None, mesh: Any = None,
                 config: MC2Config | None = None) -> None:
        super().__init__()
        experts = block.experts
        self.num_experts = experts.gate_up_proj.shape[0]
        self.layout = resolve_layout(group, mesh, num_experts=self.num_experts)
        mine = self.layout.experts_of_this_rank(self.num_experts)
        with torch.no_grad():
            self.experts = LocalExperts(experts.gate_up_proj[mine.start:mine.stop].clone(),
                                        experts.down_proj[mine.start:mine.stop].clone())
        # Not persistent: it differs between ranks, and checkpoints place experts by the layout.
        self.register_buffer("expert_index", torch.arange(mine.start, mine.stop),
                             persistent=False)
        self.gate = block.gate
        self.group = self.layout.ep_group
        self.config = config or MC2Config()

    def mc2_expert_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's expert shards (see :mod:`mc2.parallel.expert_shards`)."""
        return {"experts.gate_up_proj": self.experts.gate_up_proj,
                "experts.down_proj": self.experts.down_proj}

    def forward(self, hidden_states: Tensor) -> Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, weights, ids = self.gate(x)
        out = self.experts(x, ids, weights.to(x.dtype), group=self.group, config=self.config)
        return out.reshape(shape)


def _is_sparse_moe_block(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    gate = getattr(module, "gate", None)
    if experts is None or gate is None or not hasattr(gate, "top_k"):
        return False
    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, Tensor) and isinstance(down, Tensor)):
        return False
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] != 2 * down.shape[2]:
        return False
    act = getattr(experts, "act_fn", None)
    return act is None or isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def enable_mc2(model: nn.Module, group: Any = None, *, mesh: Any = None,
               config: MC2Config | None = None, **options: Unpack[ConfigOptions]) -> int:
    """Replace the model's sparse-MoE blocks in place; returns how many were replaced.

    Every rank must call it on an identical model (same weights): each keeps its own experts.
    ``group`` is the expert-parallel group; or ``mesh``, a 1-D mesh (expert parallel) or a
    ``("dp", "ep")`` mesh (:func:`mc2.expert_parallel_mesh`): experts split over ``ep`` and
    replicated over ``dp``, everything else replicated everywhere. ``config`` (an
    :class:`mc2.MC2Config`) or its fields as keywords (``micro_batches=4``,
    ``wire_dtype="fp8"``, ``hierarchy="2d"``, ...): how every block's fused call runs.

    Raises:
        ValueError: the model has no block this adapter understands, or the mesh is bad
            (see :func:`mc2.parallel.mesh.resolve_layout`); raised on every rank alike.
    """
    config = MC2Config.of(config, **options)
    replaced = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, MC2SparseMoeBlock) or not _is_sparse_moe_block(module):
            continue
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        setattr(parent, name.rsplit(".", 1)[-1],
                MC2SparseMoeBlock(module, group=group, mesh=mesh, config=config))
        replaced += 1
    if not replaced:
        raise ValueError(f"enable_mc2: no sparse-MoE block with fused gate_up_proj/down_proj "
                         f"experts found in {type(model).__name__}")
    return replaced


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The rank-local expert weights of every MC2 block (not to be averaged over ranks)."""
    return [shard.param for shard in expert_shards(model)]
