"""How rows travel, third way: fixed-size slabs (``MC2Config(capacity=N)``, no host read).

Per micro-batch, forward: this rank's slab rows (``x`` of each slot's token, with the slot
tables packed into the same bytes: :mod:`mc2.engine.transport.slabs`) out; the received rows'
experts; one row back per received row, weighted and summed there; the sender adds the rows of
each token. Backward: the output gradient of each slot's token out; the experts' backward; the
rows' gradient back with each row's weight gradients packed beside it. Two collectives per
micro-batch and pass (and, before the forward, the call's trusted handshake in host memory).

The experts run one of two ways (the plan's ``strategy``, decided once where the call is
planned: :func:`experts_way`), neither reading a count:

- :class:`SortedPairs` (experts with a grouped backward, mc2's SwiGLU, where ``grouped_mm``
  serves the dtype: float32 and bfloat16): the received (row, slot) pairs sorted by local
  expert into fixed ``R * k`` buffers, the empty slots last, ``grouped_mm`` offsets on the
  device, the hand-written backward; every expert's weight gradient is written (an untouched
  expert's is zero);
- :class:`Dense` (other dtypes, experts modules): every received row through every local
  expert, weighted by its table and summed (the experts' ``dense``), and autograd over that
  graph (``torch.autograd.grad``) for the rows, the parameters and the tables' weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mc2.engine.compute.experts import ExpertActivations
from mc2.engine.compute.module_experts import KeptAsIs, ModuleGrads
from mc2.engine.decide.capacity import HEADER, CapacityHandle, record_errors
from mc2.engine.decide.dedup import slot_ids
from mc2.engine.decide.overflow import check_at_once, raises_at_once
from mc2.engine.decide.routing import count_on_device
from mc2.engine.passes.pass_output import PassOutput, as_summed
from mc2.engine.transport.row_sums import accumulation_dtype, sum_rows
from mc2.engine.transport.slabs import pack, unpack


@dataclass(frozen=True)
class SortedPairs:
    """A micro-batch's received (row, slot) pairs sorted by local expert, the empty slots last:
    ``R * k`` entries whatever the routing (a fixed size), the experts' ``grouped_mm`` offsets
    on the device, so no count reaches the host and the GEMMs skip the empty tail."""

    rows: Tensor  # [R*k] the received row of each pair
    weights: Tensor  # [R*k] its weight (0 for an empty slot)
    slots: Tensor  # [R*k] its place in the [R, k] tables
    valid: Tensor  # [R*k, 1] bool
    offsets: Tensor  # [L] int32 running ends

    @staticmethod
    def of(tables: Tensor, local_experts: int, topk: int, dtype: torch.dtype) -> "SortedPairs":
        ids = slot_ids(tables, topk).reshape(-1)
        key = torch.where(ids >= 0, ids, local_experts)
        sorted_key, order = torch.sort(key, stable=True)
        counts = count_on_device(key, local_experts + 1)[:local_experts]
        weights = tables[:, topk:2 * topk].reshape(-1).index_select(0, order).to(dtype)
        valid = (sorted_key < local_experts).unsqueeze(1)
        return SortedPairs(order // topk, torch.where(valid[:, 0], weights, 0), order, valid,
                           torch.cumsum(counts, 0).to(torch.int32))

    def reduce(self, values: Tensor, received: int, weighted: bool) -> Tensor:
        """Per received row, the sum of its pairs' ``values`` (times their weights); the empty
        tail (whatever the GEMMs left there) counts 0."""
        return sum_rows(values, self.rows, received, scale=self.weights if weighted else None,
                        keep=self.valid)


@dataclass
class SortedActivations(KeptAsIs):
    """One micro-batch of :class:`Sorted`: its pairs, the experts' saved inputs, and each
    pair's expert output where the combine weights need a gradient."""

    pairs: SortedPairs
    expert_inputs: ExpertActivations | None
    y: Tensor | None  # [R*k, H]


@dataclass
class DenseActivations(KeptAsIs):
    """One micro-batch of :class:`Dense`: the leaves and the output of its graph."""

    rows: Tensor
    table: Tensor  # [R, L] each row's weight per local expert
    leaves: tuple[Tensor, ...]
    out: Tensor
    local_ids: Tensor  # [R, k] each slot's local expert (-1: elsewhere)


