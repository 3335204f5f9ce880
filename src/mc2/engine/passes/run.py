"""One forward and one backward pass of a planned call, over named state.

Every way a call runs (the eager autograd Function, the three staged Functions of batch
overlap, the custom op of ``torch.compile``/``torch.export``) is a thin adapter over this
module. What crosses between them is named, never positional:

* :class:`CallInputs`: the call's tensor inputs (``x``, the combine weights, the shared experts,
  their scale, the routed experts in their layout's order); also used, with booleans, for which
  inputs need a gradient, and, with gradients, for what the backward returns;
* :class:`ForwardState`: what a forward *made* and its backward reads (the expert outputs kept
  for the routing-weight gradient, each micro-batch's activations). It never holds an input,
  so an adapter may keep it anywhere: the custom op keeps it in a table while the graph holds
  the inputs, the eager Function hands its tensors to ``save_for_backward`` where a
  saved-tensor hook wants to see them.

The whole pipeline is one backward on purpose: autograd would run per-primitive backward
functions one after another, serialising the backward's communication. Owning the backward
lets it be pipelined like the forward (the output gradients travel the dispatch routes, the
input gradients come back the combine routes, micro-batch by micro-batch).

Row moves per routed row and pass (counted, each one needed):

* forward: gather into the send buffer (1), dispatch, reorder to expert order (2), back to
  receive order (3), combine, scatter into the per-(token, slot) outputs (4); the weighted top-k
  sum reads those once;
* backward: gather the scaled output gradient (1), reorder (2), back (3), scatter-add into the
  input gradient (4).

Moves 2 and 3 are skipped where arrival order already is expert order (one local expert, or one
rank). Every buffer comes from the call's :class:`~mc2.engine.transport.workspace.Workspace`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator, Generic, TypeVar

import torch
from torch import Tensor

from mc2.device.clock import Interval, clock_for
from mc2.device import streams
from mc2.engine.compute.experts import (
    ExpertActivations, ExpertWeights, WeightGradInputs, WeightGrads, swiglu_backward_input, swiglu_forward
)
from mc2.engine.compute.module_experts import ModuleExperts, ModuleGrads
from mc2.engine.decide.call_plan import CallPlan
from mc2.engine.decide.routing import MicroBatchRoute
from mc2.engine.passes.capacity import capacity_backward_stages, capacity_forward_stages
from mc2.engine.passes.pass_output import PassOutput
from mc2.engine.passes.pipeline import PipelineSteps, pass_stages
from mc2.engine.transport.deadline import deadline
from mc2.engine.transport.row_sums import accumulation_dtype, sum_rows
from mc2.engine.transport.workspace import Workspace
from mc2.observation.timeline import maybe_span

T = TypeVar("T")


@dataclass
class CallInputs(Generic[T]):
    """The call's inputs by name: tensors, or one flag (or gradient) per tensor.

    Attributes:
        x: ``[..., H]`` the tokens.
        combine: ``[T, topk]`` the combine (routing) weights.
        shared_up, shared_gate: ``[1, H, S * Fs]`` the shared experts as one expert, or ``None``.
        shared_down: ``[1, S * Fs, H]``, or ``None``.
        shared_scale: ``[T, 1]`` a per-token factor on the shared output, or ``None`` (1).
        experts: the routed experts in their layout's order
            (:data:`~mc2.engine.compute.experts.PACKED_ORDER` or ``SPLIT_ORDER``).
    """

    x: T
    combine: T
    shared_up: T
    shared_gate: T
    shared_down: T
    shared_scale: T
    experts: tuple[T, ...]

    def as_list(self) -> list[T]:
        """The inputs in the adapters' argument order (as the fields, experts last)."""
        return [self.x, self.combine, self.shared_up, self.shared_gate, self.shared_down,
                self.shared_scale, *self.experts]

    @classmethod
    def of(cls, values: Any) -> "CallInputs[T]":
        """:meth:`as_list` undone."""
        x, combine, up, gate, down, scale, *experts = values
        return cls(x, combine, up, gate, down, scale, tuple(experts))

    def shared_weights(self) -> ExpertWeights | None:
        if self.shared_up is None:
            return None
        return ExpertWeights.split_of(self.shared_up, self.shared_gate, self.shared_down)

    def routed_weights(self, call: CallPlan | None = None) -> ExpertWeights | ModuleExperts:
        """The routed experts: a module's (:attr:`CallPlan.module`) or mc2's SwiGLU."""
        if call is not None and call.module is not None:
            return call.module.bound(tuple(self.experts))
        return ExpertWeights.in_order(tuple(self.experts))

    @property
    def shared_needs(self) -> tuple[Any, Any, Any]:
        return self.shared_up, self.shared_gate, self.shared_down


