"""Hugging Face ``transformers`` (>= 5): swap sparse-MoE blocks for MC2 blocks in one line.

``enable_mc2(model, group=None)`` finds every sparse-MoE block whose router returns
``(logits, top_k_weights, top_k_index)`` and whose experts keep fused ``gate_up_proj
[E, 2F, H]`` and ``down_proj [E, H, F]`` weights with SiLU (Mixtral, Qwen3-MoE in transformers
5.x), and replaces it with an :class:`MC2SparseMoeBlock` that keeps the original router (so
router-logit outputs and the auxiliary loss keep working) and holds only this rank's experts.

The rest of the model stays as it is on every rank: its parameters are replicated, so train it
data-parallel: :func:`average_gradients` turns per-rank gradients into the group's.
No hub access is needed: the function works on any model object, including one built from a
local config.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..comm import group_rank, group_size
from ..ops import MicroBatches, fused_expert_packed


class MC2SparseMoeBlock(nn.Module):
    """A sparse-MoE block running through :func:`mc2.fused_expert` with this rank's experts.

    The experts keep the model's own packed layout and names: ``gate_up_proj [L, 2F, H]``
    (gate rows first) and ``down_proj [L, H, F]``, this rank's ``L`` experts sliced out once;
    :func:`mc2.fused_expert_packed` runs them as they are, with no split or transpose.
    """

    def __init__(self, block: nn.Module, *, group: Any = None,
                 micro_batches: MicroBatches = "auto", overlap: bool = True) -> None:
        super().__init__()
        experts = block.experts
        num_experts, two_f, _ = experts.gate_up_proj.shape
        world = group_size(group)
        if num_experts % world:
            raise ValueError(f"{num_experts} experts do not split over {world} ranks")
        local = num_experts // world
        first = group_rank(group) * local

        mine = slice(first, first + local)
        with torch.no_grad():
            self.gate_up_proj = nn.Parameter(experts.gate_up_proj[mine].clone())
            self.down_proj = nn.Parameter(experts.down_proj[mine].clone())
        self.register_buffer("expert_index", torch.arange(first, first + local))
        self.gate = block.gate
        self.group, self.micro_batches, self.overlap = group, micro_batches, overlap

    def forward(self, hidden_states: Tensor) -> Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, weights, ids = self.gate(x)
        out = fused_expert_packed(x, self.gate_up_proj, self.down_proj, ids,
                                  weights.to(x.dtype), group=self.group,
                                  micro_batches=self.micro_batches, overlap=self.overlap)
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


def enable_mc2(model: nn.Module, group: Any = None, *, micro_batches: MicroBatches = "auto",
               overlap: bool = True) -> int:
    """Replace the model's sparse-MoE blocks in place; returns how many were replaced.

    Every rank of ``group`` must call it on an identical model (same weights): each keeps its
    own experts. Raises ``ValueError`` if the model has no block this adapter understands.
    """
    replaced = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, MC2SparseMoeBlock) or not _is_sparse_moe_block(module):
            continue
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        setattr(parent, name.rsplit(".", 1)[-1],
                MC2SparseMoeBlock(module, group=group, micro_batches=micro_batches,
                                  overlap=overlap))
        replaced += 1
    if not replaced:
        raise ValueError(f"enable_mc2: no sparse-MoE block with fused gate_up_proj/down_proj "
                         f"experts found in {type(model).__name__}")
    return replaced


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The rank-local expert weights of every MC2 block (not to be averaged over ranks)."""
    return [p for m in model.modules() if isinstance(m, MC2SparseMoeBlock)
            for p in (m.gate_up_proj, m.down_proj)]


def average_gradients(model: nn.Module, group: Any = None) -> None:
    """Make every rank's gradients those of the group's mean loss (call after ``backward``).

    Each rank's loss covers its own tokens and the objective is their mean. Replicated
    parameters (attention, norms, router, embeddings) get the average of the ranks' gradients
    (one flat all-reduce). A local expert's gradient already sums the contributions of every
    rank's tokens (they travelled to it), so it is only divided by the group size.
    """
    world = group_size(group)
    if world == 1:
        return
    local = {id(p) for p in expert_parameters(model)}
    for p in expert_parameters(model):
        if p.grad is not None:
            p.grad.div_(world)
    replicated = [p for p in model.parameters() if id(p) not in local and p.requires_grad]
    if not replicated:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in replicated])
    dist.all_reduce(flat, group=group)
    flat /= world
    offset = 0
    for p in replicated:
        chunk = flat[offset:offset + p.numel()].view_as(p)
        if p.grad is None:
            p.grad = chunk.clone()
        else:
            p.grad.copy_(chunk)
        offset += p.numel()