class Sorted:
    """The experts on sorted pairs (module docstring)."""

    def __init__(self, experts: Any, call: Any, needs: Any) -> None:
        self.experts, self.call, self.needs = experts, call, needs
        self.k, self.local = call.handle.topk, call.handle.local_experts

    def forward(self, rows: Tensor, tables: Tensor) -> tuple[Tensor, Any]:
        pairs = SortedPairs.of(tables, self.local, self.k, rows.dtype)
        keep = self.call.keep_activations
        y, saved = self.experts.run(rows.index_select(0, pairs.rows), [], pairs.offsets,
                                    keep=keep, needs=(), strategy="grouped",
                                    workspace=self.call.workspace)
        kept = SortedActivations(pairs, saved, y if self.needs.combine else None) \
            if keep else None  # y: a fresh tensor
        return pairs.reduce(y, rows.shape[0], weighted=True), kept

    def gradients(self, needs: tuple[bool, ...]) -> Any:
        return self.experts.gradients(needs, self.call.workspace)

    def backward(self, received: Tensor, saved: SortedActivations, grads: Any
                 ) -> tuple[Tensor, Tensor]:
        """``(the rows' gradient, [R, k] the slots' weights' gradients)``."""
        pairs, k = saved.pairs, self.k
        rows = torch.where(pairs.valid, received.index_select(0, pairs.rows), 0)
        slots = torch.zeros(received.shape[0] * k, dtype=torch.float64, device=received.device)
        if saved.y is not None:  # each pair's weight's gradient, filed in the tables' places
            dots = torch.where(pairs.valid[:, 0], (saved.y * rows).sum(-1), 0)
            slots.index_copy_(0, pairs.slots, dots.to(torch.float64))
        grad_in, work = self.experts.backward(saved.expert_inputs, rows * pairs.weights.unsqueeze(1),
                                              [], pairs.offsets, grads, strategy="grouped",
                                              workspace=self.call.workspace)
        grads.add(work, strategy="grouped")  # (nothing where no row came: work is None)
        return pairs.reduce(grad_in, received.shape[0], weighted=False), slots.view(-1, k)


class Dense:
    """Every row through every local expert (module docstring)."""

    def __init__(self, experts: Any, call: Any, needs: Any) -> None:
        self.experts, self.call, self.needs = experts, call, needs
        self.k, self.local = call.handle.topk, call.handle.local_experts
        self.params = experts.tensors()

    def _weight_table(self, tables: Tensor) -> tuple[Tensor, Tensor]:
        """``([R, L] weights, [R, k] local ids)`` from received slot tables."""
        ids = slot_ids(tables, self.k)
        weights = tables[:, self.k:2 * self.k]
        table = torch.zeros(tables.shape[0], self.local + 1, dtype=torch.float64,
                            device=tables.device)
        table.scatter_add_(1, torch.where(ids >= 0, ids, self.local), weights)  # repeats add
        return table[:, :self.local], ids

    def forward(self, rows: Tensor, tables: Tensor) -> tuple[Tensor, Any]:
        table, ids = self._weight_table(tables)
        table = table.to(rows.dtype)
        if not self.call.keep_activations:
            with torch.no_grad():
                return self.experts.dense(rows, table, self.params), None
        wants = tuple(self.needs.experts) + (True,) * (len(self.params) - len(self.needs.experts))
        leaf_rows = rows.requires_grad_(True)
        leaf_table = table.requires_grad_(bool(self.needs.combine))
        leaves = tuple(p.detach().requires_grad_(w) for p, w in zip(self.params, wants))
        with torch.enable_grad():
            out = self.experts.dense(leaf_rows, leaf_table, leaves)
        return out.detach(), DenseActivations(leaf_rows, leaf_table, leaves, out, ids)

    def gradients(self, needs: tuple[bool, ...]) -> Any:
        return ModuleGrads(self.params, needs)

    def backward(self, received: Tensor, saved: DenseActivations, grads: Any
                 ) -> tuple[Tensor, Tensor]:
        wanted = [saved.rows] + ([saved.table] if saved.table.requires_grad else []) + \
            [leaf for leaf in saved.leaves if leaf.requires_grad]
        found = torch.autograd.grad(saved.out, wanted, received, allow_unused=True)
        grad_rows, rest = found[0], list(found[1:])
        slots = torch.zeros(received.shape[0], self.k, dtype=torch.float64,
                            device=received.device)
        if saved.table.requires_grad:
            grad_table = rest.pop(0)
            if grad_table is not None:
                picked = grad_table.gather(1, saved.local_ids.clamp(min=0)).to(torch.float64)
                slots = torch.where(saved.local_ids >= 0, picked, 0)
        grads.add(rest, [j for j, leaf in enumerate(saved.leaves) if leaf.requires_grad])
        return (grad_rows if grad_rows is not None else torch.zeros_like(received)), slots


