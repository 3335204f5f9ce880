"""Routing plan: which local (token, slot) pairs go where, per micro-batch.

Everything here is local bookkeeping on integer tensors, computed once per call and reused by
the backward pass (the gradient travels the same routes in the same micro-batches). The only
communication is the single up-front exchange of per-micro-batch counts (see
:func:`mc2.engine.comm.exchange_counts`), so the pipeline never stops for a small message per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from .comm import FlatExchange


@dataclass(frozen=True)
class MicroBatchRoute:
    """The routes of one micro-batch.

    Attributes:
        pair_order: ``[n] int64`` pair indices (``token * topk + slot``) sorted by global expert
            id; the dispatch send buffer is ``x[pair_order // topk]`` in this order.
        token_index: ``[n] int64`` ``pair_order // topk`` (the source row of each sent row).
        send_splits: rows sent to each rank (``len == world``), i.e. grouped by destination.
        recv_splits: rows received from each rank (``len == world``).
        expert_counts: rows each *local* expert processes (``len == local_experts``).
        expert_gather: ``[r] int64`` gather index that turns the received rows (in arrival
            order: by source rank for a flat exchange, by forwarding local rank and source node
            for a two-stage one; then local expert) into expert-grouped order (local expert,
            then source rank); ``None`` when no reordering is needed.
        exchange: moves this micro-batch's rows (``dispatch``) and back (``combine``): a
            :class:`~mc2.engine.comm.FlatExchange` or a :class:`~mc2.engine.hierarchy.TwoStageExchange`.
    """

    pair_order: Tensor
    token_index: Tensor
    send_splits: list[int]
    recv_splits: list[int]
    expert_counts: list[int]
    expert_gather: Tensor | None
    exchange: Any = None


@dataclass(frozen=True)
class DispatchHandle:
    """Everything the combine and the backward need to retrace a dispatch (DeepEP-style handle).

    Attributes:
        num_tokens: local tokens ``T`` of this rank (may be 0).
        topk: expert slots per token.
        world_size: ranks in the expert-parallel group.
        local_experts: experts held by each rank.
        micro_batches: the routes, one per micro-batch, the same count on every rank.
    """

    num_tokens: int
    topk: int
    world_size: int
    local_experts: int
    micro_batches: tuple[MicroBatchRoute, ...]

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
    if num_micro_batches <= 2:
        return [1] * num_micro_batches
    return [1] + [2] * (num_micro_batches - 2) + [1]


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
        cumulative = [sum(weights[:i + 1]) for i in range(num_micro_batches)]
        stops = [num_tokens * c // total for c in cumulative]
    return list(zip([0] + stops[:-1], stops))


def local_send_counts(
    expert_ids: Tensor, num_experts: int, num_micro_batches: int
) -> tuple[Tensor, Tensor]:
    """Sort the pairs by (micro-batch, expert) and count them.

    Args:
        expert_ids: ``[T, topk]`` integer global expert ids, already validated.
        num_experts: ``E``, the global expert count.
        num_micro_batches: ``K``.

    Returns:
        ``(order, counts)``: ``order`` ``[T * topk] int64`` pair indices sorted by micro-batch
        then expert (stable, so equal experts keep token order); ``counts`` ``[K, E] int64``.
    """
    num_tokens, topk = expert_ids.shape
    flat = expert_ids.reshape(-1).to(torch.int64)
    chunk_of_token = torch.empty(num_tokens, dtype=torch.int64, device=flat.device)
    for i, (start, stop) in enumerate(micro_batch_bounds(num_tokens, num_micro_batches)):
        chunk_of_token[start:stop] = i
    key = chunk_of_token.repeat_interleave(topk) * num_experts + flat
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=num_micro_batches * num_experts)
    return order, counts.view(num_micro_batches, num_experts)


def expert_grouping_index(recv_counts: Tensor, arrival: list[int] | None = None
                          ) -> Tensor | None:
    """Gather index from arrival order to expert-grouped order (expert, then source rank).

    Args:
        recv_counts: ``[world, local_experts] int64`` rows received per (source rank, local
            expert) for one micro-batch.
        arrival: the source ranks in the order their blocks arrive (default: 0, 1, ...).
    """
    world, local = recv_counts.shape
    identity = arrival is None or arrival == list(range(world))
    if local == 1 or (identity and world == 1):
        return None
    order = torch.tensor(arrival if arrival is not None else range(world), dtype=torch.int64)
    position = torch.empty_like(order)
    position[order] = torch.arange(world)
    arranged = recv_counts[order]  # blocks in arrival order
    lengths = arranged.reshape(-1)
    starts = (torch.cumsum(lengths, 0) - lengths).view(world, local)[position]  # by source
    lengths_t = recv_counts.t().reshape(-1)  # blocks in expert-grouped order (l, source)
    starts_t = starts.t().reshape(-1)
    total = int(lengths.sum())
    dest_starts = torch.cumsum(lengths_t, 0) - lengths_t
    offset = torch.repeat_interleave(starts_t - dest_starts, lengths_t, output_size=total)
    return offset + torch.arange(total, dtype=torch.int64, device=recv_counts.device)


def build_handle(
    expert_ids: Tensor,
    order: Tensor,
    send_counts: Tensor,
    recv_counts: Tensor,
    *,
    world_size: int,
    local_experts: int,
    group: Any = None,
    two_stage: Callable[[int], tuple[Any, list[int]]] | None = None,
    workspace: Any = None,
) -> DispatchHandle:
    """Assemble the per-micro-batch routes from the local sort and the exchanged counts.

    Args:
        expert_ids: ``[T, topk]`` the validated expert ids.
        order: ``[T * topk]`` from :func:`local_send_counts`.
        send_counts: ``[K, E]`` from :func:`local_send_counts`.
        recv_counts: ``[world, K, local_experts]`` rows each source rank sends to this rank's
            experts, per micro-batch (from :func:`mc2.engine.comm.exchange_counts`).
        group: the group the flat exchanges run on.
        two_stage: ``i -> (exchange, arrival order)`` for a hierarchical exchange; ``None``:
            flat.
        workspace: the :class:`~mc2.engine.workspace.Workspace` flat exchanges receive into.
    """
    num_tokens, topk = expert_ids.shape
    num_micro = send_counts.shape[0]
    send_cpu = send_counts.view(num_micro, world_size, local_experts).sum(-1).cpu()
    recv_cpu = recv_counts.cpu()
    sizes = send_cpu.sum(-1).tolist()
    routes = []
    for i, pairs in enumerate(torch.split(order, sizes)):
        per_expert = recv_cpu[:, i, :]
        send_splits, recv_splits = send_cpu[i].tolist(), per_expert.sum(-1).tolist()
        if two_stage is None:
            exchange, arrival = FlatExchange(send_splits, recv_splits, group, workspace), None
        else:
            exchange, arrival = two_stage(i)
        gather = expert_grouping_index(per_expert, arrival)
        routes.append(
            MicroBatchRoute(
                pair_order=pairs,
                token_index=pairs // topk,
                send_splits=send_splits,
                recv_splits=recv_splits,
                expert_counts=per_expert.sum(0).tolist(),
                expert_gather=None if gather is None else gather.to(order.device),
                exchange=exchange,
            )
        )
    return DispatchHandle(
        num_tokens=num_tokens,
        topk=topk,
        world_size=world_size,
        local_experts=local_experts,
        micro_batches=tuple(routes),
    )
