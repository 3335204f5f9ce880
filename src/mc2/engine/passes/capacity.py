"""The passes of a capacity call (:mod:`mc2.engine.decide.capacity`): no host read, fixed sizes.

Per micro-batch, forward: this rank's slab rows (``x`` of each slot's token, with the slot
tables packed into the same bytes) out; the received rows' experts; one row back per received
row; the sender adds the rows of each token. Backward: the output gradient of each slot's token
out; the experts' backward; the rows' gradient back with each row's weight gradients packed
beside it. Two collectives per micro-batch and pass, and nothing else.

The experts run one of two ways, neither reading a count:

- **grouped** (mc2's SwiGLU where ``grouped_mm`` serves the dtype: float32 and bfloat16): the
  received (row, slot) pairs sorted by local expert into fixed ``R * k`` buffers, the empty
  slots last, ``grouped_mm`` offsets on the device (:class:`SortedPairs`), the hand-written
  backward; every expert's weight gradient is written (an untouched expert's is zero);
- **dense** (other dtypes, experts modules): every received row through every local expert,
  weighted by its table and summed (:func:`dense_experts`), and autograd over that graph
  (``torch.autograd.grad``) for the rows, the parameters and the tables' weights.

The schedule is the pipeline's (:mod:`mc2.engine.passes.pipeline`): the same overlap of the
next micro-batch's dispatch and the previous one's combine with this one's experts.

These are the stages of the one pass body (:func:`mc2.engine.passes.run.forward_stages` and
``backward_stages`` hand a capacity call's steps here), so every adapter runs them: the eager
Function, the custom ops and the staged calls of batch overlap alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator

import torch
from torch import Tensor

from mc2.engine.compute.experts import (
    ExpertActivations, ExpertWeights, WeightGrads, swiglu_backward_input, swiglu_forward
)
from mc2.engine.compute.module_experts import ModuleExperts, ModuleGrads
from mc2.engine.decide.capacity import HEADER, CapacityHandle, grouped_path, record_errors
from mc2.engine.decide.dedup import slot_ids
from mc2.engine.decide.overflow import check_at_once, raises_at_once
from mc2.engine.decide.routing import count_on_device
from mc2.engine.passes.pass_output import PassOutput
from mc2.engine.passes.pipeline import PipelineSteps, pass_stages
from mc2.engine.transport.row_sums import accumulation_dtype, sum_rows
from mc2.engine.transport.slabs import pack, unpack


@dataclass
class CapacityActivations:
    """One micro-batch's recorded experts: the leaves and the output of its graph."""

    rows: Tensor
    table: Tensor  # [R, L] each row's weight per local expert
    leaves: tuple[Tensor, ...]
    out: Tensor
    local_ids: Tensor  # [R, k] each slot's local expert (-1: elsewhere)


def _weight_table(tables: Tensor, local_experts: int, topk: int) -> tuple[Tensor, Tensor]:
    """``([R, L] weights, [R, k] local ids)`` from received slot tables."""
    ids = slot_ids(tables, topk)
    weights = tables[:, topk:2 * topk]
    table = torch.zeros(tables.shape[0], local_experts + 1, dtype=torch.float64,
                        device=tables.device)
    table.scatter_add_(1, torch.where(ids >= 0, ids, local_experts), weights)  # repeats add
    return table[:, :local_experts], ids


def dense_experts(rows: Tensor, table: Tensor, experts: ExpertWeights | ModuleExperts,
                  params: tuple[Tensor, ...]) -> Tensor:
    """``sum_e table[:, e] * expert_e(rows)`` over this rank's experts, every row through
    every expert: no per-expert count is needed, so nothing is read to the host."""
    local = table.shape[1]
    if isinstance(experts, ModuleExperts):
        ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
        out = torch.zeros_like(rows)
        for e in range(local):
            ids = torch.full((rows.shape[0], 1), e, dtype=torch.int64, device=rows.device)
            out = out + table[:, e:e + 1] * experts._call(rows, ids, ones, params,
                                                          experts.only(e, rows.shape[0]))
        return out
    w = ExpertWeights.in_order(params)
    many = rows.unsqueeze(0).expand(local, *rows.shape)
    ffn = w.ffn
    if w.packed:
        gate_up = torch.bmm(many, w.gate_up.transpose(1, 2))
        gate, up = gate_up[..., :ffn], gate_up[..., ffn:]
        down = w.down.transpose(1, 2)
    else:
        gate, up, down = torch.bmm(many, w.gate), torch.bmm(many, w.up), w.down
    y = torch.bmm(torch.nn.functional.silu(gate) * up, down)  # [L, R, H]
    return (y * table.t().unsqueeze(-1)).sum(0)


