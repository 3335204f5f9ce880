"""``mc2.fused_expert``: dispatch All-to-All -> SwiGLU experts -> combine All-to-All, overlapped.

The whole pipeline is a single ``torch.autograd.Function`` on purpose: autograd would run
per-primitive backward functions one after another, serialising the backward's communication.
Owning the backward lets it be pipelined like the forward (the output gradients travel the
dispatch routes, the input gradients come back the combine routes, micro-batch by micro-batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import exchange_counts, gather_counts, group_size
from .env import sync_reason, warn_sync_fallback
from .experts import (
    ExpertActivations,
    GemmStrategy,
    WeightGradInputs,
    accumulate_weight_grads,
    resolve_strategy,
    swiglu_backward_input,
    swiglu_forward,
)
from .hierarchy import two_stage_pays, two_stage_plan
from .pipeline import PipelineSteps, run_pipeline
from .planner import Planner, planner_for
from .profiler import active_timeline
from .routing import DispatchHandle, MicroBatchRoute, build_handle, local_send_counts
from .timeline import Timeline, maybe_span
from .topology import topology_for
from .validation import agree, local_problem, shared_problem

MicroBatches = int | Literal["auto"]
Hierarchy = Literal["auto", "flat", "2d"]


@dataclass(frozen=True)
class _Call:
    """Non-tensor state shared by the forward and backward of one call."""

    handle: DispatchHandle
    group: Any
    overlap: bool
    strategy: str
    keep_activations: bool
    timeline: Timeline | None


def _to_expert_order(route: MicroBatchRoute, received: Tensor) -> Tensor:
    return received if route.expert_gather is None else received.index_select(0, route.expert_gather)


def _to_receive_order(route: MicroBatchRoute, rows: Tensor) -> Tensor:
    if route.expert_gather is None:
        return rows
    out = torch.empty_like(rows)
    out.index_copy_(0, route.expert_gather, rows)
    return out


class _FusedExpertFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        w_up: Tensor,
        w_gate: Tensor,
        w_down: Tensor,
        routing_weights: Tensor,
        call: _Call,
        s_up: Tensor | None,
        s_gate: Tensor | None,
        s_down: Tensor | None,
    ) -> Tensor:
        handle, routes = call.handle, call.handle.micro_batches
        tokens, topk, hidden = handle.num_tokens, handle.topk, x.shape[-1]
        expert_out = x.new_empty((tokens * topk, hidden))  # per (token, slot), original order
        activations: list[ExpertActivations | None] = [None] * len(routes)
        shared: list[Any] = [None, None]  # output, activations

        def shared_experts() -> None:
            shared[0], shared[1] = swiglu_forward(
                x, [tokens], s_up, s_gate, s_down, strategy=call.strategy,
                keep_activations=call.keep_activations)

        def compute(i: int, received: Tensor) -> Tensor:
            route = routes[i]
            y, activations[i] = swiglu_forward(
                _to_expert_order(route, received), route.expert_counts, w_up, w_gate, w_down,
                strategy=call.strategy, keep_activations=call.keep_activations,
            )
            return _to_receive_order(route, y)

        run_pipeline(
            handle,
            PipelineSteps(
                gather=lambda i: x.index_select(0, routes[i].token_index),
                compute=compute,
                scatter=lambda i, rows: expert_out.index_copy_(0, routes[i].pair_order, rows),
                local=shared_experts if s_up is not None else None,
            ),
            overlap=call.overlap, phase="forward", timeline=call.timeline,
        )
        with maybe_span(call.timeline, "compute", "weighted_sum", "forward"):
            out = torch.bmm(
                routing_weights.view(tokens, 1, topk), expert_out.view(tokens, topk, hidden)
            ).view(tokens, hidden)
            if shared[0] is not None:
                out.add_(shared[0])
        ctx.call = call
        ctx.activations = activations
        ctx.shared_activations = shared[1]
        ctx.save_for_backward(w_up, w_gate, w_down, routing_weights, expert_out, s_up, s_gate,
                              s_down)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        call: _Call = ctx.call
        handle, routes = call.handle, call.handle.micro_batches
        w_up, w_gate, w_down, routing_weights, expert_out, s_up, s_gate, s_down = ctx.saved_tensors
        activations: list[ExpertActivations] = ctx.activations
        tokens, topk, hidden = handle.num_tokens, handle.topk, grad_out.shape[-1]
        grad_out = grad_out.contiguous()
        flat_weights = routing_weights.reshape(-1)

        grad_weights = None
        if ctx.needs_input_grad[4]:
            grad_weights = torch.bmm(
                expert_out.view(tokens, topk, hidden), grad_out.view(tokens, hidden, 1)
            ).view(tokens, topk)
        grad_x = torch.zeros_like(grad_out)
        grads = (torch.zeros_like(w_up), torch.zeros_like(w_gate), torch.zeros_like(w_down))

        def gather(i: int) -> Tensor:
            route = routes[i]
            scale = flat_weights.index_select(0, route.pair_order).unsqueeze(1)
            return grad_out.index_select(0, route.token_index) * scale

        pending: list[WeightGradInputs | None] = [None] * len(routes)

        def compute(i: int, received: Tensor) -> Tensor:
            route = routes[i]
            grad_in, pending[i] = swiglu_backward_input(
                _to_expert_order(route, received), activations[i], route.expert_counts,
                w_up, w_gate, w_down, strategy=call.strategy,
            )
            activations[i] = None  # type: ignore[call-overload]  # free as we go
            return _to_receive_order(route, grad_in)

        def weight_grads(i: int) -> None:
            accumulate_weight_grads(pending[i], grads, strategy=call.strategy)
            pending[i] = None

        shared_grads: tuple[Tensor | None, ...] = (None, None, None)
        if s_up is not None:
            shared_grads = (torch.zeros_like(s_up), torch.zeros_like(s_gate),
                            torch.zeros_like(s_down))

        def shared_experts() -> None:
            if ctx.shared_activations is None:
                return
            grad_in, work = swiglu_backward_input(
                grad_out, ctx.shared_activations, [tokens], s_up, s_gate, s_down,
                strategy=call.strategy)
            grad_x.add_(grad_in)
            accumulate_weight_grads(work, shared_grads, strategy=call.strategy)  # type: ignore[arg-type]

        run_pipeline(
            handle,
            PipelineSteps(
                gather=gather,
                compute=compute,
                scatter=lambda i, rows: grad_x.index_add_(0, routes[i].token_index, rows),
                deferred=weight_grads,
                local=shared_experts if s_up is not None else None,
            ),
            overlap=call.overlap, phase="backward", timeline=call.timeline,
        )
        return (grad_x, grads[0], grads[1], grads[2], grad_weights, None, *shared_grads)


def _two_stage(hierarchy: str, send_totals: Tensor, group: Any, timeline: Timeline | None,
               rows_per_rank: int, like: Tensor) -> Callable[[int], tuple[Any, list[int]]] | None:
    """The per-micro-batch two-stage exchanges, or ``None`` where a flat one is right.

    ``"auto"`` takes the 2-D exchange only on several nodes of several ranks each, and only
    where it measured faster than the flat one for this size (:func:`two_stage_pays`).
    """
    topo = topology_for(group)
    per_node = len(topo.ranks_of_node(0))
    if hierarchy == "auto" and (topo.nodes == 1 or per_node == 1 or not topo.uniform):
        return None
    if not topo.uniform:
        raise ValueError(f"hierarchy='2d' needs the same ranks on every node: {topo.describe()}")
    intra, inter = topo.subgroups(group)
    if hierarchy == "auto":
        with maybe_span(timeline, "comm", "choose_hierarchy", "forward"):
            pays = two_stage_pays(group, rank=topo.rank, nodes=topo.nodes, per_node=per_node,
                                  intra_group=intra, inter_group=inter,
                                  rows_per_rank=rows_per_rank, hidden=like.shape[-1],
                                  dtype=like.dtype, device=like.device)
        if not pays:
            return None
    with maybe_span(timeline, "comm", "counts", "forward"):
        totals = gather_counts(send_totals, group)  # [world(src), K, world(dst)]
    return lambda i: two_stage_plan(totals, i, rank=topo.rank, nodes=topo.nodes,
                                    per_node=per_node, intra_group=intra, inter_group=inter)


def fused_expert(
    x: Tensor,
    weights_up: Tensor,
    weights_gate: Tensor,
    weights_down: Tensor,
    expert_ids: Tensor,
    routing_weights: Tensor | None = None,
    *,
    group: Any = None,
    micro_batches: MicroBatches = "auto",
    overlap: bool = True,
    num_experts: int | None = None,
    gemm: GemmStrategy = "auto",
    timeline: Timeline | None = None,
    planner: Planner | None = None,
    shared_up: Tensor | None = None,
    shared_gate: Tensor | None = None,
    shared_down: Tensor | None = None,
    hierarchy: Hierarchy = "flat",
) -> Tensor:
    """Expert-parallel SwiGLU MoE with the All-to-All hidden behind expert computation.

    Expert ``e`` lives on rank ``e // local_experts`` of ``group``. Each token is sent to the
    ranks of its top-k experts (dispatch), transformed there by
    ``down(silu(x @ gate) * (x @ up))`` and sent back (combine); the result is the
    ``routing_weights``-weighted sum over its top-k expert outputs, in the original token order.
    Dropless: no capacity factor, no token is ever dropped.

    Args:
        x: ``[batch, seq, hidden]`` or ``[tokens, hidden]`` float tokens of this rank (may hold
            zero tokens; the rank still takes part).
        weights_up: ``[local_experts, hidden, ffn]`` this rank's experts' up projections.
        weights_gate: ``[local_experts, hidden, ffn]`` gate projections.
        weights_down: ``[local_experts, ffn, hidden]`` down projections.
        expert_ids: ``x.shape[:-1] + (topk,)`` integer *global* expert ids in
            ``[0, world * local_experts)``.
        routing_weights: like ``expert_ids``, float; the top-k combine weights (``None``: 1).
        group: the expert-parallel process group (``None``: the default group). Without an
            initialised ``torch.distributed`` or with one rank, runs locally without collectives.
        micro_batches: K, the number of micro-batches the local tokens are split into; ``1`` does
            not split; ``"auto"`` lets the planner choose from a cost model measured on this
            group (:mod:`mc2.planner`; K = 1 where splitting cannot pay). Must be the same on
            every rank; with ``"auto"`` all ranks derive the same K.
        overlap: ``True`` issues asynchronous collectives so micro-batch ``i+1`` is dispatched
            and ``i-1`` combined while ``i`` computes (where the backend cannot, or
            ``MC2_FORCE_SYNC=1`` is set, it falls back to synchronous collectives, warns with
            :class:`~mc2.env.SyncFallbackWarning` and marks the timeline); ``False`` is the
            plain serial path (with ``"auto"``: K = 1, one synchronous dispatch, compute, one
            synchronous combine).
        num_experts: optional check that the group holds exactly this many experts.
        gemm: ``"grouped"`` (``torch.nn.functional.grouped_mm``), ``"loop"`` (one GEMM per
            expert) or ``"auto"`` (currently ``loop``, which measured as fast or faster; see
            :mod:`mc2.experts`).
        planner: the :class:`~mc2.planner.Planner` for ``"auto"`` (default: one shared per
            group, measuring on first use: a collective all ranks enter together).
        shared_up, shared_gate: ``[shared, hidden, shared_ffn]`` optional shared experts
            (DeepSeek/Qwen style) that every token passes through; computed while the first
            dispatch is in flight (forward) and the first gradient dispatch (backward).
        shared_down: ``[shared, shared_ffn, hidden]``.
        hierarchy: ``"flat"``: one All-to-All over the group; ``"2d"``: across nodes only
            between ranks of the same local rank, one message per node, then inside the node
            (:mod:`mc2.hierarchy`; needs the same number of ranks on every node); ``"auto"``:
            ``"2d"`` when the group spans several nodes with several ranks each and the 2-D
            exchange measured faster than the flat one for this size (once, then cached),
            else flat.
            Results are identical; only the traffic differs.
        timeline: a :class:`~mc2.timeline.Timeline` that receives compute/comm/wait/transfer
            spans (default: the one of the active :func:`mc2.profile`, if any).

    Returns:
        ``x``-shaped output, differentiable w.r.t. ``x``, the three weights and
        ``routing_weights``. Every rank must run the backward when any rank does (as with DDP).

    Memory kept for the backward: per micro-batch the received rows and their gate/up
    projections (``rows * (hidden + 2 * ffn)`` elements), plus the combined expert outputs
    ``tokens * topk * hidden`` for the ``routing_weights`` gradient. Nothing is kept when no
    input requires a gradient.

    Raises:
        ValueError: on *every* rank of the group when any rank passes bad arguments (wrong
            shape/dtype/device, expert id out of range, weights that do not match the group), or
            when ranks disagree on values that must be shared; no rank is left in a collective.
    """
    if timeline is None:
        timeline = active_timeline()
    world = group_size(group)
    if overlap is True and world > 1:
        reason = sync_reason(dist.get_backend(group))
        if reason is not None:
            warn_sync_fallback(reason)
            overlap = False
            if micro_batches == "auto":
                micro_batches = 1
            if timeline is not None:
                timeline.sync_fallback = reason
    problem = local_problem(
        x, weights_up, weights_gate, weights_down, expert_ids, routing_weights,
        world_size=world, num_experts=num_experts, micro_batches=micro_batches, overlap=overlap,
        hierarchy=hierarchy,
    ) or shared_problem(x, shared_up, shared_gate, shared_down)
    tensors = [t for t in (x, weights_up, weights_gate, weights_down, routing_weights, shared_up,
                           shared_gate, shared_down) if isinstance(t, Tensor)]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    with maybe_span(timeline, "comm", "handshake", "forward"):
        agreement = agree(
            problem, x=x, w_up=weights_up, expert_ids=expert_ids, micro_batches=micro_batches,
            overlap=overlap, needs_grad=needs_grad, group=group, hierarchy=hierarchy,
        )
    strategy = resolve_strategy(gemm, x.dtype, x.device)

    local_experts, hidden = weights_up.shape[0], x.shape[-1]
    total_experts = world * local_experts
    if micro_batches == "auto":
        k = 1
        if overlap:
            with maybe_span(timeline, "compute", "plan", "forward"):
                k = (planner or planner_for(group)).plan(
                    max_tokens=agreement.max_tokens, topk=agreement.max_topk, w_up=weights_up,
                    w_gate=weights_gate, w_down=weights_down, group=group, strategy=strategy)
    else:
        k = int(micro_batches)

    x2d = x.reshape(-1, hidden)
    ids2d = expert_ids.reshape(x2d.shape[0], expert_ids.shape[-1])
    weights2d = (
        torch.ones(ids2d.shape, dtype=x.dtype, device=x.device)
        if routing_weights is None
        else routing_weights.reshape(ids2d.shape).to(x.dtype)
    )
    order, send_counts = local_send_counts(ids2d, total_experts, k)
    with maybe_span(timeline, "comm", "counts", "forward"):
        recv_counts = exchange_counts(
            send_counts.view(k, world, local_experts).transpose(0, 1).contiguous(), group
        )
    two_stage = None
    if hierarchy != "flat" and world > 1:
        two_stage = _two_stage(hierarchy, send_counts.view(k, world, local_experts).sum(-1),
                               group, timeline, agreement.max_tokens * agreement.max_topk // k,
                               x)
    handle = build_handle(
        ids2d, order, send_counts, recv_counts, world_size=world, local_experts=local_experts,
        group=group, two_stage=two_stage,
    )
    call = _Call(handle=handle, group=group, overlap=overlap, strategy=strategy,
                 keep_activations=needs_grad, timeline=timeline)
    shared = (None, None, None)
    if shared_up is not None:  # S shared experts = one expert of width S * shared_ffn
        n, _, f = shared_up.shape
        shared = (shared_up.permute(1, 0, 2).reshape(1, hidden, n * f),
                  shared_gate.permute(1, 0, 2).reshape(1, hidden, n * f),
                  shared_down.reshape(1, n * f, hidden))
    out = _FusedExpertFunction.apply(
        x2d, weights_up, weights_gate, weights_down, weights2d, call, *shared
    )
    return out.view(x.shape)
