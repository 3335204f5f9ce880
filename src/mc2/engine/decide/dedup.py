"""Rows once per destination: a token crosses the link once to each rank holding any of its
experts, and one reduced row comes back.

The expected saving for ``E`` experts spread evenly over ``R`` ranks, top-``k``, uniform
routing, is ``1 - D / k`` (``D``: :func:`expected_destinations`). The slot tables travel in
one exchange per call (:func:`mc2.engine.transport.comm.exchange_slots`, :func:`slot_dtype`).

See docs/engine.md, 'Rows once per destination (`dedup=True`)' (slot tables, the destination's
expand and reduce, the backward, the 2-D exchange, why nothing here reads the device).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mc2.engine.transport.comm import exchange_slots
from mc2.engine.transport.hierarchy import regroup_index


def expected_destinations(num_experts: int, destinations: int, topk: int) -> float:
    """``D``: distinct destinations (ranks or nodes) of a token whose ``topk`` experts are drawn
    uniformly without replacement from ``num_experts`` spread evenly over ``destinations``."""
    if destinations <= 1:
        return 1.0
    per = num_experts // destinations
    miss = math.comb(num_experts - per, topk) / math.comb(num_experts, topk)
    return destinations * (1 - miss)


def chunk_of_token(num_tokens: int, bounds: list[tuple[int, int]], device: torch.device
                   ) -> Tensor:
    """``[T] int64`` the micro-batch of each token (slice writes: no index is uploaded)."""
    chunk = torch.empty(num_tokens, dtype=torch.int64, device=device)
    for i, (start, stop) in enumerate(bounds):
        chunk[start:stop] = i
    return chunk


@dataclass(frozen=True)
class SentRows:
    """The sender's unique (token, destination) rows, before the call's host read.

    Attributes:
        order: ``[T * world]`` flat ``token * world + destination`` sorted by (micro-batch,
            destination, token), the real rows first (their number is known after the read).
        counts: ``[K, world] int64`` rows to each destination per micro-batch.
    """

    order: Tensor
    counts: Tensor


def destinations(ids2d: Tensor, local_experts: int, world: int) -> Tensor:
    """``[T, world] bool``: which ranks hold any of each token's experts (an id ``-1``, no
    expert, none). Ids out of range are clamped (the handshake rejects them; this runs before
    it, to count the rows)."""
    hit = torch.zeros(ids2d.shape[0], world + 1, dtype=torch.bool, device=ids2d.device)
    ids = ids2d.to(torch.int64)
    dest = ids.clamp(0, world * local_experts - 1) // local_experts
    dest = torch.where(ids < 0, world, dest)  # no expert: the extra column, dropped
    return hit.scatter_(1, dest, True)[:, :world]


def rows_per_destination(hit: Tensor, chunk: Tensor, num_micro: int) -> SentRows:
    """Each token once per destination rank holding any of its experts (``hit``:
    :func:`destinations`), sorted into micro-batches (``chunk``: :func:`chunk_of_token`)."""
    tokens, world = hit.shape
    device = hit.device
    token = torch.arange(tokens, dtype=torch.int64, device=device).unsqueeze(1)
    dest = torch.arange(world, dtype=torch.int64, device=device).unsqueeze(0)
    key = (chunk.unsqueeze(1) * world + dest) * tokens + token
    key = torch.where(hit, key, num_micro * world * tokens)  # absent rows sort last
    order = torch.sort(key.reshape(-1)).indices
    counts = torch.zeros(num_micro, world, dtype=torch.int64, device=device)
    counts.index_add_(0, chunk, hit.to(torch.int64))
    return SentRows(order, counts)


@dataclass(frozen=True)
class SlotRoutes:
    """One micro-batch's expansion on the receiving rank.

    Attributes:
        rows: ``[P] int64`` for each (row, local expert) pair, in expert-grouped order (local
            expert, then arrival), the received row it reads.
        weights: ``[P]`` each pair's routing weight (the call's dtype).
        slots: ``[P] int64`` each pair's place in the micro-batch's ``[r, k]`` slot table
            (where its routing weight's gradient goes).
        received: ``r``, the rows this micro-batch receives.
    """

    rows: Tensor
    weights: Tensor
    slots: Tensor
    received: int


@dataclass(frozen=True)
class WeightGradReturn:
    """What sends the routing weights' gradients back at the end of a backward.

    Attributes:
        arrival: ``[R] int64`` the gather index from arrival order (source, micro-batch) to
            micro-batch order (micro-batch, source); its inverse puts the gradients back.
        send_splits, recv_splits: the slot exchange's splits (this rank's view as a sender).
        tokens: ``[N] int64`` the token of each slot table this rank sent, in the order sent.
        num_tokens, topk: the sender's ``[T, k]`` weights.
        group: the expert-parallel group (the exchange runs on its control communicator).
    """

    arrival: Tensor
    send_splits: list[int]
    recv_splits: list[int]
    tokens: Tensor
    num_tokens: int
    topk: int
    group: Any

    def send_back(self, tables: list[Tensor], dtype: torch.dtype) -> Tensor:
        """``[T, k]`` routing-weight gradients from each micro-batch's ``[r_i, k]`` tables
        (one exchange)."""
        by_micro = torch.cat(tables) if tables else self.arrival.new_zeros((0, self.topk))
        by_source = torch.empty_like(by_micro).index_copy_(0, self.arrival, by_micro)
        back = exchange_slots(by_source, self.recv_splits, self.send_splits, self.group)
        grad = torch.zeros(self.num_tokens, self.topk, dtype=back.dtype, device=back.device)
        return grad.index_add_(0, self.tokens, back).to(dtype)


def slot_dtype(dtype: torch.dtype) -> torch.dtype:
    """What slot tables travel in: float64 for float64 calls, else float32 (exact for ids and
    for 16-bit weights)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def slot_tables(ids2d: Tensor, combine: Tensor, tokens: Tensor, dests: Tensor,
                local_experts: int, dtype: torch.dtype | None = None) -> Tensor:
    """``[N, 2k]`` each sent row's slot table: local expert ids (``-1`` for slots elsewhere,
    and for ids ``-1``), then the slots' weights (0 elsewhere); in ``dtype`` (default
    :func:`slot_dtype`)."""
    ids = ids2d.index_select(0, tokens).to(torch.int64)
    here = ids // local_experts == dests.unsqueeze(1)  # an id -1 is no rank's: -1 // L == -1
    dtype = dtype or slot_dtype(combine.dtype)
    local = torch.where(here, ids % local_experts, -1).to(dtype)
    weights = torch.where(here, combine.index_select(0, tokens).to(dtype), 0)
    return torch.cat([local, weights], 1)