@dataclass
class GroupedActivations:
    """One micro-batch of the grouped path: pairs in expert order over fixed-size buffers."""

    pairs: "SortedPairs"
    saved: ExpertActivations | None
    y: Tensor | None  # [R*k, H] each pair's expert output (for the weights' gradient)


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


def capacity_forward_stages(x: Tensor, experts: ExpertWeights | ModuleExperts,
                            shared: ExpertWeights | None, call: Any, needs: Any
                            ) -> Generator[str, None, Any]:
    """The forward of a planned capacity call, ``x [T, H]``, as the pass's stages
    (:func:`mc2.engine.passes.run.forward_stages`): stops before each wait where overlapped;
    returns a :class:`~mc2.engine.passes.pass_output.PassOutput` whose ``summed`` is the weighted
    ``[T, H]`` sum of the routed experts."""
    handle: CapacityHandle = call.handle
    tokens, hidden, k = handle.num_tokens, x.shape[-1], handle.topk
    padded = torch.cat([x, x.new_zeros((1, hidden))])
    acc = accumulation_dtype(x.dtype)
    summed = torch.zeros(tokens + 1, hidden, dtype=acc, device=x.device)
    result = PassOutput(None, [None] * handle.num_micro_batches)
    keep = call.keep_activations
    params = experts.tensors()
    wants = tuple(needs.experts) + (True,) * (len(params) - len(needs.experts))
    width = 2 * k + HEADER

    def gather(i: int) -> Tensor:
        route = handle.micro_batches[i]
        return pack(padded.index_select(0, route.slot_token), route.tables)

    grouped = grouped_path(experts)

    def compute(i: int, received: Tensor) -> Tensor:
        rows, tables = unpack(received, hidden, x.dtype, width)
        if i == 0:
            record_errors(tables, handle)
        if grouped:
            pairs = SortedPairs.of(tables, handle.local_experts, k, x.dtype)
            y, saved = swiglu_forward(rows.index_select(0, pairs.rows), [], experts,
                                      strategy="grouped", keep_activations=keep,
                                      workspace=call.workspace, offsets=pairs.offsets)
            if keep:
                result.activations[i] = GroupedActivations(
                    pairs, saved, y if needs.combine else None)  # y: a fresh tensor
            return pairs.reduce(y, rows.shape[0], weighted=True)
        table, ids = _weight_table(tables, handle.local_experts, k)
        table = table.to(x.dtype)
        if not keep:
            with torch.no_grad():
                return dense_experts(rows, table, experts, params)
        leaf_rows = rows.requires_grad_(True)
        leaf_table = table.requires_grad_(bool(needs.combine))
        leaves = tuple(p.detach().requires_grad_(w) for p, w in zip(params, wants))
        with torch.enable_grad():
            out = dense_experts(leaf_rows, leaf_table, experts, leaves)
        result.activations[i] = CapacityActivations(leaf_rows, leaf_table, leaves, out, ids)
        return out.detach()

    def scatter(i: int, returned: Tensor) -> None:
        summed.index_add_(0, handle.micro_batches[i].slot_token, returned.to(acc))

    def shared_experts() -> None:
        assert shared is not None
        result.shared_out, result.shared_activations = swiglu_forward(
            x, [tokens], shared, strategy="loop", keep_activations=keep)

    yield from pass_stages(call, PipelineSteps(
        gather=gather, compute=compute, scatter=scatter,
        local=shared_experts if shared is not None else None), "forward", x.device)
    if raises_at_once(x.device):  # every exchange done: every rank raises here alike
        check_at_once(handle.group)
    result.summed = summed[:tokens]
    return result