@dataclass
class ForwardState:
    """What one forward made for its backward (never an input of the call).

    Attributes:
        call: the plan (routes, groups); host data only.
        x_shape: the input's shape, for the input gradient.
        activations: per micro-batch, the rows in expert order and their gate/up projections
            (``None`` once the backward used them, or when no backward follows).
        shared_gate_up: ``[T, 2 * S * Fs]`` the shared experts' projections (their input is
            ``x``, which the adapter brings back).
        expert_out: ``[T * topk, H]`` each (token, slot)'s expert output, kept where the
            combine weights need a gradient.
        shared_out: ``[T, H]`` the shared experts' output, kept where their scale needs one.
        pair_out: rows once per destination: per micro-batch, this rank's expert outputs in
            expert order (``[P_i, H]``), kept where the combine weights need a gradient (it is
            computed here, where they are: :mod:`~mc2.engine.decide.dedup`).
    """

    call: CallPlan
    x_shape: torch.Size
    activations: list[Any]
    shared_gate_up: Tensor | None = None
    expert_out: Tensor | None = None
    shared_out: Tensor | None = None
    pair_out: list[Tensor | None] | None = None

    def tensors(self) -> list[Tensor | None]:
        """Every tensor of the state (for ``save_for_backward``), in :meth:`with_tensors`'
        order. A module stage's activations are its own autograd graph: they stay as they
        are (:mod:`~mc2.engine.compute.module_experts`)."""
        rows = [t for a in self.activations if isinstance(a, ExpertActivations)
                for t in (a.x, a.gate_up)]
        return [self.shared_gate_up, self.expert_out, self.shared_out, *(self.pair_out or ()),
                *rows]

    def with_tensors(self, tensors: list[Tensor | None]) -> "ForwardState":
        """The state with :meth:`tensors` replaced (as a saved-tensor hook hands them back)."""
        shared_gate_up, expert_out, shared_out, *rest = tensors
        n = len(self.pair_out or ())
        pair_out, rows = (rest[:n] if self.pair_out is not None else None), rest[n:]
        pairs = iter(zip(rows[0::2], rows[1::2]))
        activations = [ExpertActivations(*next(pairs)) if isinstance(a, ExpertActivations)
                       else a for a in self.activations]
        return ForwardState(self.call, self.x_shape, activations, shared_gate_up, expert_out,
                            shared_out, pair_out)


def _expert_rows(ws: Workspace, route: MicroBatchRoute, received: Tensor) -> Tensor:
    """The received rows in expert order: reordered, or (once per destination) expanded."""
    if route.slots is not None:
        return _gather(ws, received, route.slots.rows)
    return _to_expert_order(ws, route, received)


def _rows_back(ws: Workspace, route: MicroBatchRoute, rows: Tensor, weighted: bool) -> Tensor:
    """Expert-order rows as they go back: in receive order, or (once per destination) summed
    per received row, times each pair's weight where ``weighted``."""
    slots = route.slots
    if slots is None:
        return _to_receive_order(ws, route, rows)
    return sum_rows(rows, slots.rows, slots.received, scale=slots.weights if weighted else None)


def _to_expert_order(ws: Workspace, route: MicroBatchRoute, received: Tensor) -> Tensor:
    if route.expert_gather is None:
        return received
    out = ws.empty(tuple(received.shape), received.dtype, received.device)
    return torch.index_select(received, 0, route.expert_gather, out=out)


def _to_receive_order(ws: Workspace, route: MicroBatchRoute, rows: Tensor) -> Tensor:
    if route.expert_gather is None:
        return rows
    out = ws.empty(tuple(rows.shape), rows.dtype, rows.device)
    return out.index_copy_(0, route.expert_gather, rows)


def _gather(ws: Workspace, source: Tensor, index: Tensor) -> Tensor:
    out = ws.empty((index.shape[0], source.shape[-1]), source.dtype, source.device)
    return torch.index_select(source, 0, index, out=out)


