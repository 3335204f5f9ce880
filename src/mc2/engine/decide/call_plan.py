"""Planning one :func:`mc2.fused_expert` call: everything decided before any row moves.

Validate (an error on every rank, never a hang), fall back to synchronous communication where
asynchronous is impossible, agree on the shared values in one collective, choose K, sort the
local (token, slot) pairs into micro-batches, exchange the per-micro-batch counts, and choose
the All-to-All layout. The result is a :class:`CallPlan` that a pass runs (:mod:`mc2.engine.passes.run`).

Collectives and host synchronisations per call (counted, flat layout): one ``all_reduce`` (the
handshake: errors, shared values, the group's largest token count, the expert-id range) and one
``all_to_all`` of counts, each followed by one device-to-host read, with one upload of host
integers before the first; then ``2K`` All-to-Alls of rows forward and ``2K`` backward, which
read nothing back (:mod:`mc2.engine.transport.host`). The 2-D layout adds one ``all_gather`` of counts, read
in the same copy as the others. ``"auto"`` adds one ``all_reduce`` and one read per shape once its
trials are done (see :mod:`mc2.engine.decide.planner`), and its calibration once per group and weight
shape.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import Tensor

from mc2.observation.profiler import active_timeline
from mc2.observation.timeline import Timeline, maybe_span
from mc2.observation.traffic import active_traffic
from mc2.engine.transport.backend import CommStyle
from mc2.engine.transport.comm import (
    carries_host_memory, exchange_counts, gather_counts, group_rank, group_size, style_of
)
from mc2.engine.decide.config import GEMMS, MC2Config
from mc2.engine.transport.deadline import timeout_code
from mc2.engine.transport.env import warn_sync_fallback
from mc2.engine.compute.experts import ExpertWeights
from mc2.engine.compute.module_experts import ModuleExperts
from mc2.engine.decide.gemm_strategy import resolve_strategy, strategy_problem
from mc2.engine.transport.hierarchy import TwoStagePlan, measured_sizes, two_stage_pays
from mc2.engine.decide.planner import Planner, planner_for
from mc2.device import streams
from mc2.device.clock import Interval
from mc2.engine.decide.capacity import CapacityHandle, fingerprint_of, plan_routes, sorts_slabs
from mc2.engine.decide.dedup import (
    chunk_of_token, destinations, exchange_node_tables, exchange_tables, expand, node_destinations,
    rows_per_destination
)
from mc2.engine.decide.shared_facts import SharedFacts
from mc2.engine.decide.routing import (
    DispatchHandle, CountsExchange, build_handle, folded_counts, local_send_counts, micro_batch_bounds,
    micro_batch_fractions, read_counts
)
from mc2.engine.transport.group_state import group_state
from mc2.engine.transport.topology import topology_for
from mc2.engine.decide.validation import (
    DTYPE_CODES, HIERARCHY_CODES, Agreement, agree, agreement_issued, local_problem,
    may_fold, shared_problem
)
from mc2.engine.transport.wire import PLAIN_PAIR, WirePair, wire_pair, wire_problem
from mc2.engine.transport.workspace import Workspace, default_workspace

_OVERFLOW_CODES = {"raise": 1, "drop": 2}


class Travel(str, enum.Enum):
    """How a call's rows travel; :data:`mc2.engine.passes.travel.TRAVELS` holds each way's
    steps (this floor names the way, the passes' floor runs it)."""

    PAIRS = "pairs"  # one row per (token, expert)
    ONCE = "once"  # once per (token, destination): ``handle``'s routes carry slot tables (dedup)
    SLABS = "slabs"  # a capacity call: ``handle`` holds fixed-size slabs, nothing read to the host


@dataclass(frozen=True)
class CallPlan:
    """Everything decided before any row moves; shared by the forward and backward of one call.

    Attributes:
        handle: the routes of every micro-batch (fixed slabs, a
            :class:`~mc2.engine.decide.capacity.CapacityHandle`, where ``travel`` is
            ``"slabs"``).
        overlap: asynchronous (pipelined) or synchronous collectives.
        strategy: how the experts' GEMMs run: ``"loop"`` or ``"grouped"``; a capacity call's
            ``"grouped"`` (sorted pairs) or ``"dense"`` (every row through every expert).
        keep_activations: whether a backward will follow (save what it needs).
        timeline: where spans go, or ``None``.
        workspace: where large buffers come from.
        on_pass_done: ``(phase, interval)`` called after each pass, for ``"auto"``'s trials
            and its drift guard (an :class:`~mc2.device.clock.Interval`, read only when the
            planner decides or checks).
        wire: ``(dispatch, combine)`` formats of each pass's two exchanges
            (:mod:`mc2.engine.transport.wire`). The backward's exchanges use the same pair, and
            treat the rounding as the identity (straight-through): the gradient of a quantised
            transfer is taken to be 1.
        timeout: seconds per wait (:mod:`mc2.engine.transport.deadline`); the backward's too.
        module: the routed experts as a module stage
            (:mod:`~mc2.engine.compute.module_experts`), or ``None``: mc2's SwiGLU on the
            call's weight tensors.
        travel: how rows travel (:class:`Travel`). Chosen here, when the call is planned,
            and nowhere else.
    """

    handle: DispatchHandle | CapacityHandle
    overlap: bool
    strategy: str
    keep_activations: bool
    timeline: Timeline | None
    workspace: Workspace
    on_pass_done: Callable[[str, Interval], None] | None = None
    wire: WirePair = PLAIN_PAIR
    timeout: float | None = None
    module: ModuleExperts | None = None
    travel: Travel = Travel.PAIRS

    def routed_experts(self, tensors: tuple[Tensor, ...]) -> ExpertWeights | ModuleExperts:
        """The routed experts this call runs, on ``tensors`` (the autograd node's): the
        module stage bound to them, or mc2's SwiGLU in their layout's order. Both have the
        same experts-stage methods, so a pass never asks which it holds."""
        if self.module is not None:
            return self.module.bound(tensors)
        return ExpertWeights.in_order(tensors)


def _wants_two_stage(hierarchy: str, group: Any, timeline: Timeline | None,
                     rows_per_rank: int, like: Tensor, wire: WirePair
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
    intra, inter = topo.subgroups(group)  # a ValueError on nodes of different sizes
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


def combine_weights(routing_weights: Tensor | None, ids2d: Tensor, like: Tensor) -> Tensor:
    """``[T, topk]`` combine weights in ``like``'s dtype (ones when none are given)."""
    return torch.ones(ids2d.shape, dtype=like.dtype, device=like.device) \
        if routing_weights is None else routing_weights.reshape(ids2d.shape).to(like.dtype)


def _fall_back_if_needed(config: MC2Config, style: CommStyle, timeline: Timeline | None
                         ) -> MC2Config:
    """Synchronous collectives where asynchronous ones are impossible; says so once."""
    reason = style.sync_reason  # None for a local group too
    if not config.overlap or reason is None:
        return config
    warn_sync_fallback(reason)
    if timeline is not None:
        timeline.fell_back(reason)
    return config.replace(overlap=False, micro_batches=1 if config.micro_batches == "auto"
                          else config.micro_batches)


def _local_check(x: Any, named_weights: dict[str, Any], expert_ids: Any, routing_weights: Any,
                 shared: tuple, config: MC2Config, *, packed: bool, world: int,
                 num_experts: int | None, module: ModuleExperts | None = None
                 ) -> tuple[str | None, ExpertWeights | ModuleExperts | None]:
    """What is wrong with this rank's call (no tensor's values read), and its weights."""
    problem = local_problem(
        x, named_weights, expert_ids, routing_weights, packed=packed, world_size=world,
        num_experts=num_experts, module=module,
    ) or shared_problem(x, *shared) or wire_problem(config.wire_dtype, config.wire_block,
                                                     x.shape[-1]) \
        or strategy_problem(config.gemm, x.dtype, x.device)
    if problem is not None:
        return problem, None
    if module is not None:
        return None, module
    if packed:
        return None, ExpertWeights.packed_of(named_weights["weights_gate_up"],
                                             named_weights["weights_down"])
    return None, ExpertWeights.split_of(named_weights["weights_up"], named_weights["weights_gate"],
                                        named_weights["weights_down"])


def _shared_facts(config: MC2Config, capacity: int, x: Tensor, weights: Any,
                  needs_grad: bool, wire: WirePair,
                  planner_calls: int, group: Any, timeout: float | None,
                  topk: int, paired: bool, routing_weights: Any) -> SharedFacts:
    """The values every rank must share, as the handshake carries them (all zero when this
    rank's input is bad: :meth:`SharedFacts.unknown`).

    ``planner_calls`` and ``exchange_measured`` make the collectives *after* the handshake the
    same on every rank: a planner that has chosen for fewer calls than its peers' would
    calibrate (collectives its peers do not run), and so would a process that has not measured
    the 2-D exchange where its peers have. The rest change what a peer receives (capacity's
    slabs, dropped rows) or how long it waits (``timeout``). ``topk``: where the call sends
    slot tables ``2 * topk`` wide (dedup, capacity mode), whose receive buffers are sized by
    the receiver's own (a plain call agrees the largest topk instead, so ranks may differ).
    ``routing_grad``: there too, whether the routing weights' gradient is sent back decides
    which tables the experts' side keeps and whether a collective runs (a rank passing
    ``None`` or detached weights among ranks that did not hung with dedup, and in capacity
    mode left most of its routing weights' gradient zero, silently; found by a review)."""
    if weights is None:
        return SharedFacts.unknown()
    tables = config.dedup or config.capacity is not None  # slot tables, k-wide, sent back
    return SharedFacts(
        micro_batches=0 if config.micro_batches == "auto" else config.micro_batches,
        largest_k=capacity, hidden=x.shape[-1], ffn=weights.ffn,
        local_experts=weights.local_experts, dtype=DTYPE_CODES[x.dtype],
        overlap=int(config.overlap), needs_grad=int(needs_grad),
        hierarchy=HIERARCHY_CODES[config.hierarchy], wire_dispatch=wire.dispatch.code,
        wire_combine=wire.combine.code,
        planner_calls=planner_calls,
        exchange_measured=measured_sizes(group) if config.hierarchy == "auto" else 0,
        dedup=int(config.dedup), capacity=config.capacity or 0,
        overflow=_OVERFLOW_CODES[config.overflow], gemm=GEMMS.index(config.gemm),
        timeout_ms=timeout_code(timeout), check_finite=int(config.check_finite),
        topk=topk if tables else 0, paired=int(paired),
        routing_grad=int(tables and needs_grad and isinstance(routing_weights, Tensor)
                         and routing_weights.requires_grad))


def _choose_k(config: MC2Config, planner: Planner | None, agreement: Any, weights: Any,
              group: Any, strategy: str, wire: WirePair,
              timeline: Timeline | None, trained: bool, watch: bool = True
              ) -> tuple[int, Any, WirePair]:
    """``(K, on_pass_done, wire)``: the configured K, or the planner's for ``"auto"``
    (``watch``: its drift guard times the locked calls; not for capacity calls, which read
    nothing on the host; ``trained``: a backward follows, agreed in the handshake)."""
    if config.micro_batches != "auto":
        return int(config.micro_batches), None, wire
    if planner is None:
        return 1, None, wire
    shape = dict(max_tokens=agreement.max_tokens, topk=agreement.max_topk, weights=weights,
                 group=group, strategy=strategy, wire=wire, sent_rows=agreement.max_rows)
    if torch._C._current_graph_task_id() != -1:  # a recompute inside a backward: its forward's K
        choice = planner.again(**shape)
    else:
        with maybe_span(timeline, "compute", "plan", "forward"):
            choice = planner.choose(**shape, watch=watch, trained=trained)
    if choice.plain_rows:  # the format measured slower here; the planner said so
        wire = PLAIN_PAIR
    if timeline is not None and choice.trial:  # exploration is visible, and bounded
        timeline.mark("compute", f"auto trial K={choice.micro_batches}"
                      + (" (settling, untimed)" if choice.settling else ""), "forward")
    if timeline is not None and choice.decided:  # and so is the decision, with its reasons
        timeline.mark("compute", f"auto {choice.decided}", "forward")
    return choice.micro_batches, choice.on_pass_done, wire


def _routes(x: Tensor, ids2d: Tensor, combine: Tensor, weights: Any, k: int, capacity: int,
            style: CommStyle, agreement: Any, config: MC2Config,
            wire: WirePair, group: Any, timeline: Timeline | None,
            workspace: Workspace, hit: Tensor | None) -> DispatchHandle:
    """Sort, exchange the counts (K agreed in the same message), read every split once, and
    build the routes (with ``hit``, each token's destinations, rows go once per destination:
    the slot tables are exchanged too, :mod:`mc2.engine.decide.dedup`)."""
    world, local_experts = group_size(group), weights.local_experts
    order, send_counts = local_send_counts(ids2d, world * local_experts, k)
    if agreement.folded is not None:  # every rank's ids came with the handshake
        host, received = folded_counts(agreement.folded, k, group_rank(group), local_experts,
                                       x.device)
        return build_handle(ids2d, order, host, received, world_size=world, group=group,
                            workspace=workspace, style=style)
    send_totals = send_counts.view(k, world, local_experts).sum(-1)  # [K, world] rows to each
    sent = None
    if hit is not None:
        chunk = chunk_of_token(ids2d.shape[0], micro_batch_bounds(ids2d.shape[0], k), x.device)
        sent = rows_per_destination(hit, chunk, k)
        send_totals = sent.counts
    counts = CountsExchange(k, capacity, world, local_experts, rows=sent is not None)
    with maybe_span(timeline, "comm", "counts", "forward"):
        payload = exchange_counts(counts.payload(send_counts, send_totals if sent else None),
                                  group)
    two_d, totals, node_sent, nodes = None, None, None, 0
    if config.hierarchy != "flat" and world > 1:
        largest = int(agreement.max_tokens * agreement.max_topk * max(micro_batch_fractions(k)))
        two_d = _wants_two_stage(config.hierarchy, group, timeline, largest, x, wire)
        if two_d is not None:  # padded to the agreed largest K: ranks that disagree on K
            # still exchange tensors of one size, and learn it from the counts' headers
            nodes = two_d[0].nodes if hit is not None else 0
            padded = torch.zeros(capacity, world + nodes, dtype=torch.int64, device=x.device)
            padded[:k, :world] = send_totals
            if hit is not None:  # rows once per node across the slow link
                node_sent = rows_per_destination(node_destinations(hit, nodes), chunk, k)
                padded[:k, world:] = node_sent.counts
            with maybe_span(timeline, "comm", "counts", "forward"):  # [world(src), K, dst]
                totals = gather_counts(padded, group)[:, :k].contiguous()
    host = read_counts(counts, send_totals, payload, totals)
    two_stage, rows = None, None  # rows once per destination: their slot tables, exchanged
    if two_d is not None:
        topo, (intra, inter) = two_d
        width, flat = world + nodes, host.extra
        nested = [[flat[(src * k + i) * width:(src * k + i + 1) * width] for i in range(k)]
                  for src in range(world)]
        plan = TwoStagePlan([[row[:world] for row in r] for r in nested], totals[..., :world],
                            topo.rank, topo.nodes, len(topo.ranks_of_node(0)), intra, inter,
                            node_totals=[[row[world:] for row in r] for r in nested]
                            if node_sent is not None else None)
        if node_sent is not None:
            with maybe_span(timeline, "comm", "slots", "forward"):
                rows = exchange_node_tables(
                    sent, node_sent, k, ids2d, combine, rank_rows=plan.totals,
                    node_rows=plan.node_totals, totals=totals, rank=topo.rank,
                    nodes=topo.nodes, per_node=plan.per_node, local_experts=local_experts,
                    intra_send=[sum(s["intra_send"]) for s in plan.splits()], group=group)
        two_stage = (plan.exchanges(rows.gathers if rows is not None else None,
                                    (wire.combine, x.shape[-1], x.dtype)), (topo.nodes, plan.per_node))
    elif sent is not None:
        with maybe_span(timeline, "comm", "slots", "forward"):
            rows = exchange_tables(sent, host.send, host.recv, counts.received_rows(payload),
                                   ids2d, combine, local_experts=local_experts, world=world,
                                   group=group)
    once = None if rows is None else (
        rows.tokens, expand(rows.tables, host.recv, host.experts, local_experts, x.dtype),
        rows.back)
    return build_handle(ids2d, order, host, counts.received(payload), world_size=world,
                        group=group, two_stage=two_stage,
                        workspace=workspace, style=style, once=once)


def _count(traffic: Any, handle: DispatchHandle, row_bytes: int) -> None:
    """File the call's rows with the active :func:`mc2.count_traffic` counter."""
    routes = handle.micro_batches  # summed over them, per destination rank (and node)
    sent = [sum(rows) for rows in zip(*(r.send_splits for r in routes))]
    inter = [sum(rows) for rows in zip(*(r.exchange.inter_send for r in routes))] \
        if routes and hasattr(routes[0].exchange, "inter_send") else None
    traffic.add(pairs=handle.num_tokens * handle.topk, rows_sent=sent, row_bytes=row_bytes,
                node_rows=inter)


class AgreedCapacity(set[tuple]):
    """A group's capacity configurations every rank agreed on (the shared values of a
    handshake): a steady call with one of them needs no handshake of its own, where the slab
    fingerprint checks it (a slot of the group's state)."""


def _capacity_call(x: Tensor, expert_ids: Tensor, routing_weights: Tensor | None, weights: Any,
                   problem: str | None, config: MC2Config, group: Any, style: CommStyle,
                   timeline: Timeline | None, workspace: Workspace | None,
                   timeout: float | None, needs_grad: bool, module: Any,
                   planner: Planner | None, paired: bool) -> tuple[CallPlan, Any, Tensor]:
    """A capacity call's plan: no counts, and in the steady state nothing read to the host.

    Every call runs the handshake (:func:`~mc2.engine.decide.validation.agree`) in host memory
    where the group has a host backend (Gloo, or a mixed ``"cpu:gloo,cuda:nccl"`` group): the
    first call of each configuration and shape on a group with its data checks (one read, no
    upload), later ones ("trusted") with the facts alone, reading nothing from a device. So
    ranks whose capacity, overflow, dtype, K or any other shared value differ raise
    ``ValueError`` on every rank, naming it, on the first call as after warm-up (a rank that
    changes its capacity alone used to run a handshake while its peers waited in a slab
    exchange, until the group's timeout), instead of exchanging slabs of different sizes
    (which Gloo answers by terminating the process, and NCCL with undefined data). A group of
    NCCL alone has no host memory to meet in: there the first call's handshake is on the
    device, later calls are trusted without one, and a rank that then changes its
    configuration or finds its input bad raises alone while its peers wait up to the call's
    deadline (``docs/faults.md``). Capture a capacity call in a CUDA
    graph only after such a first call (warm-up calls are needed for a capture anyway). What
    only the data shows (rows that do not fit, expert ids out of range) travels with the rows,
    is counted on the device, and raises on every rank at the next handshake on the group or
    ``mc2.check_overflow()`` (:mod:`mc2.engine.decide.overflow`).
    """
    auto = config.micro_batches == "auto"
    plan_with = (planner or planner_for(group)) if auto and config.overlap else None
    facts = _shared_facts(config, 0 if auto else config.micro_batches, x,
                          weights if problem is None else None, needs_grad, PLAIN_PAIR,
                          plan_with.settled_digest(group) if plan_with is not None else 0,
                          group, timeout, expert_ids.shape[-1], paired, routing_weights)
    on_host = carries_host_memory(group)
    # on a host group every call's handshake compares the planner's count, so a count that
    # moved (a dropless call's drift window on the same planner) asks for no data check
    values = (replace(facts, planner_calls=0) if on_host else facts).values()
    agreed = group_state(group).of(AgreedCapacity)
    # check_finite: the data's check runs in every call's handshake (a read of the device
    # each call, which the caller asked for): a steady call's trusted handshake carries none.
    # Inside a CUDA graph's capture that read cannot run, nor would a replay check anything
    if config.check_finite and problem is None and streams.capturing(x.device):
        raise ValueError("fused_expert: check_finite=True checks the data in every capacity "
                         "call, a read of the device, which a CUDA graph's capture cannot "
                         "make (nor would its replays check): pass check_finite=False to the "
                         "calls you capture")
    # "auto": the planner's trials, priced for full slabs (capacity rows to every rank). All
    # it uses is alike on every rank (the configuration, the shapes, the group's slowest
    # times), so every rank takes the same K with no exchange but the planner's own: its
    # calibration, once per group and weight shape, and one all-reduce when its trials end.
    slabs = Agreement(max_tokens=config.capacity, max_topk=expert_ids.shape[-1],
                      max_rows=config.capacity * group_size(group))
    # what the slabs' experts run, decided here once: sorted pairs through grouped GEMMs, or
    # every row through every expert (priced as the loop)
    strategy = "grouped" if problem is None and sorts_slabs(weights) else "dense"
    priced = "grouped" if strategy == "grouped" else "loop"
    # steady: nothing to check but the facts. quiet: the planner runs no collective here, so
    # the handshake may be waited for after the slabs are planned (a call whose planner may
    # run one waits for it first: a fresh planner on one rank raises, it does not calibrate
    # alone; on NCCL alone such a call runs its handshake, one read)
    steady = problem is None and values in agreed and not config.check_finite
    quiet = steady and (plan_with is None or plan_with.quiet_for(
        max_tokens=slabs.max_tokens, topk=slabs.max_topk, weights=weights, group=group,
        strategy=priced, sent_rows=slabs.max_rows, watch=False, trained=needs_grad))
    if problem is not None and agreed and not on_host:
        raise ValueError(f"fused_expert: {problem}")
    trusted = None  # a steady call's agreement, waited for once the slabs are planned (below)
    if on_host or not quiet:
        with maybe_span(timeline, "comm", "handshake", "forward"):
            agreement = agreement_issued(
                problem, x=x, expert_ids=expert_ids, routing_weights=routing_weights,
                shared=facts, group=group,
                total_experts=group_size(group) * (weights.local_experts if weights else 0),
                check_finite=config.check_finite, on_host=on_host, trusted=steady)
            if quiet:
                trusted = agreement
            else:
                agreement()
        agreed.add(values)
    ids2d = expert_ids.reshape(-1, expert_ids.shape[-1])
    combine = combine_weights(routing_weights, ids2d, x)
    k, on_pass_done, _ = _choose_k(config, plan_with, slabs, weights, group, priced,
                                   PLAIN_PAIR, timeline, needs_grad, watch=False)
    with maybe_span(timeline, "compute", "plan", "forward"):
        handle = plan_routes(ids2d, combine.detach(), capacity=config.capacity,
                             micro_batches=k, world=group_size(group),
                             local_experts=weights.local_experts, group=group, style=style,
                             overflow=config.overflow,
                             fingerprint=fingerprint_of(values))
    if trusted is not None:  # before any slab is issued
        with maybe_span(timeline, "comm", "handshake", "forward"):
            trusted()
    call = CallPlan(handle=handle, overlap=config.overlap, strategy=strategy,
                    keep_activations=needs_grad, timeline=timeline,
                    workspace=workspace or default_workspace(), timeout=timeout, module=module,
                    travel=Travel.SLABS, on_pass_done=on_pass_done)
    return call, weights, combine


def plan_call(
    x: Tensor,
    named_weights: dict[str, Any],
    expert_ids: Tensor,
    routing_weights: Tensor | None,
    *,
    config: MC2Config,
    packed: bool,
    group: Any,
    shared: tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None],
    problem: str | None = None,
    num_experts: int | None = None,
    timeline: Timeline | None = None,
    planner: Planner | None = None,
    workspace: Workspace | None = None,
    timeout: float | None = None,
    needs_grad: bool | None = None,
    module: ModuleExperts | None = None,
    paired: bool = False,
) -> tuple[CallPlan, ExpertWeights | ModuleExperts, Tensor]:
    """Validate and plan a call; returns the plan, the weights and the ``[T, topk]`` combine
    weights. Raises ``ValueError`` on every rank when any rank's input is bad.

    ``problem``: what the caller already found wrong (a bad option), carried to the handshake
    so that every rank raises with it. ``shared``: the shared experts ``(up, gate, down)`` and
    their per-token ``scale``, each or all ``None``. ``needs_grad``: whether a backward follows
    (default: from autograd; a traced call says so itself). ``module``: the routed experts as a
    module stage (``named_weights`` then holds its parameters, which it is bound to here: the
    caller's autocast may have cast them). The weights returned are the routed experts either
    way (:class:`ExpertWeights` or the bound module), so a caller hands ``weights.tensors()``
    to autograd without asking which. ``paired``: the call runs under ``forward_backward``'s
    pairing (agreed: a rank pairing alone issues its collectives in another order).
    """
    if module is not None:
        module = module.bound(tuple(named_weights.values()))
    timeline = timeline if timeline is not None else active_timeline()
    world = group_size(group)
    device = x.device if isinstance(x, Tensor) else torch.device("cpu")
    if streams.capturing(device):  # spans would time the capture, not the replays
        timeline = None
    if timeline is not None:
        timeline.bind(device)
    style = style_of(group, device)  # looked up once, handed to every exchange of the call
    config = _fall_back_if_needed(config, style, timeline)
    found, weights = _local_check(x, named_weights, expert_ids, routing_weights, shared, config,
                                  packed=packed, world=world, num_experts=num_experts,
                                  module=module)
    problem = problem or found
    tensors = [t for t in (x, *named_weights.values(), routing_weights, *shared)
               if isinstance(t, Tensor)]
    if needs_grad is None:  # a traced call says so itself: its graph runs without autograd
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if config.capacity is not None:
        return _capacity_call(x, expert_ids, routing_weights, weights, problem, config, group,
                              style, timeline, workspace, timeout, needs_grad, module, planner,
                              paired)
    wire = wire_pair(config.wire_dtype, config.wire_block) if problem is None else PLAIN_PAIR
    auto = config.micro_batches == "auto"
    plan_with = (planner or planner_for(group)) if auto and config.overlap else None
    capacity = max(plan_with.candidates) if plan_with is not None else \
        (1 if auto else config.micro_batches)
    hit = None
    if config.dedup and problem is None and world > 1:  # counted now, agreed in the handshake
        hit = destinations(expert_ids.reshape(-1, expert_ids.shape[-1]), weights.local_experts,
                           world)
    # a small call of a flat exchange, a row per pair, counts its routes from the handshake
    fold = problem is None and hit is None and config.hierarchy == "flat" and \
        may_fold(expert_ids, world)
    with maybe_span(timeline, "comm", "handshake", "forward"):
        agreement = agree(problem, x=x, expert_ids=expert_ids, routing_weights=routing_weights,
                          shared=_shared_facts(config, capacity, x,
                                               weights if problem is None else None,
                                               needs_grad, wire,
                                               plan_with.digest(group) if plan_with else 0,
                                               group, timeout,
                                               expert_ids.shape[-1], paired,
                                               routing_weights),
                          group=group,
                          total_experts=world * (weights.local_experts if weights else 0),
                          check_finite=config.check_finite,
                          rows=hit.sum() if hit is not None else None, fold=fold)
    assert weights is not None and problem is None
    strategy = resolve_strategy(config.gemm, weights)
    if agreement.folded is not None:  # every rank's call folded: one micro-batch for "auto"
        k, on_pass_done = (1 if auto else int(config.micro_batches)), None
    else:
        k, on_pass_done, wire = _choose_k(config, plan_with, agreement, weights, group,
                                          strategy, wire, timeline, needs_grad)
    pool = workspace or default_workspace()
    ids2d = expert_ids.reshape(-1, expert_ids.shape[-1])
    combine = combine_weights(routing_weights, ids2d, x)
    handle = _routes(x, ids2d, combine, weights, k, capacity, style, agreement, config, wire,
                     group, timeline, pool, hit)
    if (traffic := active_traffic()) is not None:
        _count(traffic, handle, wire.dispatch.bytes_per_row(x.shape[-1], x.dtype))
    call = CallPlan(handle=handle, overlap=config.overlap, strategy=strategy,
                    keep_activations=needs_grad, timeline=timeline, workspace=pool,
                    on_pass_done=on_pass_done, wire=wire, timeout=timeout, module=module,
                    travel=Travel.ONCE if hit is not None else Travel.PAIRS)
    return call, weights, combine