def capacity_backward_stages(grad_out: Tensor, inputs: Any, state: Any, needs: Any
                             ) -> Generator[str, None, tuple[Tensor, tuple[Tensor | None, ...],
                                                             tuple[Tensor | None, ...],
                                                             Tensor | None]]:
    """The backward of a capacity call (``grad_out [T, H]``) as the pass's stages; returns
    ``(grad_x, routed expert grads, shared grads, combine weights' grad)``, as
    :func:`mc2.engine.passes.run.backward_stages` does."""
    call = state.call
    handle: CapacityHandle = call.handle
    tokens, hidden, k = handle.num_tokens, grad_out.shape[-1], handle.topk
    padded = torch.cat([grad_out, grad_out.new_zeros((1, hidden))])
    grad_x = torch.zeros(tokens + 1, hidden, dtype=grad_out.dtype, device=grad_out.device)
    grad_combine = torch.zeros(tokens + 1, k, dtype=torch.float64, device=grad_out.device)
    weights = inputs.routed_weights(call)
    grouped = grouped_path(weights)
    grads = WeightGrads(weights, tuple(needs.experts), call.workspace) if grouped else \
        ModuleGrads(tuple(inputs.experts), tuple(needs.experts))

    def compute_grouped(received: Tensor, saved: GroupedActivations) -> Tensor:
        pairs = saved.pairs
        rows = torch.where(pairs.valid, received.index_select(0, pairs.rows), 0)
        slots = torch.zeros(received.shape[0] * k, dtype=torch.float64, device=received.device)
        if saved.y is not None:  # each pair's weight's gradient, filed in the tables' places
            dots = torch.where(pairs.valid[:, 0], (saved.y * rows).sum(-1), 0)
            slots.index_copy_(0, pairs.slots, dots.to(torch.float64))
        grad_in, work = swiglu_backward_input(rows * pairs.weights.unsqueeze(1), saved.saved,
                                              [], weights, strategy="grouped",
                                              workspace=call.workspace, offsets=pairs.offsets)
        grads.add(work, strategy="grouped")
        return pack(pairs.reduce(grad_in, received.shape[0], weighted=False),
                    slots.view(-1, k))

    def compute(i: int, received: Tensor) -> Tensor:
        saved = state.activations[i]
        state.activations[i] = None
        if grouped:
            return compute_grouped(received, saved)
        wanted = [saved.rows] + ([saved.table] if saved.table.requires_grad else []) + \
            [leaf for leaf in saved.leaves if leaf.requires_grad]
        found = torch.autograd.grad(saved.out, wanted, received, allow_unused=True)
        grad_rows, rest = found[0], list(found[1:])
        slots = torch.zeros(received.shape[0], k, dtype=torch.float64, device=received.device)
        if saved.table.requires_grad:
            grad_table = rest.pop(0)
            if grad_table is not None:
                picked = grad_table.gather(1, saved.local_ids.clamp(min=0)).to(torch.float64)
                slots = torch.where(saved.local_ids >= 0, picked, 0)
        grads.add(rest, [j for j, leaf in enumerate(saved.leaves) if leaf.requires_grad])
        if grad_rows is None:
            grad_rows = torch.zeros_like(received)
        return pack(grad_rows, slots)

    def scatter(i: int, returned: Tensor) -> None:
        rows, slots = unpack(returned, hidden, grad_out.dtype, k)
        token = handle.micro_batches[i].slot_token
        grad_x.index_add_(0, token, rows)
        grad_combine.index_add_(0, token, slots)

    shared_grads = None
    shared = inputs.shared_weights()
    if shared is not None:
        shared_grads = WeightGrads(shared, inputs.shared_needs)

    def shared_experts() -> None:
        if state.shared_gate_up is None or shared_grads is None:
            return
        grad_y = grad_out if inputs.shared_scale is None else grad_out * inputs.shared_scale
        flat_x = inputs.x.reshape(-1, hidden)
        grad_in, work = swiglu_backward_input(
            grad_y, ExpertActivations(flat_x, state.shared_gate_up), [tokens], shared,
            strategy="loop")
        state.shared_gate_up = None
        grad_x[:tokens].add_(grad_in)
        shared_grads.add(work, strategy="loop")

    yield from pass_stages(call, PipelineSteps(
        gather=lambda i: padded.index_select(0, handle.micro_batches[i].slot_token),
        compute=compute, scatter=scatter,
        local=shared_experts if shared is not None else None), "backward", grad_out.device)
    expert_grads = grads.finish()
    shared_out = shared_grads.finish() if shared_grads is not None else (None, None, None)
    combine = grad_combine[:tokens].to(inputs.combine.dtype) if needs.combine else None
    return grad_x[:tokens], expert_grads, shared_out, combine