def experts_way(experts: Any, call: Any, needs: Any) -> Sorted | Dense:
    """How a slab call's experts run, as the plan decided (``call.strategy``: module
    docstring)."""
    return (Sorted if call.strategy == "grouped" else Dense)(experts, call, needs)


class SlabsForward:
    """The forward's steps over the slabs of a :class:`~mc2.engine.decide.capacity.CapacityHandle`."""

    def __init__(self, x: Tensor, experts: Any, call: Any, needs: Any,
                 result: PassOutput) -> None:
        self.handle: CapacityHandle = call.handle
        self.x, self.result = x, result
        tokens, hidden = self.handle.num_tokens, x.shape[-1]
        self.padded = torch.cat([x, x.new_zeros((1, hidden))])
        self.summed = torch.zeros(tokens + 1, hidden, dtype=accumulation_dtype(x.dtype),
                                  device=x.device)
        self.way = experts_way(experts, call, needs)
        self.width = 2 * self.handle.topk + HEADER

    def gather(self, i: int) -> Tensor:
        route = self.handle.micro_batches[i]
        return pack(self.padded.index_select(0, route.slot_token), route.tables)

    def compute(self, i: int, received: Tensor) -> Tensor:
        rows, tables = unpack(received, self.x.shape[-1], self.x.dtype, self.width)
        if i == 0:
            record_errors(tables, self.handle)
        out, self.result.activations[i] = self.way.forward(rows, tables)
        return out

    def scatter(self, i: int, returned: Tensor) -> None:
        self.summed.index_add_(0, self.handle.micro_batches[i].slot_token,
                               returned.to(self.summed.dtype))

    def finish(self) -> None:
        if raises_at_once(self.x.device):  # every exchange done: every rank raises here alike
            check_at_once(self.handle.group)
        self.result.summed = self.summed[:self.handle.num_tokens]
        self.result.weigh = as_summed


class SlabsBackward:
    """The backward's steps: the output gradients out along the slabs, the rows' gradients
    back with each slot's weight gradient packed beside them."""

    def __init__(self, grad_out: Tensor, inputs: Any, state: Any, needs: Any) -> None:
        self.handle: CapacityHandle = state.call.handle
        self.inputs, self.state, self.needs = inputs, state, needs
        tokens, hidden = self.handle.num_tokens, grad_out.shape[-1]
        self.hidden, self.dtype = hidden, grad_out.dtype
        self.padded = torch.cat([grad_out, grad_out.new_zeros((1, hidden))])
        self.padded_grad_x = torch.zeros(tokens + 1, hidden, dtype=grad_out.dtype,
                                         device=grad_out.device)
        self.grad_x = self.padded_grad_x[:tokens]
        self.grad_combine = torch.zeros(tokens + 1, self.handle.topk, dtype=torch.float64,
                                        device=grad_out.device)
        self.way = experts_way(inputs.routed_weights(state.call), state.call, needs)
        self.grads = self.way.gradients(tuple(needs.experts))

    def gather(self, i: int) -> Tensor:
        return self.padded.index_select(0, self.handle.micro_batches[i].slot_token)

    def compute(self, i: int, received: Tensor) -> Tensor:
        saved, self.state.activations[i] = self.state.activations[i], None
        return pack(*self.way.backward(received, saved, self.grads))

    def scatter(self, i: int, returned: Tensor) -> None:
        rows, slots = unpack(returned, self.hidden, self.dtype, self.handle.topk)
        token = self.handle.micro_batches[i].slot_token
        self.padded_grad_x.index_add_(0, token, rows)
        self.grad_combine.index_add_(0, token, slots)

    def deferred(self, i: int) -> None:
        """Nothing: the weight gradients are added as each micro-batch's are found."""

    def finish(self) -> tuple[Tensor, tuple[Tensor | None, ...], Tensor | None]:
        combine = self.grad_combine[:self.handle.num_tokens].to(self.inputs.combine.dtype) \
            if self.needs.combine else None
        return self.grad_x, self.grads.finish(), combine
