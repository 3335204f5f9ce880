"""The autograd Function behind :func:`mc2.fused_expert`: runs a planned call, forward and
backward, through the micro-batch pipeline.

The whole pipeline is a single ``torch.autograd.Function`` on purpose: autograd would run
per-primitive backward functions one after another, serialising the backward's communication.
Owning the backward lets it be pipelined like the forward (the output gradients travel the
dispatch routes, the input gradients come back the combine routes, micro-batch by micro-batch).

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

from dataclasses import dataclass, replace
from typing import Any, Callable, Generator, Iterator

import torch
from torch import Tensor

from mc2.observation.timeline import Timeline, maybe_span
from mc2.device.clock import Interval, clock_for
from mc2.engine.transport.deadline import deadline
from mc2.engine.compute.experts import (
    ExpertActivations,
    ExpertWeights,
    WeightGradInputs,
    WeightGrads,
    swiglu_backward_input,
    swiglu_forward,
)
from mc2.engine.passes.pipeline import PipelineSteps, run_pipeline, start_pass
from mc2.engine.decide.routing import DispatchHandle, MicroBatchRoute
from mc2.engine.transport.wire import NONE, WireFormat
from mc2.engine.transport.workspace import Workspace


@dataclass(frozen=True)
class CallPlan:
    """Everything decided before any row moves; shared by the forward and backward of one call.

    Attributes:
        handle: the routes of every micro-batch.
        group: the expert-parallel group.
        overlap: asynchronous (pipelined) or synchronous collectives.
        strategy: the expert GEMM strategy (``"loop"`` or ``"grouped"``).
        keep_activations: whether a backward will follow (save what it needs).
        timeline: where spans go, or ``None``.
        workspace: where large buffers come from.
        on_pass_done: ``(phase, interval)`` called after each pass, for ``"auto"``'s trials
            (an :class:`~mc2.device.clock.Interval`, read only when the planner decides).
        wire: ``(dispatch, combine)`` formats of each pass's two exchanges (:mod:`mc2.engine.transport.wire`).
            The backward's exchanges use the same pair, and treat the rounding as the identity
            (straight-through): the gradient of a quantised transfer is taken to be 1.
    """

    handle: DispatchHandle
    group: Any
    overlap: bool
    strategy: str
    keep_activations: bool
    timeline: Timeline | None
    workspace: Workspace
    on_pass_done: Callable[[str, Interval], None] | None = None
    wire: tuple[WireFormat, WireFormat] = (NONE, NONE)
    timeout: float | None = None  # seconds per wait (mc2.engine.transport.deadline); the backward uses it too
    # selective activation checkpointing (mc2.engine.autograd.recompute): a recorded forward to hand back
    # instead of running one, or where to record this forward
    replay: "ForwardResult | None" = None
    record: Callable[["ForwardResult"], None] | None = None


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


def _shared_weights(s_up: Tensor | None, s_gate: Tensor | None, s_down: Tensor | None
                    ) -> ExpertWeights | None:
    return None if s_up is None else ExpertWeights.split_of(s_up, s_gate, s_down)


@dataclass
class _Forward:
    """What the forward pass of one call produced."""

    expert_out: Tensor  # [T * topk, H] each (token, slot)'s expert output
    activations: list[ExpertActivations | None]  # per micro-batch, for the backward
    shared_out: Tensor | None = None
    shared_activations: ExpertActivations | None = None


def _stages(call: CallPlan, steps: PipelineSteps, phase: str) -> Iterator[str]:
    """The pass's schedule, stopping before each wait when overlapped (see
    :func:`~mc2.engine.passes.pipeline.start_pass`); the serial schedule runs through."""
    if not call.overlap:
        run_pipeline(call.handle, steps, overlap=False, phase=phase, timeline=call.timeline,
                     wire=call.wire, workspace=call.workspace)
        return
    yield from start_pass(call.handle, steps, phase=phase, timeline=call.timeline,
                          wire=call.wire, workspace=call.workspace)


def finished(stages: Generator[str, None, Any], at_stop: Callable[[], None] | None = None
             ) -> Any:
    """Run a pass's stages to the end; its result. ``at_stop``: run at each stop (before a
    wait, with the transfers issued)."""
    while True:
        try:
            next(stages)
        except StopIteration as stop:
            return stop.value
        if at_stop is not None:
            at_stop()


def _forward_pass(x: Tensor, weights: ExpertWeights, shared: ExpertWeights | None,
                  call: CallPlan) -> _Forward:
    return finished(forward_stages(x, weights, shared, call))


def forward_stages(x: Tensor, weights: ExpertWeights, shared: ExpertWeights | None,
                   call: CallPlan) -> Generator[str, None, _Forward]:
    """Dispatch, experts and combine of every micro-batch (and the shared experts under the
    first dispatch), stopping before each wait; returns what the pass produced."""
    ws, routes = call.workspace, call.handle.micro_batches
    tokens, topk, hidden = call.handle.num_tokens, call.handle.topk, x.shape[-1]
    result = _Forward(ws.empty((tokens * topk, hidden), x.dtype, x.device), [None] * len(routes))

    def shared_experts() -> None:
        assert shared is not None
        result.shared_out, result.shared_activations = swiglu_forward(
            x, [tokens], shared, strategy=call.strategy, keep_activations=call.keep_activations,
            workspace=ws)

    def compute(i: int, received: Tensor) -> Tensor:
        route = routes[i]
        y, result.activations[i] = swiglu_forward(
            _to_expert_order(ws, route, received), route.expert_counts, weights,
            strategy=call.strategy, keep_activations=call.keep_activations, workspace=ws,
            offsets=route.expert_offsets)
        return _to_receive_order(ws, route, y)

    yield from _stages(call, PipelineSteps(
        gather=lambda i: _gather(ws, x, routes[i].token_index),
        compute=compute,
        scatter=lambda i, rows: result.expert_out.index_copy_(0, routes[i].pair_order, rows),
        local=shared_experts if shared is not None else None,
    ), "forward")
    return result


def _weighted_sum(forward: _Forward, routing_weights: Tensor, call: CallPlan, like: Tensor,
                  shape: torch.Size, shared_scale: Tensor | None) -> Tensor:
    """Each token's top-k expert outputs weighted, plus the shared experts (times their
    ``[T, 1]`` scale, if any), in ``shape`` (the caller's ``[..., H]``: written in place, so the
    output is no view, which FSDP2 and in-place edits of the output would have to treat with
    care)."""
    tokens, topk, hidden = call.handle.num_tokens, call.handle.topk, like.shape[-1]
    with maybe_span(call.timeline, "compute", "weighted_sum", "forward"):
        out = call.workspace.empty(tuple(shape), like.dtype, like.device)
        torch.bmm(routing_weights.view(tokens, 1, topk),
                  forward.expert_out.view(tokens, topk, hidden), out=out.view(tokens, 1, hidden))
        if forward.shared_out is not None and shared_scale is not None:
            out.view(tokens, hidden).addcmul_(shared_scale, forward.shared_out)
        elif forward.shared_out is not None:
            out.view(tokens, hidden).add_(forward.shared_out)
    return out


def _backward_pass(*args: Any) -> tuple[Tensor, tuple[Tensor | None, ...],
                                         tuple[Tensor | None, ...]]:
    return finished(backward_stages(*args))


def backward_stages(grad_out: Tensor, routing_weights: Tensor, weights: ExpertWeights,
                   shared: ExpertWeights | None, activations: list[Any],
                   shared_activations: ExpertActivations | None, call: CallPlan,
                   needed: tuple[bool, ...], shared_needed: tuple[bool, ...],
                   shared_scale: Tensor | None = None
                   ) -> Generator[str, None, tuple[Tensor, tuple[Tensor | None, ...],
                                                   tuple[Tensor | None, ...]]]:
    """The output gradients out along the dispatch routes, the input gradients back along the
    combine routes; the weight gradients while those travel. The shared experts see the output
    gradient times their ``[T, 1]`` scale, if any.

    Returns:
        ``(grad_x, expert grads in the layout's order, shared grads (up, gate, down))``.
    """
    ws, routes = call.workspace, call.handle.micro_batches
    tokens, hidden = call.handle.num_tokens, grad_out.shape[-1]
    flat_weights = routing_weights.reshape(-1)
    grad_x = ws.empty((tokens, hidden), grad_out.dtype, grad_out.device).zero_()
    grads = WeightGrads(weights, needed, ws)
    shared_grads = WeightGrads(shared, shared_needed, ws) if shared is not None else None
    pending: list[WeightGradInputs | None] = [None] * len(routes)

    def gather(i: int) -> Tensor:
        route = routes[i]
        scale = flat_weights.index_select(0, route.pair_order).unsqueeze(1)
        return _gather(ws, grad_out, route.token_index).mul_(scale)

    def compute(i: int, received: Tensor) -> Tensor:
        route = routes[i]
        grad_in, pending[i] = swiglu_backward_input(
            _to_expert_order(ws, route, received), activations[i], route.expert_counts,
            weights, strategy=call.strategy, workspace=ws, offsets=route.expert_offsets)
        activations[i] = None  # free as we go
        return _to_receive_order(ws, route, grad_in)

    def weight_grads(i: int) -> None:
        grads.add(pending[i], strategy=call.strategy)
        pending[i] = None

    def shared_experts() -> None:
        if shared_activations is None or shared_grads is None:
            return
        grad_y = grad_out
        if shared_scale is not None:
            grad_y = torch.mul(grad_out, shared_scale,
                               out=ws.empty((tokens, hidden), grad_out.dtype, grad_out.device))
        grad_in, work = swiglu_backward_input(grad_y, shared_activations, [tokens], shared,
                                              strategy=call.strategy, workspace=ws)
        grad_x.add_(grad_in)
        shared_grads.add(work, strategy=call.strategy)

    yield from _stages(call, PipelineSteps(
        gather=gather,
        compute=compute,
        scatter=lambda i, rows: grad_x.index_add_(0, routes[i].token_index, rows),
        deferred=weight_grads,
        local=shared_experts if shared is not None else None,
    ), "backward")
    shared_out = shared_grads.finish() if shared_grads is not None else (None, None, None)
    return grad_x, grads.finish(), shared_out


def _saved_activations(forward: _Forward) -> tuple[tuple[list[bool], bool], list[Tensor]]:
    """The forward's activations as a flat tensor list, and where each micro-batch's are."""
    per_micro = [a is not None for a in forward.activations]
    tensors = [t for a in forward.activations if a is not None for t in (a.x, a.gate_up)]
    shared = forward.shared_activations
    if shared is not None:
        tensors += [shared.x, shared.gate_up]
    return (per_micro, shared is not None), tensors


def _activations_back(layout: tuple[list[bool], bool], tensors: list[Tensor]
                      ) -> tuple[list[ExpertActivations | None], ExpertActivations | None]:
    """:func:`_saved_activations` undone."""
    per_micro, has_shared = layout
    pairs = iter(zip(tensors[0::2], tensors[1::2]))
    activations = [ExpertActivations(*next(pairs)) if kept else None for kept in per_micro]
    shared = ExpertActivations(*next(pairs)) if has_shared else None
    return activations, shared


@dataclass
class ForwardResult:
    """What one forward leaves for its backward.

    Attributes:
        out: the output.
        saved: the tensors the backward reads, in :func:`run_backward`'s order (``None`` where
            not needed); they go through ``save_for_backward`` (saved-tensor hooks see them).
        call: the plan (routes, groups); host data only.
        x_shape: the input's shape.
        num_experts_tensors: 2 (packed) or 3 (split).
        activation_layout: where each micro-batch's activations are in ``saved``.
    """

    out: Tensor | None
    saved: list[Tensor | None]
    call: CallPlan
    x_shape: torch.Size
    num_experts_tensors: int
    activation_layout: tuple[list[bool], bool]


def run_forward(x: Tensor, routing_weights: Tensor, call: CallPlan, shared: tuple,
                experts: tuple[Tensor, ...], needs_input_grad: tuple[bool, ...]
                ) -> ForwardResult:
    """The forward of one planned call (inputs as :class:`FusedExpertFunction` takes them)."""
    if call.replay is not None:  # a recompute that keeps the recorded rows: no row moves
        return call.replay
    s_up, s_gate, s_down, s_scale = shared
    clock = clock_for(x.device) if call.on_pass_done is not None else None
    started = clock.stamp() if clock is not None else None
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    forward = _forward_pass(flat, ExpertWeights.in_order(experts),
                            _shared_weights(s_up, s_gate, s_down), call)
    out = _weighted_sum(forward, routing_weights, call, flat, shape, s_scale)
    layout, activations = _saved_activations(forward)
    saved = [routing_weights, forward.expert_out if needs_input_grad[1] else None,
             forward.shared_out if needs_input_grad[6] else None,
             s_up, s_gate, s_down, s_scale, *experts, *activations]
    result = ForwardResult(out, saved, call, shape, len(experts), layout)
    if not call.keep_activations:
        call.workspace.tick()
    if clock is not None and call.on_pass_done is not None:
        call.on_pass_done("forward", Interval(clock, started, clock.stamp()))
    if call.record is not None:
        call.record(result)
    return result


def run_backward(result: ForwardResult, saved: list[Tensor | None], grad_out: Tensor,
                 needed: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """The gradients of one call, in :class:`FusedExpertFunction`'s input order.

    ``saved``: ``result.saved`` as the backward sees it (through saved-tensor hooks).
    """
    # autograd runs this outside the call's context: its deadline, and no autocast (the
    # forward ran in one dtype; its GEMMs write into buffers of that dtype)
    with deadline(result.call.timeout), torch.autocast(grad_out.device.type, enabled=False):
        return _backward(result, saved, grad_out, needed)


def _backward(result: ForwardResult, saved: list[Tensor | None], grad_out: Tensor,
              needed: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    call = result.call
    clock = clock_for(grad_out.device) if call.on_pass_done is not None else None
    started = clock.stamp() if clock is not None else None
    routing_weights, expert_out, shared_out, s_up, s_gate, s_down, s_scale, *rest = saved
    experts, kept = rest[:result.num_experts_tensors], rest[result.num_experts_tensors:]
    activations, shared_activations = _activations_back(result.activation_layout, kept)
    grad_out = grad_out.contiguous().view(-1, grad_out.shape[-1])
    grad_weights, grad_scale = combine_grads(call, grad_out, expert_out, shared_out,
                                             needed[1], needed[6])
    grad_x, expert_grads, shared_grads = _backward_pass(
        grad_out, routing_weights, ExpertWeights.in_order(tuple(experts)),
        _shared_weights(s_up, s_gate, s_down), activations, shared_activations,
        call, tuple(needed[7:]), tuple(needed[3:6]), s_scale)
    call.workspace.tick()
    if clock is not None and call.on_pass_done is not None:
        call.on_pass_done("backward", Interval(clock, started, clock.stamp()))
    return (grad_x.view(result.x_shape), grad_weights, None, *shared_grads, grad_scale,
            *expert_grads)


def combine_grads(call: CallPlan, grad_out: Tensor, expert_out: Tensor | None,
                  shared_out: Tensor | None, want_weights: bool, want_scale: bool
                  ) -> tuple[Tensor | None, Tensor | None]:
    """The gradients of the weighted sum's two local inputs, from ``grad_out [T, H]``: the
    routing weights ``[T, topk]`` (each slot's expert output dotted with it) and the shared
    experts' scale ``[T, 1]`` (the shared output dotted with it); ``None`` where not wanted."""
    tokens, topk, hidden = call.handle.num_tokens, call.handle.topk, grad_out.shape[-1]
    grad_weights = grad_scale = None
    if want_weights:
        grad_weights = torch.bmm(expert_out.view(tokens, topk, hidden),
                                 grad_out.view(tokens, hidden, 1)).view(tokens, topk)
    if want_scale:
        grad_scale = torch.bmm(grad_out.view(tokens, 1, hidden),
                               shared_out.view(tokens, hidden, 1)).view(tokens, 1)
    return grad_weights, grad_scale


class FusedExpertFunction(torch.autograd.Function):
    """``apply(x, routing_weights, plan, shared_up, shared_gate, shared_down, shared_scale,
    *experts)``.

    ``experts`` in the layout's order (:data:`~mc2.engine.compute.experts.PACKED_ORDER` or
    :data:`~mc2.engine.compute.experts.SPLIT_ORDER`); the shared experts (or ``None``) in the split
    order; ``shared_scale`` ``[T, 1]`` (or ``None``: 1) multiplies their output per token.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        routing_weights: Tensor,
        call: CallPlan,
        s_up: Tensor | None,
        s_gate: Tensor | None,
        s_down: Tensor | None,
        s_scale: Tensor | None,
        *experts: Tensor,
    ) -> Tensor:
        result = run_forward(x, routing_weights, call, (s_up, s_gate, s_down, s_scale), experts,
                             ctx.needs_input_grad)
        # Through save_for_backward, not ctx attributes: saved-tensor hooks (activation offload,
        # non-reentrant checkpointing) see every activation the backward needs.
        ctx.save_for_backward(*result.saved)
        ctx.result = replace(result, out=None, saved=[])  # the output is not the ctx's to keep
        return result.out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if getattr(ctx, "consumed", False):
            raise RuntimeError("mc2.fused_expert: its backward consumes the saved activations and "
                               "runs once per forward; a second backward through the same graph "
                               "(retain_graph=True) is not supported")
        ctx.consumed = True
        return run_backward(ctx.result, list(ctx.saved_tensors), grad_out, ctx.needs_input_grad)