def advance(stages: Generator[str, None, Any]) -> tuple[str | None, Any]:
    """Run a pass's stages to the next stop: ``(its name, None)``, or ``(None, the pass's
    result)`` at the end."""
    try:
        return next(stages), None
    except StopIteration as stop:
        return None, stop.value


def finished(stages: Generator[str, None, Any]) -> Any:
    """Run a pass's stages to the end; its result."""
    while (step := advance(stages))[0] is not None:
        pass
    return step[1]


def forward_stages(x: Tensor, weights: ExpertWeights | ModuleExperts,
                   shared: ExpertWeights | None, call: CallPlan,
                   needs: CallInputs[bool]) -> Generator[str, None, PassOutput]:
    """Dispatch, experts and combine of every micro-batch (and the shared experts under the
    first dispatch), stopping before each wait; returns what the pass produced. ``needs``:
    which inputs need a gradient (a module stage records only the experts' that do; a
    capacity call keeps its experts' outputs where the combine weights do)."""
    if call.capacity:  # rows in fixed slabs: their own steps
        return (yield from capacity_forward_stages(x, weights, shared, call, needs))
    ws, routes = call.workspace, call.handle.micro_batches
    tokens, topk, hidden = call.handle.num_tokens, call.handle.topk, x.shape[-1]
    once = call.handle.once_per_destination
    result = PassOutput(None if once else ws.empty((tokens * topk, hidden), x.dtype, x.device),
                        [None] * len(routes))
    if once:
        result.summed = torch.zeros((tokens, hidden), dtype=accumulation_dtype(x.dtype),
                                    device=x.device)
        result.pair_out = [None] * len(routes)

    def shared_experts() -> None:
        assert shared is not None
        result.shared_out, result.shared_activations = swiglu_forward(
            x, [tokens], shared, strategy=call.strategy, keep_activations=call.keep_activations,
            workspace=ws)

    def compute(i: int, received: Tensor) -> Tensor:
        route = routes[i]
        rows = _expert_rows(ws, route, received)
        if isinstance(weights, ModuleExperts):
            y, result.activations[i] = weights.run(rows, route.expert_offsets,
                                                   keep=call.keep_activations,
                                                   needs=tuple(needs.experts),
                                                   counts=route.expert_counts)
        else:
            y, result.activations[i] = swiglu_forward(
                rows, route.expert_counts, weights, strategy=call.strategy,
                keep_activations=call.keep_activations, workspace=ws,
                offsets=route.expert_offsets)
        if result.pair_out is not None and call.keep_activations:
            result.pair_out[i] = y.detach()
        return _rows_back(ws, route, y, weighted=True)

    def scatter(i: int, rows: Tensor) -> None:
        if result.summed is not None:
            result.summed.index_add_(0, routes[i].token_index, rows.to(result.summed.dtype))
        else:
            result.expert_out.index_copy_(0, routes[i].pair_order, rows)

    yield from pass_stages(call, PipelineSteps(
        gather=lambda i: _gather(ws, x, routes[i].token_index),
        compute=compute,
        scatter=scatter,
        local=shared_experts if shared is not None else None,
    ), "forward", x.device)
    return result


def weighted_sum(forward: PassOutput, combine: Tensor, call: CallPlan, like: Tensor,
                 shape: torch.Size, shared_scale: Tensor | None) -> Tensor:
    """Each token's top-k expert outputs weighted, plus the shared experts (times their
    ``[T, 1]`` scale, if any), in ``shape`` (the caller's ``[..., H]``: written in place, so the
    output is no view, which FSDP2 and in-place edits of the output would have to treat with
    care)."""
    tokens, topk, hidden = call.handle.num_tokens, call.handle.topk, like.shape[-1]
    with maybe_span(call.timeline, "compute", "weighted_sum", "forward"):
        out = call.workspace.empty(tuple(shape), like.dtype, like.device)
        if forward.summed is not None:  # weighted where the experts are (dedup)
            out.view(tokens, hidden).copy_(forward.summed)
        else:
            torch.bmm(combine.view(tokens, 1, topk), forward.expert_out.view(tokens, topk, hidden),
                      out=out.view(tokens, 1, hidden))
        if forward.shared_out is not None and shared_scale is not None:
            out.view(tokens, hidden).addcmul_(shared_scale, forward.shared_out)
        elif forward.shared_out is not None:
            out.view(tokens, hidden).add_(forward.shared_out)
    return out


