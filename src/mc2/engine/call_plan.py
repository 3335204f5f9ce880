"""Planning one :func:`mc2.fused_expert` call: everything decided before any row moves.

Validate (an error on every rank, never a hang), fall back to synchronous communication where
asynchronous is impossible, agree on the shared values in one collective, choose K, sort the
local (token, slot) pairs into micro-batches, exchange the per-micro-batch counts, and choose
the All-to-All layout. The result is a :class:`~mc2.engine.function.CallPlan` that the autograd
Function runs.

Collectives and host synchronisations per call (counted, flat layout): one ``all_reduce`` (the
handshake: errors, shared values, the group's largest token count, the expert-id range) and one
``all_to_all`` of counts, each followed by one device-to-host read, with one upload of host
integers before the first; then ``2K`` All-to-Alls of rows forward and ``2K`` backward, which
read nothing back (:mod:`mc2.engine.host`). The 2-D layout adds one ``all_gather`` of counts, read
in the same copy as the others. ``"auto"`` adds one ``all_reduce`` and one read per shape once its
trials are done (see :mod:`mc2.engine.planner`), and its calibration once per group and weight
shape.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..observation.profiler import active_timeline
from ..observation.timeline import Timeline, maybe_span
from .comm import exchange_counts, gather_counts, group_size, is_local, style_of
from .env import warn_sync_fallback
from .experts import ExpertWeights
from .function import CallPlan
from .gemm_strategy import resolve_strategy, strategy_problem
from .hierarchy import TwoStagePlan, two_stage_pays
from .planner import Planner, planner_for
from .routing import (
    CountsExchange,
    build_handle,
    local_send_counts,
    micro_batch_fractions,
    read_counts,
)
from .topology import topology_for
from .validation import HIERARCHY_CODES, agree, local_problem, shared_problem
from .wire import NONE, WireFormat, wire_pair, wire_problem
from .workspace import Workspace, default_workspace

_DTYPES = {torch.float64: 1, torch.float32: 2, torch.bfloat16: 3, torch.float16: 4}
# what every rank must pass alike, agreed in the handshake (0 means 'auto' for micro_batches)
SHARED_FACTS = ("micro_batches", "the largest K (the planner's candidates)", "hidden size",
                "ffn size", "local experts", "dtype", "overlap", "gradient mode", "hierarchy",
                "wire_dtype (dispatch)", "wire_dtype (combine)")


def _wants_two_stage(hierarchy: str, group: Any, timeline: Timeline | None,
                     rows_per_rank: int, like: Tensor, wire: tuple[WireFormat, WireFormat]
                     ) -> tuple[Any, Any] | None:
    """``(topology, (intra, inter) groups)`` where the 2-D exchange is right, else ``None``.

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
    return topo, (intra, inter)


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
    device = x.device if isinstance(x, Tensor) else torch.device("cpu")
    if timeline is not None:
        timeline.bind(device)
    if overlap is True and not is_local(group):
        reason = style_of(group, device).sync_reason
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
    ) or shared_problem(x, *shared) or wire_problem(wire_dtype, wire_block, x.shape[-1]) \
        or strategy_problem(gemm, x.dtype, x.device)
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
    auto = micro_batches == "auto"
    plan_with = (planner or planner_for(group)) if auto and overlap else None
    capacity = max(plan_with.candidates) if plan_with is not None else \
        (1 if auto else micro_batches)
    facts = dict.fromkeys(SHARED_FACTS, 0)  # the same keys on every rank, valid or not
    if weights is not None:
        facts.update(zip(SHARED_FACTS, (
            0 if auto else micro_batches, capacity, x.shape[-1], weights.ffn,
            weights.local_experts, _DTYPES[x.dtype], int(overlap), int(needs_grad),
            HIERARCHY_CODES[hierarchy], wire[0].code, wire[1].code)))
    with maybe_span(timeline, "comm", "handshake", "forward"):
        agreement = agree(problem, x=x, expert_ids=expert_ids, routing_weights=routing_weights,
                          shared=facts, group=group,
                          total_experts=world * (weights.local_experts if weights else 0),
                          check_finite=check_finite)
    assert weights is not None
    strategy = resolve_strategy(gemm, weights, x.device)
    local_experts, hidden = weights.local_experts, x.shape[-1]

    on_pass_done = None
    if auto:
        k = 1
        if plan_with is not None:
            with maybe_span(timeline, "compute", "plan", "forward"):
                choice = plan_with.choose(
                    max_tokens=agreement.max_tokens, topk=agreement.max_topk, weights=weights,
                    group=group, strategy=strategy, needs_grad=needs_grad, wire=wire)
            k, on_pass_done = choice.micro_batches, choice.on_pass_done
            if choice.plain_rows:  # the format measured slower here; the planner said so
                wire = (NONE, NONE)
            if timeline is not None and choice.trial:  # exploration is visible, and bounded
                timeline.mark("compute", f"auto trial K={k}", "forward")
    else:
        k = int(micro_batches)

    x2d = x.reshape(-1, hidden)
    ids2d = expert_ids.reshape(x2d.shape[0], expert_ids.shape[-1])
    order, send_counts = local_send_counts(ids2d, world * local_experts, k)
    counts = CountsExchange(k, capacity, world, local_experts)
    with maybe_span(timeline, "comm", "counts", "forward"):
        payload = exchange_counts(counts.payload(send_counts), group)
    two_d, totals = None, None
    if hierarchy != "flat" and world > 1:
        largest = int(agreement.max_tokens * agreement.max_topk * max(micro_batch_fractions(k)))
        two_d = _wants_two_stage(hierarchy, group, timeline, largest, x, wire)
        if two_d is not None:
            with maybe_span(timeline, "comm", "counts", "forward"):  # [world(src), K, world(dst)]
                totals = gather_counts(send_counts.view(k, world, local_experts).sum(-1), group)
    host = read_counts(counts, send_counts, payload, totals)
    two_stage = None
    if two_d is not None:
        topo, (intra, inter) = two_d
        flat = host.extra
        nested = [[flat[(src * k + i) * world:(src * k + i + 1) * world] for i in range(k)]
                  for src in range(world)]
        two_stage = TwoStagePlan(nested, totals, topo.rank, topo.nodes,
                                 len(topo.ranks_of_node(0)), intra, inter).per_micro_batch()
    pool = workspace or default_workspace()
    handle = build_handle(
        ids2d, order, host, counts.received(payload), world_size=world,
        local_experts=local_experts, group=group, two_stage=two_stage, workspace=pool,
    )
    call = CallPlan(handle=handle, group=group, overlap=overlap, strategy=strategy,
                    keep_activations=needs_grad, timeline=timeline, workspace=pool,
                    on_pass_done=on_pass_done, wire=wire, timeout=timeout)
    return call, weights, _combine_weights(routing_weights, ids2d, x)
