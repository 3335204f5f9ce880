"""An independent dense single-process reference for the MoE layer.

Every expert is applied to every token; the routing only enters as a dense [tokens, experts]
mask of combine weights. Nothing here shares code with ``mc2``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def dense_moe(x: Tensor, w_up: Tensor, w_gate: Tensor, w_down: Tensor, expert_ids: Tensor,
              routing_weights: Tensor) -> Tensor:
    """x [T, H]; weights [E, H, F] / [E, F, H] (all experts); ids, weights [T, k] -> [T, H]."""
    num_experts = w_up.shape[0]
    hidden = F.silu(torch.einsum("th,ehf->etf", x, w_gate)) * torch.einsum("th,ehf->etf", x, w_up)
    every = torch.einsum("etf,efh->eth", hidden, w_down)
    mask = torch.zeros(x.shape[0], num_experts, dtype=x.dtype)
    mask = mask.scatter_add(1, expert_ids.long(), routing_weights)
    return torch.einsum("te,eth->th", mask, every)