def backward_stages(grad_out: Tensor, inputs: CallInputs[Tensor], state: ForwardState,
                    needs: CallInputs[bool]
                    ) -> Generator[str, None, tuple[Tensor, tuple[Tensor | None, ...],
                                                    tuple[Tensor | None, ...], Tensor | None]]:
    """The output gradients out along the dispatch routes, the input gradients back along the
    combine routes; the weight gradients while those travel. The shared experts see the output
    gradient times their ``[T, 1]`` scale, if any. Each micro-batch's activations are dropped
    from ``state`` once used (freed as the pass goes, where nothing else holds them).

    Returns:
        ``(grad_x [T, H], routed expert grads in the layout's order, shared grads (up, gate,
        down), the combine weights' ``[T, topk]`` gradient)``; the last is computed here only
        where rows travel once per destination (else ``None``: :func:`combine_grads`).
    """
    call = state.call
    if call.capacity:  # rows in fixed slabs: their own steps
        return (yield from capacity_backward_stages(grad_out, inputs, state, needs))
    ws, routes = call.workspace, call.handle.micro_batches
    tokens, hidden = call.handle.num_tokens, grad_out.shape[-1]
    weights, shared = inputs.routed_weights(call), inputs.shared_weights()
    flat_x = inputs.x.reshape(-1, hidden)
    flat_weights = inputs.combine.reshape(-1)
    grad_x = ws.empty((tokens, hidden), grad_out.dtype, grad_out.device).zero_()
    grads = ModuleGrads(weights.params, tuple(needs.experts)) \
        if isinstance(weights, ModuleExperts) \
        else WeightGrads(weights, tuple(needs.experts), ws)
    shared_grads = WeightGrads(shared, needs.shared_needs, ws) if shared is not None else None
    pending: list[WeightGradInputs | None] = [None] * len(routes)
    once = call.handle.once_per_destination
    weight_tables: list[Tensor] = []  # once per destination: [r_i, topk] weights' gradients

    def gather(i: int) -> Tensor:
        route = routes[i]
        rows = _gather(ws, grad_out, route.token_index)
        if once:  # each destination scales by its own slots' weights
            return rows
        return rows.mul_(flat_weights.index_select(0, route.pair_order).unsqueeze(1))

    def weighted(i: int, received: Tensor) -> Tensor:
        """Once per destination: the output gradient of each pair, its weight's gradient
        filed in the micro-batch's slot table."""
        slots = routes[i].slots
        rows = _gather(ws, received, slots.rows)
        if needs.combine:
            acc = accumulation_dtype(rows.dtype)
            table = torch.zeros(slots.received * call.handle.topk, dtype=acc, device=rows.device)
            y = state.pair_out[i]
            table.index_copy_(0, slots.slots, (y.to(acc) * rows.to(acc)).sum(-1))
            weight_tables.append(table.view(slots.received, call.handle.topk))
            state.pair_out[i] = None
        return rows.mul_(slots.weights.unsqueeze(1))

    def compute(i: int, received: Tensor) -> Tensor:
        route = routes[i]
        rows = weighted(i, received) if once else _to_expert_order(ws, route, received)
        if isinstance(grads, ModuleGrads):  # inputs and parameters in one call
            grad_in = weights.backward(state.activations[i], rows, grads)
        else:
            grad_in, pending[i] = swiglu_backward_input(
                rows, state.activations[i], route.expert_counts, weights,
                strategy=call.strategy, workspace=ws, offsets=route.expert_offsets)
        state.activations[i] = None  # free as we go
        return _rows_back(ws, route, grad_in, weighted=False)

    def weight_grads(i: int) -> None:
        if pending[i] is not None:
            grads.add(pending[i], strategy=call.strategy)
            pending[i] = None

    def shared_experts() -> None:
        if state.shared_gate_up is None or shared_grads is None:
            return
        grad_y = grad_out
        if inputs.shared_scale is not None:
            grad_y = torch.mul(grad_out, inputs.shared_scale,
                               out=ws.empty((tokens, hidden), grad_out.dtype, grad_out.device))
        grad_in, work = swiglu_backward_input(
            grad_y, ExpertActivations(flat_x, state.shared_gate_up), [tokens], shared,
            strategy=call.strategy, workspace=ws)
        state.shared_gate_up = None
        grad_x.add_(grad_in)
        shared_grads.add(work, strategy=call.strategy)

    yield from pass_stages(call, PipelineSteps(
        gather=gather,
        compute=compute,
        scatter=lambda i, rows: grad_x.index_add_(0, routes[i].token_index, rows),
        deferred=weight_grads,
        local=shared_experts if shared is not None else None,
    ), "backward", grad_out.device)
    shared_out = shared_grads.finish() if shared_grads is not None else (None, None, None)
    grad_combine = None
    if once and needs.combine:
        with maybe_span(call.timeline, "comm", "weight_grads", "backward"):
            grad_combine = call.handle.weight_grads.send_back(weight_tables, grad_out.dtype)
    return grad_x, grads.finish(), shared_out, grad_combine


