"""What a forward pass produced, before the weighted top-k sum: the one result every way rows
travel fills in (pairs, rows once per destination, capacity slabs), so the adapters above the
pass never ask which ran."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from mc2.engine.compute.experts import ExpertActivations


@dataclass
class PassOutput:
    """What the forward pass of one call produced, before the weighted sum."""

    expert_out: Tensor | None  # [T * topk, H] each (token, slot)'s expert output
    activations: list[Any]
    shared_out: Tensor | None = None
    shared_activations: ExpertActivations | None = None
    summed: Tensor | None = None  # [T, H] the weighted sum so far, where the experts' side
    # weights the rows (once per destination; capacity slabs)
    pair_out: list[Tensor | None] | None = None  # once per destination: each micro-batch's
    # expert outputs
