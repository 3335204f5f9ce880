"""Capacity mode's errors, counted on the device and raised where the host reads anyway.

A capacity call (:mod:`mc2.engine.decide.capacity`) reads nothing to the host, so it cannot
raise what only the data shows: rows that did not fit their slab (``overflow="raise"``) and
expert ids out of range. A device-side assertion could, but on CUDA it leaves the context
unusable (every later CUDA call of the process fails), so it is not used. Instead each call adds
the group's totals, which every rank computes alike from the headers of the slabs it received,
to a counter on the device (one ``add_``, also inside a CUDA graph: a replay adds again), and
the error is raised, as :class:`CapacityOverflow` (a ``ValueError``), at the first of:

0. on a CPU (:func:`raises_at_once`), the end of the overflowing call's forward, once every
   exchange of it is done: reading host memory synchronises nothing and nothing is captured
   there, so the error comes at once;
1. the next handshake on the same group (:func:`mc2.engine.decide.validation.agree`): the first
   host read of the next normal call, or of a capacity call's first call of a configuration.
   The counter travels in the handshake's vector, so it costs no read of its own;
2. :func:`check_overflow`, which a program of capacity calls only (a decoder captured in a CUDA
   graph) calls where it reads the host anyway (a logging step's ``loss.item()``): one read.

Why these points are right by construction: an error must be raised on every rank of the group
at the same point of the program, or the ranks that raise stop issuing collectives and their
peers wait for them. Both points are reached by every rank alike (the handshake is a collective
of the group, and ranks call ``check_overflow`` at the same place of the same program), and
every rank holds the same totals. A point that depended on timing (the first host read to find
the counter's copy arrived) would not be. The counter is reset when it raises.

The counters are made by a group's first capacity call (always eager: it runs the handshake),
so a graph captured later adds into memory made outside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mc2.device.streams import capturing, current_stream
from mc2.engine.transport.group_state import group_state, known_state
from mc2.engine.transport.host import read, read_host_memory


# what a counter holds: rows that did not fit, ids out of range, slabs of another configuration
COUNTS = 3


class CapacityOverflow(ValueError):
    """Capacity calls on a group had rows that did not fit (``overflow="raise"``), expert
    ids out of range, or slabs from a rank whose configuration differed.

    Attributes:
        rows: (token, rank) rows left out of their slabs, summed over the group's senders.
        bad_ids: expert ids out of range ``[0, num_experts)``, likewise.
        capacity: the ``capacity`` of the last such call.
        mismatched: slabs received whose configuration fingerprint was not this rank's (a
            rank changed its capacity-mode options alone after the first call agreed them).
    """

    def __init__(self, rows: int, bad_ids: int, capacity: int, mismatched: int = 0) -> None:
        self.rows, self.bad_ids, self.capacity = rows, bad_ids, capacity
        self.mismatched = mismatched
        parts = []
        if mismatched:
            parts.append(f"{mismatched} slabs came from ranks whose configuration differs from "
                         "this rank's (ranks disagree on a capacity-mode option: overflow, "
                         "gemm, timeout, check_finite, ...); every rank must pass the same")
        if rows:
            parts.append(f"{rows} (token, rank) rows did not fit their slabs (capacity="
                         f"{capacity}, overflow='raise'), so their experts are missing from "
                         "those calls' outputs; raise capacity, or pass overflow='drop' to drop "
                         "and count them")
        if bad_ids:
            parts.append(f"{bad_ids} expert ids were out of range [0, num_experts) on some rank")
        super().__init__("mc2 capacity mode, in calls on this group since the last check: "
                         + "; ".join(parts))


@dataclass
class _Counter:
    """One group's counts on one device: ``[COUNTS]`` int64 (rows that did not fit, ids out
    of range, slabs of another configuration), the capacity of the last call that added to
    them, and the stream of the last add, read or reset (``None`` on a CPU)."""

    counts: Tensor  # [COUNTS]
    capacity: int = 0
    stream: Any = None

    def ordered(self) -> Tensor:
        """The counts, for an add, read or reset on the current stream, which first waits
        for the stream of the one before (capacity calls on a side stream, the check on
        another: a read would miss the adds still queued there, a reset race them; ranks
        would then disagree on raising). Nothing on a CPU, nor inside a capture, whose stream
        waited for the work before it when the capture began."""
        device = self.counts.device
        now = current_stream(device)
        if now is None:
            return self.counts
        if self.stream is not None and self.stream != now and not capturing(device):
            now.wait_stream(self.stream)
        self.stream = now
        return self.counts


class OverflowCounters(dict[torch.device, "_Counter"]):
    """A group's :class:`_Counter` by device (a slot of the group's state)."""


def add_errors(group: Any, errors: Tensor, *, overflow: str, capacity: int) -> None:
    """Add a call's group totals ``errors`` (``[3]``: rows that did not fit, ids out of range,
    slabs of another configuration; any dtype holding whole numbers) to the group's counter
    on their device, on the device: no read. With ``overflow="drop"`` the rows that did not fit
    are not errors (they are counted in :func:`mc2.engine.decide.capacity.dropped_rows`)."""
    counters = group_state(group).of(OverflowCounters)
    counter = counters.get(errors.device)
    if counter is None:
        counter = counters[errors.device] = _Counter(torch.zeros(COUNTS, dtype=torch.int64,
                                                                 device=errors.device))
    counts = errors.round().to(torch.int64)
    if overflow == "raise":
        counter.ordered().add_(counts)
    else:
        counter.ordered()[1:].add_(counts[1:])
    counter.capacity = capacity


def pending(group: Any, device: torch.device) -> Tensor:
    """``[COUNTS]`` int64 on ``device``: the group's counts there (zeros when no capacity call ran
    on it): what the handshake carries. A counter on another device is not read (that would be
    a read of its own); :func:`check_overflow` reads it."""
    state = known_state(group)
    counters = state.held(OverflowCounters) if state is not None else None
    counter = counters.get(torch.device(device)) if counters is not None else None
    return torch.zeros(COUNTS, dtype=torch.int64, device=device) if counter is None \
        else counter.ordered()


def raise_counted(group: Any, rows: int, bad_ids: int, mismatched: int = 0) -> None:
    """The handshake found ``rows``, ``bad_ids`` and ``mismatched`` (the group's, read with its
    vector): reset the group's counters and raise :class:`CapacityOverflow`, on every rank
    alike."""
    if not (rows or bad_ids or mismatched):
        return
    capacity = 0
    for counter in group_state(group).of(OverflowCounters).values():
        counter.ordered().zero_()
        capacity = counter.capacity
    raise CapacityOverflow(rows, bad_ids, capacity, mismatched)


def raises_at_once(device: torch.device) -> bool:
    """Whether a capacity call on ``device`` raises its own overflow at the end of its forward
    (a CPU: the read costs nothing) rather than at the next point the host reads anyway."""
    return torch.device(device).type == "cpu"


def check_overflow(group: Any = None) -> None:
    """Raise :class:`CapacityOverflow` if capacity calls on ``group`` (``None``: the default
    group) had rows that did not fit with ``overflow="raise"``, or expert ids out of range,
    since the last check; then the counts start again from zero.

    One host read per device the group's capacity calls ran on (a synchronisation on an
    accelerator): call it on every rank of the group at the same point, where the host reads
    anyway (see the module docstring); every rank then raises alike. The next handshake on the
    group raises the same without being asked.
    """
    _check(group, read)


def check_at_once(group: Any) -> None:
    """:func:`check_overflow` at the end of a CPU capacity call (:func:`raises_at_once`): the
    counters are host memory, read without a synchronisation (and so not counted as one)."""
    _check(group, read_host_memory)


def _check(group: Any, reader: Any) -> None:
    totals, capacity = [0] * COUNTS, 0
    for device, counter in group_state(group).of(OverflowCounters).items():
        if reader is read_host_memory and device.type != "cpu":
            continue
        if device.type != "cpu":  # a graph's replays add on whatever stream replayed it
            torch.accelerator.synchronize(device)
        counts = counter.ordered()
        found = reader(counts)
        if any(found):
            counts.zero_()
            totals = [a + b for a, b in zip(totals, found)]
            capacity = counter.capacity
    if any(totals):
        raise CapacityOverflow(totals[0], totals[1], capacity, totals[2])