def _sent(sent: SentRows, counts: list[list[int]], width: int
          ) -> tuple[Tensor, Tensor, Tensor, list[int]]:
    """The rows of ``sent`` (``counts``: ``[K][width]`` rows to each destination, host):
    ``(tokens, destinations)`` in (micro-batch, destination) order, the gather index to
    (destination, micro-batch) order, and the rows to each destination."""
    total = sum(map(sum, counts))
    flat = sent.order[:total]
    by_dest = regroup_index(sent.counts.unsqueeze(0), (2, 1), total)
    return flat // width, flat % width, by_dest, [sum(c[d] for c in counts) for d in range(width)]


@dataclass(frozen=True)
class SlotRows:
    """What the plan needs from the slot exchange (:func:`exchange_tables`, or
    :func:`exchange_node_tables` where rows go once per node).

    Attributes:
        tokens: per micro-batch, the tokens to send (``[n_i]``, grouped by destination; by
            node for a 2-D call's first stage).
        tables: ``[R, 2k]`` the received tables, in micro-batch order (a 2-D call's: in the
            second stage's arrival order, micro-batch, forwarding local rank, source node).
        back: what returns the routing weights' gradients.
        gathers: a 2-D call's forwarder's stage-2 gather per micro-batch
            (:func:`node_gathers`); ``None`` for a flat call.
    """

    tokens: list[Tensor]
    tables: Tensor
    back: WeightGradReturn
    gathers: list[Tensor] | None = None


