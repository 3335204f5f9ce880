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
rank). Every buffer comes from the call's :class:`~mc2.engine.workspace.Workspace`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from ..observation.timeline import Timeline, maybe_span
from .clock import Interval, clock_for
from .deadline import deadline
from .experts import (
    ExpertActivations,
    ExpertWeights,
    WeightGradInputs,
    WeightGrads,
    swiglu_backward_input,
    swiglu_forward,
)
from .pipeline import PipelineSteps, run_pipeline
from .routing import DispatchHandle, MicroBatchRoute
from .wire import NONE, WireFormat
from .workspace import Workspace


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
            (an :class:`~mc2.engine.clock.Interval`, read only when the planner decides).
        wire: ``(dispatch, combine)`` formats of each pass's two exchanges (:mod:`mc2.engine.wire`).
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
    timeout: float | None = None  # seconds per wait (mc2.engine.deadline); the backward uses it too


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


class FusedExpertFunction(torch.autograd.Function):
    """``apply(x2d, gate_up, gate, up, down, routing_weights, plan, s_up, s_gate, s_down)``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        gate_up: Tensor | None,
        gate: Tensor | None,
        up: Tensor | None,
        down: Tensor,
        routing_weights: Tensor,
        call: CallPlan,
        s_up: Tensor | None,
        s_gate: Tensor | None,
        s_down: Tensor | None,
    ) -> Tensor:
        clock = clock_for(x.device)
        started = clock.stamp() if call.on_pass_done is not None else None
        ws = call.workspace
        weights = ExpertWeights(down=down, gate_up=gate_up, gate=gate, up=up)
        shared_weights = _shared_weights(s_up, s_gate, s_down)
        handle, routes = call.handle, call.handle.micro_batches
        tokens, topk, hidden = handle.num_tokens, handle.topk, x.shape[-1]
        expert_out = ws.empty((tokens * topk, hidden), x.dtype, x.device)  # (token, slot) order
        activations: list[ExpertActivations | None] = [None] * len(routes)
        shared: list[Any] = [None, None]  # output, activations

        def shared_experts() -> None:
            assert shared_weights is not None
            shared[0], shared[1] = swiglu_forward(
                x, [tokens], shared_weights, strategy=call.strategy,
                keep_activations=call.keep_activations, workspace=ws)

        def compute(i: int, received: Tensor) -> Tensor:
            route = routes[i]
            y, activations[i] = swiglu_forward(
                _to_expert_order(ws, route, received), route.expert_counts, weights,
                strategy=call.strategy, keep_activations=call.keep_activations, workspace=ws,
                offsets=route.expert_offsets,
            )
            return _to_receive_order(ws, route, y)

        run_pipeline(
            handle,
            PipelineSteps(
                gather=lambda i: _gather(ws, x, routes[i].token_index),
                compute=compute,
                scatter=lambda i, rows: expert_out.index_copy_(0, routes[i].pair_order, rows),
                local=shared_experts if shared_weights is not None else None,
            ),
            overlap=call.overlap, phase="forward", timeline=call.timeline, wire=call.wire,
            workspace=ws,
        )
        with maybe_span(call.timeline, "compute", "weighted_sum", "forward"):
            out = ws.empty((tokens, 1, hidden), x.dtype, x.device)
            torch.bmm(routing_weights.view(tokens, 1, topk), expert_out.view(tokens, topk, hidden),
                      out=out)
            out = out.view(tokens, hidden)
            if shared[0] is not None:
                out.add_(shared[0])
        ctx.call = call
        ctx.activations = activations
        ctx.shared_activations = shared[1]
        ctx.save_for_backward(gate_up, gate, up, down, routing_weights,
                              expert_out if ctx.needs_input_grad[5] else None, s_up, s_gate,
                              s_down)
        if not call.keep_activations:
            ws.tick()
        if call.on_pass_done is not None:
            call.on_pass_done("forward", Interval(clock, started, clock.stamp()))
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        # autograd runs this outside the call's context: its deadline, and no autocast (the
        # forward ran in one dtype; its GEMMs write into buffers of that dtype)
        with deadline(ctx.call.timeout), torch.autocast(grad_out.device.type, enabled=False):
            return FusedExpertFunction._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        clock = clock_for(grad_out.device)
        started = clock.stamp() if ctx.call.on_pass_done is not None else None
        if getattr(ctx, "consumed", False):
            raise RuntimeError("mc2.fused_expert: its backward consumes the saved activations and "
                               "runs once per forward; a second backward through the same graph "
                               "(retain_graph=True) is not supported")
        ctx.consumed = True
        call: CallPlan = ctx.call
        ws = call.workspace
        handle, routes = call.handle, call.handle.micro_batches
        gate_up, gate, up, down, routing_weights, expert_out, s_up, s_gate, s_down = \
            ctx.saved_tensors
        weights = ExpertWeights(down=down, gate_up=gate_up, gate=gate, up=up)
        shared_weights = _shared_weights(s_up, s_gate, s_down)
        activations: list[ExpertActivations] = ctx.activations
        tokens, topk, hidden = handle.num_tokens, handle.topk, grad_out.shape[-1]
        grad_out = grad_out.contiguous()
        flat_weights = routing_weights.reshape(-1)
        needed = ctx.needs_input_grad

        grad_weights = None
        if needed[5]:
            grad_weights = torch.bmm(
                expert_out.view(tokens, topk, hidden), grad_out.view(tokens, hidden, 1)
            ).view(tokens, topk)
        grad_x = ws.empty((tokens, hidden), grad_out.dtype, grad_out.device).zero_()
        grads = WeightGrads(weights, tuple(needed[1:5]), ws)  # type: ignore[arg-type]

        def gather(i: int) -> Tensor:
            route = routes[i]
            scale = flat_weights.index_select(0, route.pair_order).unsqueeze(1)
            return _gather(ws, grad_out, route.token_index).mul_(scale)

        pending: list[WeightGradInputs | None] = [None] * len(routes)

        def compute(i: int, received: Tensor) -> Tensor:
            route = routes[i]
            grad_in, pending[i] = swiglu_backward_input(
                _to_expert_order(ws, route, received), activations[i], route.expert_counts,
                weights, strategy=call.strategy, workspace=ws, offsets=route.expert_offsets,
            )
            activations[i] = None  # type: ignore[call-overload]  # free as we go
            return _to_receive_order(ws, route, grad_in)

        def weight_grads(i: int) -> None:
            grads.add(pending[i], strategy=call.strategy)
            pending[i] = None

        shared_grads = None
        if shared_weights is not None:
            # (gate_up, gate, up, down) <- inputs s_gate 8, s_up 7, s_down 9
            shared_grads = WeightGrads(shared_weights, (False, needed[8], needed[7], needed[9]), ws)

        def shared_experts() -> None:
            if ctx.shared_activations is None or shared_grads is None:
                return
            grad_in, work = swiglu_backward_input(
                grad_out, ctx.shared_activations, [tokens], shared_weights,
                strategy=call.strategy, workspace=ws)
            grad_x.add_(grad_in)
            shared_grads.add(work, strategy=call.strategy)

        run_pipeline(
            handle,
            PipelineSteps(
                gather=gather,
                compute=compute,
                scatter=lambda i, rows: grad_x.index_add_(0, routes[i].token_index, rows),
                deferred=weight_grads,
                local=shared_experts if shared_weights is not None else None,
            ),
            overlap=call.overlap, phase="backward", timeline=call.timeline, wire=call.wire,
            workspace=ws,
        )
        g_gate_up, g_gate, g_up, g_down = grads.finish()
        s_grads: tuple[Tensor | None, ...] = (None, None, None)
        if shared_grads is not None:
            _, sg_gate, sg_up, sg_down = shared_grads.finish()
            s_grads = (sg_up, sg_gate, sg_down)
        ws.tick()
        if call.on_pass_done is not None:
            call.on_pass_done("backward", Interval(clock, started, clock.stamp()))
        return (grad_x, g_gate_up, g_gate, g_up, g_down, grad_weights, None, *s_grads)
