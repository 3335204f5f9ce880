"""How rows travel, second way: once per (token, destination rank) (``dedup=True``).

A token routed to several experts of one rank is sent there once, with a slot table
(:mod:`mc2.engine.decide.dedup`); the receiving rank expands it to its experts, weights each
expert's output with the slot's combine weight and sums them, so one row per received row goes
back and the sender adds the rows of each token (``result.summed``). The combine weights are
used where the experts are, so their gradient is computed there too, filed in a per-micro-batch
slot table and sent back once at the end of the backward.
"""

from __future__ import annotations


from typing import Any

import torch
from torch import Tensor

from mc2.engine.passes.pass_output import as_summed
from mc2.engine.passes.travel.pairs import PairsBackward, PairsForward, gather_rows
from mc2.engine.transport.row_sums import accumulation_dtype, sum_rows
from mc2.observation.timeline import maybe_span


class OnceForward(PairsForward):
    """The forward's steps: each (token, destination)'s row out, the weighted sum of its
    experts' outputs back, added to the token's sum."""

    def outputs(self) -> None:
        handle = self.call.handle
        self.result.summed = torch.zeros((handle.num_tokens, self.x.shape[-1]),
                                         dtype=accumulation_dtype(self.x.dtype),
                                         device=self.x.device)
        self.result.kept = [None] * len(self.routes)
        self.result.weigh = as_summed

    def to_experts(self, i: int, received: Tensor) -> Tensor:
        return gather_rows(self.ws, received, self.routes[i].slots.rows)

    def from_experts(self, i: int, y: Tensor) -> Tensor:
        if self.call.keep_activations:  # for the combine weights' gradient, computed here
            self.result.kept[i] = y.detach()
        slots = self.routes[i].slots
        return sum_rows(y, slots.rows, slots.received, scale=slots.weights)

    def scatter(self, i: int, rows: Tensor) -> None:
        summed = self.result.summed
        summed.index_add_(0, self.routes[i].token_index, rows.to(summed.dtype))


class OnceBackward(PairsBackward):
    """The backward's steps: each (token, destination)'s output gradient out once; there each
    pair's gradient is its row times its weight, and its weight's gradient its expert output
    dotted with the row (filed in the micro-batch's slot table); the summed input gradient
    back."""

    def __init__(self, grad_out: Tensor, inputs: Any, state: Any, needs: Any) -> None:
        self.weight_tables: list[Tensor] = []  # per micro-batch: [r_i, topk]
        super().__init__(grad_out, inputs, state, needs)

    def local_combine_grad(self) -> Tensor | None:
        return None  # computed where the experts are, sent back in finish()

    def gather(self, i: int) -> Tensor:  # each destination scales by its own slots' weights
        return gather_rows(self.ws, self.grad_out, self.routes[i].token_index)

    def to_experts(self, i: int, received: Tensor) -> Tensor:
        slots, topk = self.routes[i].slots, self.call.handle.topk
        rows = gather_rows(self.ws, received, slots.rows)
        if self.needs.combine:
            acc = accumulation_dtype(rows.dtype)
            table = torch.zeros(slots.received * topk, dtype=acc, device=rows.device)
            y = self.state.kept[i]
            table.index_copy_(0, slots.slots, (y.to(acc) * rows.to(acc)).sum(-1))
            self.weight_tables.append(table.view(slots.received, topk))
            self.state.kept[i] = None
        return rows.mul_(slots.weights.unsqueeze(1))

    def from_experts(self, i: int, grad_in: Tensor) -> Tensor:
        slots = self.routes[i].slots
        return sum_rows(grad_in, slots.rows, slots.received)

    def finish(self) -> tuple[Tensor, tuple[Tensor | None, ...], Tensor | None]:
        if self.needs.combine:
            with maybe_span(self.call.timeline, "comm", "weight_grads", "backward"):
                self.grad_combine = self.call.handle.weight_grads.send_back(
                    self.weight_tables, self.grad_out.dtype)
        return super().finish()