def exchange_tables(sent: SentRows, send: list[list[int]], recv: list[list[int]],
                    recv_rows: Tensor, ids2d: Tensor, combine: Tensor, *, local_experts: int,
                    world: int, group: Any) -> SlotRows:
    """Send every row's slot table (one exchange): what the plan needs of it.

    Args:
        send, recv: ``[K][world]`` rows sent to / received from each rank (host).
        recv_rows: ``[world(src), K]`` the same received counts on the device.
    """
    tokens, dests, by_dest, send_splits = _sent(sent, send, world)
    tables = slot_tables(ids2d, combine, tokens, dests, local_experts)
    recv_splits = [sum(r[s] for r in recv) for s in range(world)]
    arrived = exchange_slots(tables.index_select(0, by_dest), send_splits, recv_splits, group)
    arrival = regroup_index(recv_rows.unsqueeze(0), (2, 1), sum(recv_splits))
    back = WeightGradReturn(arrival, send_splits, recv_splits, tokens.index_select(0, by_dest),
                            ids2d.shape[0], ids2d.shape[1], group)
    return SlotRows(list(torch.split(tokens, [sum(s) for s in send])),
                    arrived.index_select(0, arrival), back)


def slot_ids(tables: Tensor, topk: int) -> Tensor:
    """``[n, k] int64`` the ids in slot tables' first ``k`` columns (floats, exact)."""
    return tables[:, :topk].round().to(torch.int64)


def expand(tables: Tensor, recv: list[list[int]], experts: list[list[int]], local_experts: int,
           dtype: torch.dtype) -> list[SlotRoutes]:
    """Per micro-batch, the (row, local expert) pairs of the received slot tables, grouped by
    local expert (arrival order within one), as the counts exchange counted them."""
    k = tables.shape[1] // 2
    sizes = [sum(r) for r in recv]
    ids = slot_ids(tables, k)
    bounds = list(itertools.pairwise([0, *itertools.accumulate(sizes)]))
    micro = chunk_of_token(tables.shape[0], bounds, tables.device)
    key = micro.unsqueeze(1) * (local_experts + 1) + torch.where(ids >= 0, ids, local_experts)
    order = torch.sort(key.reshape(-1), stable=True).indices
    weights = tables[:, k:].reshape(-1)
    routes, start = [], 0
    for size, counts in zip(sizes, experts):
        pairs = order[start * k:start * k + sum(counts)] - start * k
        routes.append(SlotRoutes(pairs // k, weights.index_select(0, pairs + start * k).to(dtype),
                                 pairs, size))
        start += size
    return routes


# ---- the 2-D exchange: rows once per node across the slow link, then once per rank inside


