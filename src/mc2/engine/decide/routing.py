"""Routing plan: which local (token, slot) pairs go where, per micro-batch.

Everything here is local bookkeeping on integer tensors, computed once per call and reused by
the backward pass (the gradient travels the same routes in the same micro-batches). The only
communication is the single up-front exchange of per-micro-batch counts (see
:func:`mc2.engine.transport.comm.exchange_counts`), so the pipeline never stops for a small message per
chunk.

Device and host: the sort, the counts and every index live on the device of the call and are
built there; the host needs only the split sizes (``all_to_all_single`` takes Python lists),
and reads them once per call, after the counts exchange (:func:`read_counts`). Nothing here
calls ``bincount``, ``nonzero`` or a boolean mask, which read back on accelerators, and no index
is uploaded.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mc2.engine.decide.dedup import SlotRoutes, WeightGradReturn, chunk_of_token
from mc2.engine.transport.comm import FlatExchange
from mc2.engine.transport.hierarchy import regroup_index
from mc2.engine.transport.host import read, upload


@dataclass(frozen=True)
class MicroBatchRoute:
    """The routes of one micro-batch.

    Attributes:
        pair_order: ``[n] int64`` pair indices (``token * topk + slot``) sorted by global expert
            id; the dispatch send buffer is ``x[pair_order // topk]`` in this order (``None``
            when rows go once per destination: :attr:`slots`).
        token_index: ``[n] int64`` the source token of each sent row.
        send_splits: rows sent to each rank (``len == world``), i.e. grouped by destination.
        expert_counts: rows each *local* expert processes (``len == local_experts``).
        expert_gather: ``[r] int64`` gather index that turns the received rows (in arrival
            order: by source rank for a flat exchange, by forwarding local rank and source node
            for a two-stage one; then local expert) into expert-grouped order (local expert,
            then source rank); ``None`` when no reordering is needed.
        exchange: moves this micro-batch's rows (``dispatch``) and back (``combine``): a
            :class:`~mc2.engine.transport.comm.FlatExchange` or a
            :class:`~mc2.engine.transport.hierarchy.TwoStageExchange`.
        expert_offsets: ``[local_experts] int32`` on the device, the running end of each
            expert's rows (what ``grouped_mm`` takes as ``offs``).
        slots: where rows travel once per destination (:mod:`~mc2.engine.decide.dedup`): the
            received rows' expansion to this rank's experts; ``None``: one row per pair.
    """

    pair_order: Tensor | None
    token_index: Tensor
    send_splits: list[int]
    expert_counts: list[int]
    expert_gather: Tensor | None
    exchange: Any = None
    expert_offsets: Tensor | None = None
    slots: SlotRoutes | None = None


@dataclass(frozen=True)
class DispatchHandle:
    """Everything the combine and the backward need to retrace a dispatch (DeepEP-style handle).

    Attributes:
        num_tokens: local tokens ``T`` of this rank (may be 0).
        topk: expert slots per token.
        world_size: ranks in the expert-parallel group.
        micro_batches: the routes, one per micro-batch, the same count on every rank.
        weight_grads: where rows travel once per destination, what returns the routing
            weights' gradients at the end of a backward; ``None`` otherwise.
    """

    num_tokens: int
    topk: int
    world_size: int
    micro_batches: tuple[MicroBatchRoute, ...]
    weight_grads: WeightGradReturn | None = None

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches)


def micro_batch_weights(num_micro_batches: int) -> list[int]:
    """Relative sizes of the micro-batches: the first and the last are half the others.

    Why: the first dispatch and the last combine of each pass cannot hide behind any compute,
    so their size is the pipeline's fill and drain. Halving them shortens both while the
    micro-batches in between, where transfers do hide, stay big enough to use the GEMMs well.
    A growth of 2 from the first to the second stays hideable as long as a transfer takes less
    than half its micro-batch's compute, the regime where overlap pays. ``K <= 2``: equal sizes.
    """
    return [1] * num_micro_batches if num_micro_batches <= 2 else \
        [1] + [2] * (num_micro_batches - 2) + [1]


def micro_batch_fractions(num_micro_batches: int) -> list[float]:
    """Each micro-batch's share of the tokens (the cost models use the same split)."""
    weights = micro_batch_weights(num_micro_batches)
    return [w / sum(weights) for w in weights]


