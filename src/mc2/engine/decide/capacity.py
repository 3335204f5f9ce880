"""Capacity mode (``MC2Config(capacity=N)``): a call that reads nothing to the host.

The normal call reads split sizes to the host twice (the handshake and the counts): on a GPU
each read stalls the host until the device catches up, and makes the call impossible to capture
in a CUDA graph. Here every size is fixed by the configuration and the shapes:

- each rank sends every other rank a *slab* of ``N`` rows per call, split over the
  micro-batches (:func:`~mc2.engine.decide.routing.micro_batch_bounds` of ``N``), and token
  ``t`` belongs to the micro-batch whose share of the slab holds position ``t``
  (:func:`token_bounds`); a token goes at most once to each rank (as with ``dedup``), so a
  rank with at most ``N`` tokens never overflows, at any K;
- beside each row travels its slot table (local expert ids, weights) and the sender's error
  count, packed into the same bytes: a small batch is one dispatch and one combine, plus the
  trusted handshake in host memory where the group has a host backend
  (:func:`~mc2.engine.decide.call_plan.plan_call`: it makes a configuration that one rank
  changes an error on every rank, reading nothing from a device);
- the receiving rank computes every local expert on every received row and weights them with
  the table (:mod:`mc2.engine.passes.travel.slabs`): no per-expert count is needed on the host, at
  the price of ``local_experts / topk`` times the expert work of the rows that need it, which
  for the small batches this mode is for is cheaper than a host read.

A rank with more rows for one destination than its slab holds *overflows*. Detected on the
device and never silent: every slab carries its sender's count of rows that did not fit (and of
expert ids out of range), so every rank learns the group's total from the rows it receives.
``overflow="raise"`` (the default) adds it to the group's counter on the device
(:func:`record_errors`), and :class:`~mc2.engine.decide.overflow.CapacityOverflow` is raised on
every rank at the next handshake on the group or at :func:`mc2.check_overflow`, whichever comes
first (:mod:`mc2.engine.decide.overflow` says why there), never by a device-side assertion,
which on CUDA would leave the context unusable. The call that overflowed returns without those
rows. ``overflow="drop"`` drops them (their experts contribute nothing, GShard's capacity
factor) and adds them to :func:`dropped_rows`.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mc2.device.streams import full_device
from mc2.engine.compute.experts import ExpertWeights
from mc2.engine.compute.module_experts import ModuleExperts
from mc2.engine.decide.dedup import slot_tables as rows_slot_tables
from mc2.engine.decide.gemm_strategy import grouped_problem
from mc2.engine.decide.overflow import add_errors
from mc2.engine.decide.routing import micro_batch_bounds
from mc2.engine.transport.backend import default_device_type
from mc2.engine.transport.group_state import group_state
from mc2.engine.transport.comm import FlatExchange


class DroppedRows(dict[torch.device, Tensor]):
    """Rows a group's ``overflow="drop"`` calls left out, a device tensor by device (a slot
    of the group's state)."""


def dropped_rows(device: torch.device | str | None = None, group: Any = None) -> Tensor:
    """How many (token, rank) rows of this rank's tokens capacity calls with
    ``overflow="drop"`` on ``group`` (``None``: the default group) left out so far, in this
    process (a device tensor: reading it is the caller's synchronisation). ``device``: where
    the calls ran, ``None`` for the current accelerator (else the CPU); ``"cuda"`` is the
    current CUDA device, as a call's ``cuda:0`` is (before, a lookup by ``"cuda"``, or the old
    default ``"cpu"`` on a GPU, found a new zero: drops were invisible there)."""
    device = full_device(default_device_type() if device is None else device)
    counts = group_state(group).of(DroppedRows)
    if device not in counts:  # made once (a zero made at every lookup is an allocation each)
        counts[device] = torch.zeros((), dtype=torch.int64, device=device)
    return counts[device]


def sorts_slabs(experts: ExpertWeights | ModuleExperts) -> bool:
    """Whether a capacity call runs its experts as sorted pairs with ``grouped_mm`` (experts
    with a hand-written grouped backward, mc2's SwiGLU, where a grouped kernel serves the
    dtype without reading its offsets back) rather than every row through every expert."""
    return experts.has_grouped_backward and \
        grouped_problem(experts.dtype, experts.device) is None


# a slab row's header: the sender's two error counts and its configuration's fingerprint
HEADER = 3


def fingerprint_of(values: tuple) -> int:
    """A 32-bit fingerprint of the values the ranks agreed on in a capacity call's first call
    (exact in a float64 header): every slab carries its sender's, so a rank that later calls
    with other options than its peers is seen by every rank that receives its slabs (and sees
    theirs), with no read and no collective of its own."""
    return zlib.crc32(repr(values).encode())


@dataclass(frozen=True)
class CapacityRoute:
    """One micro-batch of a capacity call, as this rank sees it.

    Attributes:
        slot_token: ``[world * C]`` the token of each row this rank sends (its slab to rank
            ``d`` is rows ``d*C .. (d+1)*C``); ``T`` (one past the last token) for an empty row.
        tables: ``[world * C, 2k + HEADER]`` each sent row's slot table: local expert ids (``-1``
            where the slot's expert is elsewhere, or the row is empty), the slots' weights, and
            the sender's two error counts (rows that did not fit; ids out of range).
        exchange: the slabs' exchange (equal slabs: no split sizes).
    """

    slot_token: Tensor
    tables: Tensor
    exchange: FlatExchange