def node_destinations(hit: Tensor, nodes: int) -> Tensor:
    """``[T, nodes] bool``: which nodes hold any of each token's experts."""
    return hit.view(hit.shape[0], nodes, hit.shape[1] // nodes).any(-1)


def forwarder_tables(ids2d: Tensor, tokens: Tensor, nodes_of_rows: Tensor, local_experts: int,
                     per_node: int, dtype: torch.dtype) -> Tensor:
    """``[N, 2k]`` each node row's table for the rank forwarding it inside the node: the local
    rank (within the node) of each slot's expert, ``-1`` for slots on other nodes (the second
    half unused: one width for every table of the call's one exchange)."""
    ids = ids2d.index_select(0, tokens).to(torch.int64)
    rank = ids // local_experts
    here = rank // per_node == nodes_of_rows.unsqueeze(1)
    local = torch.where(here, rank % per_node, -1).to(dtype)
    return torch.cat([local, torch.zeros_like(local)], 1)


def node_gathers(tables: Tensor, sizes: list[int], sends: list[int], per_node: int
                 ) -> list[Tensor]:
    """Per micro-batch, the forwarder's stage-2 gather: each stage-1 row (in arrival order)
    once for each rank of the node holding any of its experts, ordered by that rank, then
    arrival (what the 2-D exchange's second stage sends)."""
    k = tables.shape[1] // 2
    gathers, start = [], 0
    for size, send in zip(sizes, sends):
        ranks = slot_ids(tables[start:start + size], k)
        hit = torch.zeros(size, per_node + 1, dtype=torch.bool, device=tables.device)
        hit.scatter_(1, torch.where(ranks >= 0, ranks, per_node), True)
        row = torch.arange(size, dtype=torch.int64, device=tables.device).unsqueeze(1)
        rank = torch.arange(per_node, dtype=torch.int64, device=tables.device).unsqueeze(0)
        key = torch.where(hit[:, :per_node], rank * size + row, per_node * size)
        gathers.append(torch.sort(key.reshape(-1)).values[:send] % max(size, 1))
        start += size
    return gathers


def exchange_node_tables(per_rank: SentRows, per_node_rows: SentRows, num_micro: int,
                         ids2d: Tensor, combine: Tensor, *, rank_rows: list[list[list[int]]],
                         node_rows: list[list[list[int]]], totals: Tensor, rank: int, nodes: int,
                         per_node: int, local_experts: int, intra_send: list[int],
                         group: Any) -> SlotRows:
    """The slot tables of a 2-D call, in one exchange on the control communicator: to each
    rank the tables of the rows it will receive from the second stage (its experts' slots, as
    :func:`exchange_tables`), and to each rank that forwards rows of this rank's (same local
    rank, another node or this one) the tables that say where inside its node each row goes.

    Args:
        per_rank, per_node_rows: this rank's rows per (token, rank) and per (token, node)
            (:func:`rows_per_destination`).
        rank_rows, node_rows: ``[src][K][world]`` and ``[src][K][nodes]`` rows per (token,
            rank) and per (token, node), every rank's (host, read with the call's counts).
        totals: the same on the device, ``[src, K, world + nodes]``.
        intra_send: per micro-batch, the rows this rank forwards inside its node (host).
    """
    world = nodes * per_node
    node, local = divmod(rank, per_node)
    dtype = slot_dtype(combine.dtype)
    tokens_r, dests_r, by_dest, a_sizes = _sent(per_rank, rank_rows[rank], world)
    tokens_n, nodes_n, by_node, b_sizes = _sent(per_node_rows, node_rows[rank], nodes)
    rank_tables = slot_tables(ids2d, combine, tokens_r, dests_r,
                              local_experts).index_select(0, by_dest)
    fwd_tables = forwarder_tables(ids2d, tokens_n, nodes_n, local_experts, per_node,
                                  dtype).index_select(0, by_node)
    a_parts, b_parts = rank_tables.split(a_sizes), fwd_tables.split(b_sizes)
    send, send_splits = [], []
    for d in range(world):  # to each rank: its rank tables, then (a forwarder) node tables
        n, dest_local = divmod(d, per_node)
        send.append(a_parts[d])
        send_splits.append(a_sizes[d])
        if dest_local == local:
            send.append(b_parts[n])
            send_splits[-1] += b_sizes[n]
    recv_a = [sum(rank_rows[s][i][rank] for i in range(num_micro)) for s in range(world)]
    recv_b = [sum(node_rows[s][i][node] for i in range(num_micro))
              if s % per_node == local else 0 for s in range(world)]
    arrived = exchange_slots(torch.cat(send), send_splits,
                             [a + b for a, b in zip(recv_a, recv_b)], group)
    pieces = arrived.split([n for ab in zip(recv_a, recv_b) for n in ab])
    a_in, b_in = torch.cat(pieces[0::2]), torch.cat(pieces[1::2])
    # rank tables: (source node, source local, micro) -> (micro, forwarding local, source node)
    a_lengths = totals[:, :, rank].reshape(1, nodes, per_node, num_micro)
    arrival = regroup_index(a_lengths, (3, 2, 1), sum(recv_a))
    # node tables (from this local rank of each node): (source node, micro) -> (micro, node)
    b_lengths = totals[local::per_node, :, world + node].reshape(1, nodes, num_micro)
    stage1 = b_in.index_select(0, regroup_index(b_lengths, (2, 1), sum(recv_b)))
    sizes = [sum(node_rows[n * per_node + local][i][node] for n in range(nodes))
             for i in range(num_micro)]
    back = WeightGradReturn(arrival, a_sizes, recv_a, tokens_r.index_select(0, by_dest),
                            ids2d.shape[0], ids2d.shape[1], group)
    tokens = list(torch.split(tokens_n, [sum(row) for row in node_rows[rank]]))
    return SlotRows(tokens, a_in.index_select(0, arrival), back,
                    node_gathers(stage1, sizes, intra_send, per_node))
