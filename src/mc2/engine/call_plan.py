"""Planning one :func:`mc2.fused_expert` call: everything decided before any row moves.

Validate (an error on every rank, never a hang), fall back to synchronous communication where
asynchronous is impossible, agree on the shared values in one collective, choose K, sort the
local (token, slot) pairs into micro-batches, exchange the per-micro-batch counts, and choose
the All-to-All layout. The result is a :class:`~mc2.engine.function.CallPlan` that the autograd
Function runs.

Collectives and host synchronisations per call (counted, flat layout): one ``all_reduce`` (the
handshake: errors, shared values, the group's largest token count), one ``all_to_all`` of
counts, then ``2K`` All-to-Alls of rows forward and ``2K`` backward. ``"auto"`` adds one
``all_reduce`` per shape once its trials are done (see :mod:`mc2.engine.planner`), and its calibration
once per group and weight shape.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ..observation.profiler import active_timeline
from ..observation.timeline import Timeline, maybe_span
from .comm import exchange_counts, gather_counts, group_size
from .env import sync_reason, warn_sync_fallback
from .experts import ExpertWeights, resolve_strategy
from .function import CallPlan
from .hierarchy import two_stage_pays, two_stage_plan
from .planner import Planner, planner_for
from .routing import build_handle, local_send_counts, micro_batch_fractions
from .topology import topology_for
from .validation import agree, local_problem, nonfinite_problem, shared_problem
from .wire import NONE, WireFormat, wire_pair, wire_problem
from .workspace import Workspace, default_workspace


def _two_stage(hierarchy: str, send_totals: Tensor, group: Any, timeline: Timeline | None,
               rows_per_rank: int, like: Tensor, wire: tuple[WireFormat, WireFormat]
               ) -> Callable[[int], tuple[Any, list[int]]] | None:
    """The per-micro-batch two-stage exchanges, or ``None`` where a flat one is right.

    ``"auto"`` takes the 2-D exchange only on several nodes of several ranks each, and only
    where it measured faster than the flat one for this size (:func:`two_stage_pays`), with
    rows as wide as the wire format makes them: fewer bytes can make the 2-D exchange's extra
    stage cost more than it saves.
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
                                  rows_per_rank=rows_per_rank,
                                  row_bytes=max(f.bytes_per_row(like.shape[-1], like.dtype)
                                                for f in wire),
                                  device=like.device)
        if not pays:
            return None
    with maybe_span(timeline, "comm", "counts", "forward"):
        totals = gather_counts(send_totals, group)  # [world(src), K, world(dst)]
    return lambda i: two_stage_plan(totals, i, rank=topo.rank, nodes=topo.nodes,
                                    per_node=per_node, intra_group=intra, inter_group=inter)


def _combine_weights(routing_weights: Tensor | None, ids2d: Tensor, like: Tensor) -> Tensor:
    if routing_weights is None:
        return torch.ones(ids2d.shape, dtype=like.dtype, device=like.device)
    return routing_weights.reshape(ids2d.shape).to(like.dtype)


def plan_call(
    x: Tensor,
    named_weights: dict[str, Any],
    expert_ids: Tensor,
    routing_weights: Tensor | None,
    *,
    packed: bool,
    group: Any,
    micro_batches: Any,
    overlap: bool,
    num_experts: int | None,
    gemm: str,
    timeline: Timeline | None,
    planner: Planner | None,
    shared: tuple[Tensor | None, Tensor | None, Tensor | None],
    hierarchy: str,
    workspace: Workspace | None,
    wire_dtype: Any = None,
    wire_block: int = 128,
    timeout: float | None = None,
    check_finite: bool = False,
) -> tuple[CallPlan, ExpertWeights, Tensor]:
    """Validate and plan a call; returns the plan, the weights and the ``[T, topk]`` combine
    weights. Raises ``ValueError`` on every rank when any rank's input is bad."""
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
        x, named_weights, expert_ids, routing_weights, packed=packed, world_size=world,
        num_experts=num_experts, micro_batches=micro_batches, overlap=overlap,
        hierarchy=hierarchy,
    ) or shared_problem(x, *shared) or wire_problem(wire_dtype, wire_block, x.shape[-1])
    if problem is None and check_finite:
        problem = nonfinite_problem(x, routing_weights)
    wire = wire_pair(wire_dtype, wire_block) if problem is None else (NONE, NONE)
    weights = None
    if problem is None:
        weights = (ExpertWeights.packed_of(named_weights["weights_gate_up"],
                                           named_weights["weights_down"]) if packed else
                   ExpertWeights.split_of(named_weights["weights_up"],
                                          named_weights["weights_gate"],
                                          named_weights["weights_down"]))
    tensors = [t for t in (x, *named_weights.values(), routing_weights, *shared)
               if isinstance(t, Tensor)]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    with maybe_span(timeline, "comm", "handshake", "forward"):
        agreement = agree(
            problem, x=x,
            experts=None if weights is None else (weights.local_experts, weights.ffn),
            expert_ids=expert_ids, micro_batches=micro_batches, overlap=overlap,
            needs_grad=needs_grad, group=group, hierarchy=hierarchy,
            wire=(wire[0].code, wire[1].code),
        )
    assert weights is not None
    strategy = resolve_strategy(gemm, x.dtype, x.device)
    local_experts, hidden = weights.local_experts, x.shape[-1]

    on_pass_done = None
    if micro_batches == "auto":
        k = 1
        if overlap:
            with maybe_span(timeline, "compute", "plan", "forward"):
                choice = (planner or planner_for(group)).choose(
                    max_tokens=agreement.max_tokens, topk=agreement.max_topk, weights=weights,
                    group=group, strategy=strategy, needs_grad=needs_grad, wire=wire)
            k, on_pass_done = choice.micro_batches, choice.on_pass_done
            if choice.plain_rows:  # the format measured slower here; the planner said so
                wire = (NONE, NONE)
            if timeline is not None and choice.trial:  # exploration is visible, and bounded
                now = time.perf_counter()
                timeline.add("compute", f"auto trial K={k}", "forward", -1, now, now)
    else:
        k = int(micro_batches)

    x2d = x.reshape(-1, hidden)
    ids2d = expert_ids.reshape(x2d.shape[0], expert_ids.shape[-1])
    order, send_counts = local_send_counts(ids2d, world * local_experts, k)
    with maybe_span(timeline, "comm", "counts", "forward"):
        recv_counts = exchange_counts(
            send_counts.view(k, world, local_experts).transpose(0, 1).contiguous(), group
        )
    two_stage = None
    if hierarchy != "flat" and world > 1:
        largest = int(agreement.max_tokens * agreement.max_topk * max(micro_batch_fractions(k)))
        two_stage = _two_stage(hierarchy, send_counts.view(k, world, local_experts).sum(-1),
                               group, timeline, largest, x, wire)
    pool = workspace or default_workspace()
    handle = build_handle(
        ids2d, order, send_counts, recv_counts, world_size=world, local_experts=local_experts,
        group=group, two_stage=two_stage, workspace=pool,
    )
    call = CallPlan(handle=handle, group=group, overlap=overlap, strategy=strategy,
                    keep_activations=needs_grad, timeline=timeline, workspace=pool,
                    on_pass_done=on_pass_done, wire=wire, timeout=timeout)
    return call, weights, _combine_weights(routing_weights, ids2d, x)
