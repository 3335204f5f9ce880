"""What a forward pass produced, before the weighted top-k sum: the one result every way rows
travel fills in (pairs, rows once per destination, capacity slabs), so the adapters above the
pass never ask which ran."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from mc2.engine.compute.experts import ExpertActivations


def by_pairs(result: "PassOutput", out: Tensor, combine: Tensor) -> None:
    """``out [T, H]``: each token's ``topk`` expert outputs (one row per pair came back),
    weighted by ``combine [T, topk]`` here."""
    (tokens, topk), hidden = combine.shape, out.shape[-1]
    torch.bmm(combine.view(tokens, 1, topk), result.expert_out.view(tokens, topk, hidden),
              out=out.view(tokens, 1, hidden))


def as_summed(result: "PassOutput", out: Tensor, combine: Tensor) -> None:
    """``out [T, H]``: the sum the experts' side already weighted (rows once per destination,
    capacity slabs)."""
    out.copy_(result.summed)


@dataclass
class PassOutput:
    """What the forward pass of one call produced, before the weighted sum."""

    expert_out: Tensor | None  # [T * topk, H] each (token, slot)'s expert output
    activations: list[Any]
    shared_out: Tensor | None = None
    shared_activations: ExpertActivations | None = None
    summed: Tensor | None = None  # [T, H] the weighted sum so far, where the experts' side
    # weights the rows (once per destination; capacity slabs)
    kept: list[Tensor | None] | None = None  # what the way rows travel keeps for its
    # backward (once per destination: each micro-batch's expert outputs)
    # how the top-k outputs become each token's weighted sum: set by the way rows travel (a
    # module-level function, so the result holds no reference back to the pass's objects)
    weigh: Callable[["PassOutput", Tensor, Tensor], None] = by_pairs

    def weighted(self, out: Tensor, combine: Tensor) -> None:
        """``out [T, H]`` = each token's expert outputs weighted by ``combine [T, topk]``."""
        self.weigh(self, out, combine)