def combine_grads(state: ForwardState, grad_out: Tensor, needs: CallInputs[bool]
                  ) -> tuple[Tensor | None, Tensor | None]:
    """The gradients of the weighted sum's two local inputs, from ``grad_out [T, H]``: the
    combine weights ``[T, topk]`` (each slot's expert output dotted with it) and the shared
    experts' scale ``[T, 1]`` (the shared output dotted with it); ``None`` where not wanted."""
    handle = state.call.handle
    tokens, topk, hidden = handle.num_tokens, handle.topk, grad_out.shape[-1]
    grad_weights = grad_scale = None
    computed_by_backward = state.call.capacity or handle.once_per_destination
    if needs.combine and not computed_by_backward:
        grad_weights = torch.bmm(state.expert_out.view(tokens, topk, hidden),
                                 grad_out.view(tokens, hidden, 1)).view(tokens, topk)
    if needs.shared_scale:
        grad_scale = torch.bmm(grad_out.view(tokens, 1, hidden),
                               state.shared_out.view(tokens, hidden, 1)).view(tokens, 1)
    return grad_weights, grad_scale


def state_of(output: PassOutput, call: CallPlan, shape: torch.Size, needs: CallInputs[bool]
             ) -> ForwardState:
    """The part of a forward pass's output its backward reads."""
    shared = output.shared_activations
    return ForwardState(call, shape, output.activations,
                        shared.gate_up if shared is not None else None,
                        output.expert_out if needs.combine else None,
                        output.shared_out if needs.shared_scale else None,
                        output.pair_out if needs.combine else None)


def _timed(call: CallPlan, phase: str, device: torch.device) -> Callable[[], None]:
    """Start timing a pass for ``"auto"``'s trials; the returned function reports it. Not
    inside a graph capture: its stamps would time the capture, not a replay."""
    if call.on_pass_done is None or streams.capturing(device):
        return lambda: None
    clock = clock_for(device)
    started = clock.stamp()
    report = call.on_pass_done
    return lambda: report(phase, Interval(clock, started, clock.stamp()))


def run_forward(call: CallPlan, inputs: CallInputs[Tensor], needs: CallInputs[bool]
                ) -> tuple[Tensor, ForwardState]:
    """The forward of one planned call: its output (``x``-shaped) and its state."""
    done = _timed(call, "forward", inputs.x.device)
    shape = inputs.x.shape
    flat = inputs.x.reshape(-1, shape[-1])
    output = finished(forward_stages(flat, inputs.routed_weights(call), inputs.shared_weights(),
                                     call, needs))
    out = weighted_sum(output, inputs.combine, call, flat, shape, inputs.shared_scale)
    state = state_of(output, call, shape, needs)
    if not call.keep_activations:
        call.workspace.tick()
    done()
    return out, state


def run_backward(state: ForwardState, inputs: CallInputs[Tensor], grad_out: Tensor,
                 needs: CallInputs[bool]) -> CallInputs[Tensor | None]:
    """The gradients of one call, by input (``None`` where not needed). Consumes ``state``'s
    activations."""
    call = state.call
    # autograd runs this outside the call's context: its deadline, and no autocast (the
    # forward ran in one dtype; its GEMMs write into buffers of that dtype)
    with deadline(call.timeout), torch.autocast(grad_out.device.type, enabled=False):
        done = _timed(call, "backward", grad_out.device)
        grad_out = grad_out.contiguous().view(-1, grad_out.shape[-1])
        grad_combine, grad_scale = combine_grads(state, grad_out, needs)
        grad_x, expert_grads, (s_up, s_gate, s_down), returned = finished(
            backward_stages(grad_out, inputs, state, needs))
        grad_combine = returned if returned is not None else grad_combine
        call.workspace.tick()
        done()
    return CallInputs(grad_x.view(state.x_shape), grad_combine, s_up, s_gate, s_down,
                      grad_scale, tuple(expert_grads))