@dataclass(frozen=True)
class CapacityHandle:
    """The routes of every micro-batch (what the pipeline's scheduler iterates over)."""

    num_tokens: int
    topk: int
    world_size: int
    local_experts: int
    micro_batches: tuple[CapacityRoute, ...]
    overflow: str
    capacity: int = 0
    group: Any = None
    fingerprint: int = 0

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches)


def token_bounds(tokens: int, capacity: int, micro_batches: int) -> list[tuple[int, int]]:
    """Each micro-batch's tokens: the slabs' split of ``capacity`` applied to token positions
    (the last micro-batch also takes any tokens past ``capacity``). Splitting the tokens on
    their own would not do: a micro-batch of ``T <= capacity`` tokens can be larger than its
    slab (``T = 297``, ``capacity = 298``, K = 16: 20 tokens for a slab of 19), and a rank
    with no more tokens than the capacity must never overflow, at any K."""
    bounds = [(min(a, tokens), min(b, tokens)) for a, b in micro_batch_bounds(capacity,
                                                                              micro_batches)]
    bounds[-1] = (bounds[-1][0], tokens)
    return bounds


def slot_tables(ids_padded: Tensor, combine_padded: Tensor, slot_token: Tensor, world: int,
                capacity: int, local_experts: int, errors: Tensor, fingerprint: int = 0
                ) -> Tensor:
    """``[world * C, 2k + HEADER]`` float64 tables of the rows of one micro-batch's slabs: the
    slot tables of rows once per destination (:func:`mc2.engine.decide.dedup.slot_tables`;
    empty rows' ids are ``-1``), then the header (``errors``: ``[2]`` this rank's rows that did
    not fit, ids out of range; ``fingerprint``: this rank's configuration,
    :func:`fingerprint_of`)."""
    dest = torch.arange(world, device=ids_padded.device).repeat_interleave(capacity)
    tables = rows_slot_tables(ids_padded, combine_padded, slot_token, dest, local_experts,
                              torch.float64)
    header = torch.cat([errors.to(torch.float64), errors.new_full((1,), fingerprint,
                                                                   dtype=torch.float64)])
    return torch.cat([tables, header.unsqueeze(0).expand(tables.shape[0], HEADER)], 1)


def plan_routes(ids2d: Tensor, combine: Tensor, *, capacity: int, micro_batches: int,
                world: int, local_experts: int, group: Any, style: Any,
                overflow: str, fingerprint: int = 0) -> CapacityHandle:
    """Every micro-batch's slabs, built on the device from the ids (no read, no upload).

    Rows beyond a slab's capacity (and ids out of range, clamped) are counted into every
    slab's header; with ``overflow="drop"`` they are also added to :func:`dropped_rows`.
    """
    tokens, topk = ids2d.shape
    device = ids2d.device
    experts = world * local_experts
    ids = ids2d.to(torch.int64)
    bad = ((ids < -1) | (ids >= experts)).sum()  # -1: no expert (a dropped slot), no row
    ids = torch.where((ids >= 0) & (ids < experts), ids, -1)
    ids_padded = torch.cat([ids, ids.new_full((1, topk), -1)])
    combine_padded = torch.cat([combine, combine.new_zeros((1, topk))])
    routes, dropped = [], torch.zeros((), dtype=torch.int64, device=device)
    for (start, stop), (c0, c1) in zip(token_bounds(tokens, capacity, micro_batches),
                                       micro_batch_bounds(capacity, micro_batches)):
        size, n = c1 - c0, stop - start
        hit = torch.zeros(n, world + 1, dtype=torch.bool, device=device)
        mine = ids[start:stop]
        hit.scatter_(1, torch.where(mine >= 0, mine // local_experts, world), True)
        hit = hit[:, :world]
        position = torch.cumsum(hit.to(torch.int64), 0) - 1
        fits = hit & (position < size)
        dropped = dropped + (hit & ~fits).sum()
        dump = world * size  # one slot past the slabs, cut off below
        where = torch.where(fits, torch.arange(world, device=device) * size + position, dump)
        token = torch.arange(start, stop, device=device).unsqueeze(1).expand(n, world)
        slot_token = torch.full((dump + 1,), tokens, dtype=torch.int64, device=device)
        slot_token.scatter_(0, where.reshape(-1), token.reshape(-1))
        routes.append((slot_token[:dump], size))
    errors = torch.stack([dropped, bad])
    if overflow == "drop":
        dropped_rows(device, group).add_(dropped)
    return CapacityHandle(tokens, topk, world, local_experts, tuple(
        CapacityRoute(slot_token, slot_tables(ids_padded, combine_padded, slot_token, world,
                                              size, local_experts, errors, fingerprint),
                      FlatExchange(None, None, group, style=style))
        for slot_token, size in routes), overflow, capacity, group, fingerprint)


def record_errors(tables: Tensor, handle: CapacityHandle) -> None:
    """Add the group's error counts, read from the headers of the received ``tables`` (every
    sender's), to the group's counter on the device: no read, no assertion; raised later on
    every rank alike (:mod:`mc2.engine.decide.overflow`)."""
    world, topk = handle.world_size, handle.topk
    header = tables.view(world, -1, tables.shape[-1])[:, 0, 2 * topk:]  # each sender's
    mismatched = (header[:, 2] != handle.fingerprint).sum().reshape(1)
    errors = torch.cat([header[:, :2].sum(0), mismatched.to(header.dtype)])
    add_errors(handle.group, errors, overflow=handle.overflow, capacity=handle.capacity)
