"""How rows travel, first way: one row per (token, expert) pair.

A token routed to two experts of one rank goes there twice. The sender scales nothing: the
expert outputs come back one per pair and the weighted top-k sum
(:func:`mc2.engine.passes.run.weighted_sum`) applies the combine weights where the tokens are,
so the combine weights' gradient is local too (each pair's output dotted with the output
gradient).

Row moves per routed row and pass (counted, each one needed): gather into the send buffer (1),
reorder to expert order (2), back to receive order (3), scatter (4). Moves 2 and 3 are skipped
where arrival order already is expert order (one local expert, or one rank).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mc2.engine.passes.pass_output import PassOutput
from mc2.engine.transport.workspace import Workspace


def gather_rows(ws: Workspace, source: Tensor, index: Tensor) -> Tensor:
    """``source[index]`` into a workspace buffer."""
    out = ws.empty((index.shape[0], source.shape[-1]), source.dtype, source.device)
    return torch.index_select(source, 0, index, out=out)


class _ExpertOrder:
    """Received rows to expert order and back (both passes): a permutation by the route's
    ``expert_gather``, or nothing where arrival order already is expert order."""

    ws: Workspace
    routes: Any

    def to_experts(self, i: int, received: Tensor) -> Tensor:
        route = self.routes[i]
        if route.expert_gather is None:
            return received
        out = self.ws.empty(tuple(received.shape), received.dtype, received.device)
        return torch.index_select(received, 0, route.expert_gather, out=out)

    def from_experts(self, i: int, rows: Tensor) -> Tensor:
        route = self.routes[i]
        if route.expert_gather is None:
            return rows
        out = self.ws.empty(tuple(rows.shape), rows.dtype, rows.device)
        return out.index_copy_(0, route.expert_gather, rows)


class PairsForward(_ExpertOrder):
    """The forward's per-micro-batch steps: each pair's row out, its expert's output back,
    filed in ``result.expert_out`` at the pair's place."""

    def __init__(self, x: Tensor, experts: Any, call: Any, needs: Any,
                 result: PassOutput) -> None:
        self.x, self.experts, self.call, self.needs, self.result = x, experts, call, needs, result
        self.ws, self.routes = call.workspace, call.handle.micro_batches
        self.outputs()

    def outputs(self) -> None:
        """Where the returned rows go."""
        handle = self.call.handle
        self.result.expert_out = self.ws.empty((handle.num_tokens * handle.topk, self.x.shape[-1]),
                                               self.x.dtype, self.x.device)
        if sum(map(sum, (r.send_splits for r in self.routes))) < handle.num_tokens * handle.topk:
            self.result.expert_out.zero_()  # slots of no expert (-1): no row comes back

    def gather(self, i: int) -> Tensor:
        return gather_rows(self.ws, self.x, self.routes[i].token_index)

    def compute(self, i: int, received: Tensor) -> Tensor:
        route = self.routes[i]
        y, self.result.activations[i] = self.experts.run(
            self.to_experts(i, received), route.expert_counts, route.expert_offsets,
            keep=self.call.keep_activations, needs=tuple(self.needs.experts),
            strategy=self.call.strategy, workspace=self.ws)
        return self.from_experts(i, y)

    def scatter(self, i: int, rows: Tensor) -> None:
        self.result.expert_out.index_copy_(0, self.routes[i].pair_order, rows)

    def finish(self) -> None:
        """Nothing left: the rows are filed."""


class PairsBackward(_ExpertOrder):
    """The backward's steps: each pair's output gradient (times its weight) out, its input
    gradient back and added to its token's; the experts' weight gradients while those travel.
    The combine weights' gradient is local (:meth:`__init__`)."""

    def __init__(self, grad_out: Tensor, inputs: Any, state: Any, needs: Any) -> None:
        call = state.call
        self.grad_out, self.inputs, self.state, self.needs, self.call = \
            grad_out, inputs, state, needs, call
        self.ws, self.routes = call.workspace, call.handle.micro_batches
        tokens, hidden = call.handle.num_tokens, grad_out.shape[-1]
        self.experts = inputs.routed_weights(call)
        self.grads = self.experts.gradients(tuple(needs.experts), self.ws)
        self.pending: list[Any] = [None] * len(self.routes)
        self.grad_x = self.ws.empty((tokens, hidden), grad_out.dtype, grad_out.device).zero_()
        self.grad_combine = self.local_combine_grad()

    def local_combine_grad(self) -> Tensor | None:
        """``[T, topk]``: each slot's expert output dotted with its token's output gradient."""
        if not self.needs.combine:
            return None
        handle, hidden = self.call.handle, self.grad_out.shape[-1]
        tokens, topk = handle.num_tokens, handle.topk
        return torch.bmm(self.state.expert_out.view(tokens, topk, hidden),
                         self.grad_out.view(tokens, hidden, 1)).view(tokens, topk)

    def gather(self, i: int) -> Tensor:
        route = self.routes[i]
        rows = gather_rows(self.ws, self.grad_out, route.token_index)
        weights = self.inputs.combine.reshape(-1).index_select(0, route.pair_order)
        return rows.mul_(weights.unsqueeze(1))

    def compute(self, i: int, received: Tensor) -> Tensor:
        route = self.routes[i]
        grad_in, self.pending[i] = self.experts.backward(
            self.state.activations[i], self.to_experts(i, received), route.expert_counts,
            route.expert_offsets, self.grads, strategy=self.call.strategy, workspace=self.ws)
        self.state.activations[i] = None  # free as we go
        return self.from_experts(i, grad_in)

    def scatter(self, i: int, rows: Tensor) -> None:
        self.grad_x.index_add_(0, self.routes[i].token_index, rows)

    def deferred(self, i: int) -> None:
        """Micro-batch ``i``'s weight gradients, while its input gradient travels."""
        if self.pending[i] is not None:
            self.grads.add(self.pending[i], strategy=self.call.strategy)
            self.pending[i] = None

    def finish(self) -> tuple[Tensor, tuple[Tensor | None, ...], Tensor | None]:
        """``(grad_x [T, H], the routed experts' gradients, the combine weights')``."""
        return self.grad_x, self.grads.finish(), self.grad_combine