def micro_batch_bounds(num_tokens: int, num_micro_batches: int) -> list[tuple[int, int]]:
    """Contiguous token ranges of the ``num_micro_batches`` micro-batches.

    Sizes follow :func:`micro_batch_weights` (tapered ends). With fewer tokens than the weights
    add up to, the split is near-equal instead (sizes differ by at most one,
    ``torch.tensor_split`` semantics) and the trailing ranges are empty, which keeps the
    micro-batch count equal on every rank (collectives must match) even on a rank with no
    tokens at all.
    """
    weights = micro_batch_weights(num_micro_batches)
    total = sum(weights)
    if num_tokens < total:
        base, extra = divmod(num_tokens, num_micro_batches)
        stops = [(i + 1) * base + min(i + 1, extra) for i in range(num_micro_batches)]
    else:
        stops = [num_tokens * c // total for c in itertools.accumulate(weights)]
    return list(itertools.pairwise([0, *stops]))


def count_on_device(values: Tensor, n: int, dtype: torch.dtype = torch.int64) -> Tensor:
    """``[n]`` how often each of ``0..n-1`` occurs in ``values``, by a scatter-add on the
    values' device (``torch.bincount`` would read its range back to the host)."""
    flat = values.reshape(-1).to(torch.int64)
    counts = torch.zeros(n, dtype=dtype, device=flat.device)
    return counts.index_add_(0, flat, torch.ones(flat.shape, dtype=dtype, device=flat.device))


def local_send_counts(
    expert_ids: Tensor, num_experts: int, num_micro_batches: int
) -> tuple[Tensor, Tensor]:
    """Sort the pairs by (micro-batch, expert) and count them, on the ids' device.

    Args:
        expert_ids: ``[T, topk]`` integer global expert ids, already validated (``-1``: no
            expert, a dropped slot).
        num_experts: ``E``, the global expert count.
        num_micro_batches: ``K``.

    Returns:
        ``(order, counts)``: ``order`` ``[T * topk] int64`` pair indices sorted by micro-batch
        then expert (stable, so equal experts keep token order), the pairs of no expert last
        (counted nowhere: they travel nowhere); ``counts`` ``[K, E] int64`` (a scatter-add:
        ``bincount`` would read its range back to the host).
    """
    num_tokens, topk = expert_ids.shape
    flat = expert_ids.reshape(-1).to(torch.int64)
    chunk = chunk_of_token(num_tokens, micro_batch_bounds(num_tokens, num_micro_batches),
                           flat.device)
    key = chunk.unsqueeze(1).expand(num_tokens, topk).reshape(-1) * num_experts + flat
    nowhere = num_micro_batches * num_experts
    key = torch.where(flat < 0, nowhere, key)
    order = torch.sort(key, stable=True).indices
    counts = count_on_device(key, nowhere + 1)[:nowhere]
    return order, counts.view(num_micro_batches, num_experts)


def expert_grouping_indices(recv_counts: Tensor, totals: list[int],
                            arrival: tuple[int, int] | None = None) -> list[Tensor] | None:
    """Per micro-batch, the gather index from arrival order to expert-grouped order.

    Args:
        recv_counts: ``[world, K, local_experts] int64`` rows received per (source rank,
            micro-batch, local expert), on the device.
        totals: rows received per micro-batch (host).
        arrival: ``None`` when blocks arrive by source rank (a flat exchange); ``(nodes,
            per_node)`` when they arrive by forwarding local rank, then source node (a
            two-stage exchange, :mod:`mc2.engine.transport.hierarchy`).

    Returns:
        One ``[r_i] int64`` index per micro-batch, or ``None`` where arrival order is already
        expert order (one local expert, or one rank).
    """
    world, k, local = recv_counts.shape
    if local == 1 or (arrival is None and world == 1):
        return None
    lengths = recv_counts.permute(1, 0, 2)  # [K, source, expert]
    if arrival is None:
        index = regroup_index(lengths, (2, 1), sum(totals))
    else:
        nodes, per_node = arrival  # source = node * per_node + local rank
        arriving = lengths.reshape(k, nodes, per_node, local).transpose(1, 2)  # [K, l, n, e]
        index = regroup_index(arriving, (3, 2, 1), sum(totals))  # -> [K, e, n, l]
    return list(torch.split(index, totals))


@dataclass(frozen=True)
class CountsExchange:
    """What the counts exchange sends: per destination rank, a header with this rank's K, then
    ``K x local_experts`` counts, padded to the call's agreed largest K.

    Why the header: the K of ``micro_batches="auto"`` comes from each rank's planner. Carried in
    the exchange every call makes anyway, a rank that chose another K (its own planner, one
    call more than the others) is an error on every rank, not All-to-Alls of mismatched sizes.

    Where rows travel once per destination (``rows=True``), the rows themselves are counted
    too (``capacity`` more values per destination): the pairs size the experts' work, the rows
    the exchanges.
    """

    k: int
    capacity: int
    world: int
    local_experts: int
    rows: bool = False

    def payload(self, counts: Tensor, rows: Tensor | None = None) -> Tensor:
        """``counts [K, E]`` (and ``rows [K, world]``) -> ``[world, 1 + capacity *
        (local_experts + rows)]`` (destination-major)."""
        per_dest = counts.view(self.k, self.world, self.local_experts).transpose(0, 1)
        body = self.capacity * self.local_experts
        out = torch.zeros(self.world, 1 + body + self.capacity * self.rows,
                          dtype=torch.int64, device=counts.device)
        out[:, 0] = self.k
        out[:, 1:1 + self.k * self.local_experts] = per_dest.reshape(self.world, -1)
        if rows is not None:
            out[:, 1 + body:1 + body + self.k] = rows.t()
        return out

    def received(self, payload: Tensor) -> Tensor:
        """The exchanged payload -> ``[world(src), K, local_experts]`` received counts."""
        body = payload[:, 1:1 + self.k * self.local_experts]
        return body.reshape(self.world, self.k, self.local_experts)

    def received_rows(self, payload: Tensor) -> Tensor:
        """``[world(src), K]`` rows received (``rows=True``), else pairs received."""
        if not self.rows:
            return self.received(payload).sum(-1)
        start = 1 + self.capacity * self.local_experts
        return payload[:, start:start + self.k]


@dataclass(frozen=True)
class HostCounts:
    """The split sizes of every micro-batch, read to the host once per call.

    Attributes:
        send: ``[K][world]`` rows sent to each rank.
        recv: ``[K][world]`` rows received from each rank.
        experts: ``[K][local_experts]`` rows each local expert processes.
        extra: what else was read in the same copy (the 2-D exchange's gathered totals).
    """

    send: list[list[int]]
    recv: list[list[int]]
    experts: list[list[int]]
    extra: list[int]


def read_counts(exchange: CountsExchange, send_totals: Tensor, payload: Tensor,
                extra: Tensor | None = None) -> HostCounts:
    """The call's second and last device-to-host read: every split, plus ``extra``.

    Raises:
        ValueError: another rank runs a different K (every rank sees every header, so every
            rank raises).
    """
    k, world, local = exchange.k, exchange.world, exchange.local_experts
    received = exchange.received(payload)
    parts = [payload[:, 0], send_totals.reshape(-1),
             exchange.received_rows(payload).t().reshape(-1), received.sum(0).reshape(-1)]
    if extra is not None:
        parts.append(extra.reshape(-1))
    values = read(torch.cat(parts))
    headers, values = values[:world], values[world:]
    others = {rank: h for rank, h in enumerate(headers) if h != k}
    if others:
        theirs = ", ".join(f"rank {r}: K={h}" for r, h in sorted(others.items()))
        raise ValueError(
            f"fused_expert: ranks disagree on the number of micro-batches (this rank runs K={k}; "
            f"{theirs}): with micro_batches='auto' every rank must make the same calls through "
            "planners of the same settings (or pass a fixed K)")

    flat = iter(values)

    def rows(width: int) -> list[list[int]]:  # the next K rows of ``width`` values
        return [list(itertools.islice(flat, width)) for _ in range(k)]

    return HostCounts(rows(world), rows(world), rows(local), list(flat))


def folded_counts(folded: list[list[list[int]]], k: int, rank: int, local_experts: int,
                  device: torch.device) -> tuple[HostCounts, Tensor]:
    """The split sizes :func:`read_counts` would read, counted from every rank's ids (carried
    in the handshake, :attr:`~mc2.engine.decide.validation.Agreement.folded`) with no counts
    exchange: what this rank sends, and what each rank sends it, per micro-batch, split as
    each rank splits its own tokens (:func:`micro_batch_bounds`). Also the ``[world(src), K,
    local_experts]`` received counts :func:`build_handle` groups by, uploaded (no read)."""
    world = len(folded)
    received = [[[0] * local_experts for _ in range(k)] for _ in range(world)]
    send = [[0] * world for _ in range(k)]
    for src, ids in enumerate(folded):
        for i, (start, stop) in enumerate(micro_batch_bounds(len(ids), k)):
            for expert in itertools.chain.from_iterable(ids[start:stop]):
                if expert < 0:  # a dropped slot goes nowhere
                    continue
                dest, local = divmod(expert, local_experts)
                if src == rank:
                    send[i][dest] += 1
                if dest == rank:
                    received[src][i][local] += 1
    recv = [[sum(received[src][i]) for src in range(world)] for i in range(k)]
    experts = [[sum(received[src][i][e] for src in range(world)) for e in range(local_experts)]
               for i in range(k)]
    flat = [c for per_src in received for per_mb in per_src for c in per_mb]
    return HostCounts(send, recv, experts, []), \
        upload(flat, device).view(world, k, local_experts)


def build_handle(
    expert_ids: Tensor,
    order: Tensor,
    counts: HostCounts,
    recv_counts: Tensor,
    *,
    world_size: int,
    group: Any = None,
    two_stage: tuple[list[Any], tuple[int, int]] | None = None,
    workspace: Any = None,
    style: Any = None,
    once: tuple[list[Tensor], list[SlotRoutes], WeightGradReturn] | None = None,
) -> DispatchHandle:
    """Assemble the per-micro-batch routes from the local sort and the exchanged counts.

    Args:
        expert_ids: ``[T, topk]`` the validated expert ids.
        order: ``[T * topk]`` from :func:`local_send_counts`.
        counts: the host split sizes (:func:`read_counts`).
        recv_counts: ``[world, K, local_experts]`` rows each source rank sends to this rank's
            experts, per micro-batch, on the device.
        group: the group the flat exchanges run on.
        two_stage: ``(exchanges, (nodes, per_node))`` for a hierarchical exchange: each
            micro-batch's exchange and the order its rows arrive in; ``None``: flat.
        workspace: the :class:`~mc2.engine.transport.workspace.Workspace` flat exchanges receive into.
        style: the group's :class:`~mc2.engine.transport.backend.CommStyle` (looked up once per call).
        once: rows once per destination (:func:`mc2.engine.decide.dedup.exchange_tables` and
            :func:`~mc2.engine.decide.dedup.expand`): per micro-batch the tokens to send and
            the received rows' expansion, and the weights' gradient return.
    """
    num_tokens, topk = expert_ids.shape
    num_micro = len(counts.send)
    if two_stage is None:
        exchanges: list[Any] = [FlatExchange(counts.send[i], counts.recv[i], group, workspace,
                                             style) for i in range(num_micro)]
        arrival = None
    else:
        exchanges, arrival = two_stage
    ends = torch.cumsum(recv_counts.sum(0), 1).to(torch.int32)  # [K, local] grouped_mm offs
    if once is not None:
        tokens, slots, weight_grads = once
        pair_orders: list[Tensor | None] = [None] * num_micro
        gathers = None
    else:
        sizes = [sum(s) for s in counts.send]  # the pairs of no expert, sorted last, go nowhere
        pairs = torch.split(order[:sum(sizes)], sizes)
        pair_orders, tokens = list(pairs), [p // topk for p in pairs]
        slots, weight_grads = [None] * num_micro, None
        gathers = expert_grouping_indices(recv_counts, [sum(r) for r in counts.recv], arrival)
    return DispatchHandle(num_tokens, topk, world_size, tuple(
        MicroBatchRoute(pair_order=pair_orders[i], token_index=tokens[i],
                        send_splits=counts.send[i], expert_counts=counts.experts[i],
                        expert_gather=None if gathers is None else gathers[i],
                        exchange=exchanges[i], expert_offsets=ends[i], slots=slots[i])
        for i in range(num_micro)), weight_grads)
