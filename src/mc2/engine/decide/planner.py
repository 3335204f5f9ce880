"""Choosing K: a cost model of the pipeline, fed by measurements on the running group.

Why a model and not a rule: the article's rule (K = number of experts) ignores what splitting
costs. Every micro-batch runs every local expert's GEMMs once more, so a small micro-batch pays
the expert weights' memory traffic again (forward reads, backward reads and gradient
read-modify-writes) for a handful of rows; every extra All-to-All pays the link's latency; and
on a busy host the transfer threads slow the compute down. The model below has one term for each,
each measured once per (hidden, ffn, local experts, dtype, group) and cached in the planner:

* expert compute, forward + backward, of ``r`` rows on one expert: ``a + b * r`` seconds
  (``a``: per-expert per-micro-batch cost, ``b``: per-row cost);
* one All-to-All moving ``n`` bytes off-rank per rank: ``alpha + beta * n`` seconds;
* interference: while a transfer runs under compute, compute slows by ``gamma`` times the
  transfer time;
* bookkeeping: the gathers, scatters and permutations of each routed row, ``rho`` seconds per
  row, whatever K.
* wire format (:mod:`mc2.engine.transport.wire`): a transfer moves the format's bytes per row,
  and encoding and decoding cost ``kappa`` seconds per routed row, on the compute thread.
  ``kappa`` is measured per format and width, never assumed: on a small CPU it can eat what
  the fewer bytes save, and then the planner says so (:class:`WireFormatWarning`).

For ``R`` rows per rank split into ``K`` micro-batches over ``L`` local experts (tapered ends,
:func:`mc2.engine.decide.routing.micro_batch_fractions`), one pass (forward: 1/3 of the expert math, backward:
2/3) with compute ``c_i`` and per-transfer time ``x_i`` for micro-batch ``i`` takes::

    serial (K = 1, synchronous):  sum(c_i + 2 x_i)
    overlapped:                   x_0 + sum(c_i + max(0, l_i - c_i) + gamma min(l_i, c_i)) + x_K-1
                                  with l_i = x_i+1 + x_i-1, the transfers under c_i

(:func:`mc2.engine.decide.pipeline_cost.overlapped_pass`: the first dispatch and the last combine cannot
hide; in between, two transfers run under each micro-batch's compute). K = 1 is kept unless
the best K is predicted to gain at least ``min_gain``. All ranks agree: the measurements are
reduced to the group's maximum before use, and the token count is the group-wide maximum the
call's handshake already agreed on.
"""

from __future__ import annotations

import logging
import statistics
import warnings
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from mc2.device.rng import kept_rng
from mc2.device import streams
from mc2.device.clock import Interval, clock_for
from mc2.engine.transport.comm import all_reduce_max, all_to_all_rows, barrier, group_key, group_size
from mc2.engine.compute.experts import ExpertWeights
from mc2.engine.compute.module_experts import ModuleExperts
from mc2.engine.transport.group_state import group_state, live_states
from mc2.engine.transport.host import read, upload
from mc2.engine.decide.batch_split import MIN_TOKENS, BatchOverlapDecision
from mc2.engine.decide.chance import ModelError, ruled_out, with_a_chance
from mc2.engine.decide.pipeline_cost import training_step
from mc2.engine.decide.routing import micro_batch_fractions
from mc2.engine.decide.trials import (Candidate, contenders, describe, trial_stats,
                                      trial_winner, untried_neighbours)
from mc2.engine.transport.sizes import bucket
from mc2.engine.transport.wire import PLAIN_PAIR, WirePair, describe_pair


SERIAL = Candidate.of(1)  # K = 1 in the requested rows: always tried, the baseline
# Re-check rounds while the best lead is inside the noise. Two, not one: one round still
# locked a candidate clearly slower in the steady state, their trials' spreads overlapping.
RECHECK_ROUNDS = 2
# A lead under this fraction is re-checked whatever the trials' spread says
# (:func:`mc2.engine.decide.trials.contenders`).
RECHECK_WITHIN = 0.10
_log = logging.getLogger(__name__)


def _shape_text(weights: ExpertWeights | ModuleExperts, group: Any) -> str:
    return (f"hidden {weights.hidden}, {weights.local_experts} local experts, {weights.dtype}, "
            f"{group_size(group)} ranks")

@dataclass(frozen=True)
class Calibration:
    """Measured constants of the cost model (seconds; the group's maximum over ranks)."""

    expert_fixed_s: float  # a: per expert per micro-batch, forward + backward
    expert_row_s: float  # b: per row, forward + backward
    link_latency_s: float  # alpha: per All-to-All
    link_s_per_byte: float  # beta: per byte sent off-rank by each rank
    interference: float  # gamma: compute slowdown per second of concurrent transfer
    row_overhead_s: float = 0.0  # per routed row, forward + backward: gathers, scatters, permutes


@dataclass(frozen=True)
class Prediction:
    """Predicted forward + backward time of one K (seconds)."""

    micro_batches: int
    step_s: float
    compute_s: float
    comm_s: float  # total All-to-All time, hidden or not
    exposed_comm_s: float


@dataclass(frozen=True)
class Workload:
    """What the model needs to know about one call (all values agreed by the group)."""

    rows_per_rank: int  # max tokens x topk
    hidden: int
    local_experts: int
    world_size: int
    element_size: int
    wire_bytes_per_row: float | None = None  # mean of dispatch and combine; None: hidden x element
    codec_s_per_row: float = 0.0  # kappa: encode + decode of all four transfers, per routed row
    sent_share: float = 1.0  # rows on the link per routed row (< 1 where rows go once per
    # rank; > 1 for capacity mode's full slabs)

    def off_rank_bytes(self, rows: float) -> float:
        """Bytes leaving the rank for ``rows`` routed rows (pairs)."""
        share = (self.world_size - 1) / self.world_size if self.world_size > 1 else 0.0
        per_row = self.wire_bytes_per_row
        if per_row is None:
            per_row = self.hidden * self.element_size
        return rows * self.sent_share * per_row * share


def predict(cal: Calibration, work: Workload, k: int, *, overlap: bool = True) -> Prediction:
    """The model's step time for ``k`` micro-batches (see the module docstring)."""
    compute, transfer = [], []
    for fraction in micro_batch_fractions(k):
        rows = work.rows_per_rank * fraction
        per_expert = rows / work.local_experts
        compute.append(work.local_experts * (cal.expert_fixed_s + cal.expert_row_s * per_expert)
                       + (cal.row_overhead_s + work.codec_s_per_row) * rows)
        moved = cal.link_latency_s + cal.link_s_per_byte * work.off_rank_bytes(rows)
        transfer.append(moved if work.world_size > 1 else 0.0)
    step, exposed = training_step(compute, transfer, overlap=overlap,
                                  interference=cal.interference)
    return Prediction(k, step, sum(compute), 4 * sum(transfer), exposed)


def predicted_steps(cal: Calibration, work: Workload, candidates: Sequence[int],
                    max_tokens: int) -> dict[int, float]:
    """The model's step seconds of every candidate K ``max_tokens`` tokens allow (K = 1
    always), in ascending K."""
    allowed = sorted({k for k in candidates if 1 <= k <= max(1, max_tokens)} | {1})
    return {k: predict(cal, work, k).step_s for k in allowed}


def choose(cal: Calibration, work: Workload, candidates: Sequence[int], min_gain: float,
           max_tokens: int) -> int:
    """The K to use: the predicted best, or 1 when the best does not gain ``min_gain``."""
    preds = predicted_steps(cal, work, candidates, max_tokens)
    best = min(preds, key=preds.__getitem__)  # ascending K: the smallest of equals
    return best if preds[best] < preds[1] * (1 - min_gain) else 1


def _fit_line(x0: float, t0: float, x1: float, t1: float) -> tuple[float, float]:
    slope = max((t1 - t0) / (x1 - x0), 0.0)
    return max(t0 - slope * x0, 0.0), slope


class WireFormatWarning(UserWarning):
    """The chosen wire format is predicted to cost more (encoding) than it saves (bytes)."""


def _measure_codec(wire: WirePair, hidden: int, dtype: torch.dtype,
                   device: torch.device, repeats: int) -> float:
    """Seconds per routed row to encode and decode the four transfers of a forward + backward
    (a wire format at least one way: :meth:`Planner.codec_cost` answers 0 for none)."""
    rows = 1024
    x = torch.randn(rows, hidden, dtype=dtype, device=device)

    def round_trips() -> None:
        for fmt in wire:
            fmt.decode(fmt.encode(x), hidden, dtype)

    round_trips()
    return 2 * clock_for(device).median(round_trips, repeats) / rows


def _measure_row_overhead(hidden: int, dtype: torch.dtype, device: torch.device,
                          repeats: int, rows: int = 2048) -> float:
    """Seconds per routed row for the row moves of a forward + backward.

    Per row and pass the pipeline gathers it (``index_select``), reorders it to expert order and
    back, and scatters the result (``index_copy_`` / ``index_add_``): about four row copies a
    pass, measured here as one gather + one copy + one add, twice, on ``rows`` rows.
    """
    x = torch.randn(rows, hidden, dtype=dtype, device=device)
    out = torch.zeros_like(x)
    index = torch.randperm(rows, device=device)

    def moves() -> None:
        y = x.index_select(0, index)
        out.index_copy_(0, index, y)
        out.index_add_(0, index, y)

    moves()
    return 2 * clock_for(device).median(moves, repeats) / rows


@dataclass(frozen=True)
class Choice:
    """The K for one call.

    Attributes:
        micro_batches: K.
        trial: this call is one of ``"auto"``'s bounded trials (see :class:`Planner`).
        settling: a trial call that is not timed: it runs a K the previous call did not, so
            that the next, timed, call of that K is in its steady state.
        on_pass_done: ``(phase, interval)`` to report each pass's time to (trials only).
        plain_rows: the requested wire format measured slower than rows in the compute dtype
            for this shape, so this call sends plain rows (the planner warned once).
        decided: on the call at which ``"auto"`` locked its K, the line saying why
            (:func:`mc2.engine.decide.trials.describe`), and on the call at which the drift
            guard re-plans, why; for the timeline.
    """

    micro_batches: int
    trial: bool = False
    on_pass_done: Callable[[str, Interval], None] | None = None
    plain_rows: bool = False  # send rows in the compute dtype, not the requested wire format
    decided: str | None = None
    settling: bool = False  # an untimed trial call: the K changed (:meth:`_Trials.next_call`)


@dataclass
class _Trials:
    """``"auto"``'s measurements of the candidate K of one shape, then its decision
    (:mod:`mc2.engine.decide.trials`)."""

    candidates: tuple[Candidate, ...]
    samples: dict[Candidate, list[dict[str, Interval]]]  # one {phase: time} per trial call
    targets: dict[Candidate, int]  # calls each active candidate must have had before the next
    # decision
    ladder: tuple[int, ...] = ()  # every K this shape allows, ascending (where neighbours come from)
    locked: Candidate | None = None
    active: tuple[Candidate, ...] = ()  # the candidates still being measured
    rechecks: int = 0  # re-check rounds run inside the noise (at most RECHECK_ROUNDS)
    widened: tuple[Candidate, ...] | None = None  # the neighbours tried after the first round
    stats: tuple = ()  # the TrialStats the lock was decided on
    phases: tuple[str, ...] = ("forward",)  # what the trial times summed (:meth:`times`)
    steady: list[dict[str, Interval]] = field(default_factory=list)  # locked calls, this window
    replanned: str | None = None  # why the drift guard re-planned this shape (once)
    last: Candidate | None = None  # the candidate the previous call of this shape ran
    settle_calls: int = 0  # untimed trial calls (:meth:`next_call`)
    ruled_out: str | None = None  # why K = 1 was locked without trials (:mod:`chance`)
    # such a lock's first window's median, per kind of window (with a backward or without:
    # the drift guard compares like with like)
    baseline_s: dict[bool, float] = field(default_factory=dict)
    predicted: dict[int, float] = field(default_factory=dict)  # the model's seconds per K

    @staticmethod
    def serial_only(why: str, ladder: tuple[int, ...] = (1,),
                    predicted: dict[int, float] | None = None) -> "_Trials":
        """A shape locked at K = 1 with no trial: no split has a chance (``why``)."""
        return _Trials((SERIAL,), {SERIAL: []}, {}, ladder, locked=SERIAL, widened=(),
                       ruled_out=why, predicted=predicted or {})

    def next_candidate(self) -> Candidate:
        """Candidate by candidate: the previous call's while it still has timed calls to
        make, else the first active one that has. A run of one candidate's calls pays one
        untimed settling call (:meth:`next_call`), where turns of one call each paid one per
        timed call: the trials' largest cost, at training sizes (each call seconds long),
        for an evenness the re-check rounds, which run the close candidates again in the
        other order, give too."""
        if self.last in self.active and len(self.samples[self.last]) < self.targets.get(
                self.last, 0):
            return self.last
        return next((k for k in self.active if len(self.samples[k]) < self.targets.get(k, 0)),
                    self.active[0])

    def calls(self) -> int:
        """Trial calls made so far (timed and settling)."""
        return sum(map(len, self.samples.values())) + self.settle_calls

    def next_call(self) -> tuple[Candidate, bool]:
        """``(candidate, timed)``: the next trial call. A call of a candidate other than the
        previous call's settles (runs, untimed): a call right after another K's runs slower
        than the steady state of its own K, and unevenly, so round-robin without it ranked the
        candidates wrong (docs/planner.md), and the steady state is what the lock is for."""
        k = self.next_candidate()
        timed = k == self.last
        self.last = k
        if not timed:
            self.settle_calls += 1
        return k, timed

    def explored(self) -> bool:
        return all(len(self.samples[k]) >= self.targets.get(k, 0) for k in self.active)

    def again(self, trials: int, why: str) -> _Trials:
        """The same candidates measured afresh, ``trials`` calls each (the drift guard's
        re-plan): no widening, the neighbours already being among them."""
        return _Trials(self.candidates, {k: [] for k in self.candidates},
                       dict.fromkeys(self.candidates, trials), self.ladder,
                       active=self.candidates, widened=(), replanned=why, last=self.locked,
                       predicted=self.predicted)

    def times(self) -> list[list[float]]:
        """Per candidate, each trial call's seconds: forward + backward where every call has
        both, else forward only (the same rule on every rank; kept in ``phases``)."""
        every = [t for k in self.candidates for t in self.samples[k]]
        self.phases = ("forward", "backward") if all("backward" in t for t in every) \
            else ("forward",)
        return [[sum(t[p].seconds for p in self.phases) for t in self.samples[k]]
                for k in self.candidates]

    def steady_median(self, phases: tuple[str, ...] | None = None) -> tuple[float, int]:
        """The median seconds of this window's locked calls that have every phase the trials
        timed (or ``phases``; a call whose backward has not run yet is left out), and how
        many there were."""
        phases = phases or self.phases
        done = [sum(t[p].seconds for p in phases) for t in self.steady
                if all(p in t for p in phases)]
        return (statistics.median(done), len(done)) if done else (0.0, 0)


def _say_plain_rows_won(wire: WirePair, dtype: torch.dtype,
                        slowest: list[float], state: _Trials) -> None:
    """Say that rows in ``dtype`` measured faster than the wire format in ``"auto"``'s trials
    (the shape then sends plain rows)."""
    wire_s = min(t for c, t in zip(state.candidates, slowest) if not c.plain_rows)
    plain_s = min(t for c, t in zip(state.candidates, slowest) if c.plain_rows)
    warnings.warn(
        f"mc2: micro_batches='auto' measured rows in {dtype} {wire_s / plain_s - 1:.0%} faster "
        f"than the wire format {describe_pair(wire)} on this shape ({1e3 * plain_s:.1f} vs "
        f"{1e3 * wire_s:.1f} ms per call): encoding costs more than the bytes it saves here; "
        "so this shape sends plain rows; pass a fixed micro_batches to force the format",
        WireFormatWarning, stacklevel=5)  # the call's planning (call_plan._choose_k)


def _in_order(candidates: Sequence[Candidate]) -> tuple[Candidate, ...]:
    """Candidates in trial order: the wire format's K ascending, then plain rows'."""
    return tuple(sorted(set(candidates)))


class Planner:
    """Chooses ``micro_batches`` for ``"auto"``: the model ranks, the real calls decide.

    For each new shape (token count within 1/16, weights, group) the cost model, calibrated
    once per weight shape and group, ranks every candidate K; the model's ranking is only the
    prior (trusting it alone, without trials, never measured better). The first calls of that
    shape try K = 1 and the model's next ``explore - 1`` best, ``trials`` timed calls each, each
    after an untimed call of the same K (why: :mod:`mc2.engine.decide.trials`), scored by the
    group's slowest rank; the winner's untried neighbours and the candidates close to it run
    next, all within ``max_trial_calls``. The fastest K is locked for the shape (K = 1 unless a
    split gains ``min_gain``), and one ``logging.INFO`` line says what was measured and why. A
    drift guard (``drift``) re-runs a shape's trials once where its steady state later runs
    clearly slower than they measured. See docs/planner.md, 'How the trials run'.

    With a wire format (:mod:`mc2.engine.transport.wire`), the model's best K with rows in the
    compute dtype is tried too, and K = 1 with plain rows, the serial baseline no lock may be
    slower than. Where plain rows win, encoding costs more than the bytes save on this link;
    the shape then sends plain rows (exact, and faster) and a :class:`WireFormatWarning` says
    so once. A fixed ``micro_batches`` always honours the format.

    Args:
        candidates: the K values considered.
        min_gain: keep K = 1 unless another K gains this much, as the trial calls measured it
            (:func:`trial_winner`).
        repeats: timing repeats per calibration measurement (medians are used).
        explore: how many of the model's best K the real calls try (K = 1 always among them).
        trials: timed calls per tried K (each after an untimed call of the same K where the
            previous call ran another; their median counts).
        recheck: more timed calls for each candidate within the noise of the best, per
            re-check round (at most ``RECHECK_ROUNDS``, 2; 0: none).
        drift: the drift guard's threshold. Each locked shape's calls keep being timed (two
            clock stamps a pass, read only at a check); every ``drift_window`` calls the
            group compares their median with the locked candidate's trial median (one
            two-number all-reduce and one host read). Where the steady state runs more than
            ``drift`` (a fraction) plus the trials' spread slower (a link that got slower,
            another job on the node), the shape's trials run again, once, and one
            ``logging.INFO`` line says why. 0: no guard. Capacity calls (which promise no host
            read) and calls under graph capture are not watched.
        drift_window: locked calls per drift check.
    """

    def __init__(self, candidates: Sequence[int] = (1, 2, 4, 8, 16), min_gain: float = 0.02,
                 repeats: int = 3, explore: int = 3, trials: int = 2, recheck: int = 2,
                 drift: float = 0.25, drift_window: int = 32,
                 max_trial_calls: int = 24) -> None:
        if not candidates or min(candidates) < 1:
            raise ValueError(f"candidates must be positive integers, got {candidates!r}")
        if explore < 2 or trials < 1 or recheck < 0:
            raise ValueError(f"explore must be >= 2, trials >= 1 and recheck >= 0, got "
                             f"{explore}, {trials}, {recheck}")
        if drift < 0 or drift_window < 2:
            raise ValueError(f"drift must be >= 0 (0: no drift guard) and drift_window >= 2, "
                             f"got {drift}, {drift_window}")
        if max_trial_calls < 2 * (trials + 1):
            raise ValueError(f"max_trial_calls must allow K = 1 and one split their trials "
                             f"({2 * (trials + 1)} calls), got {max_trial_calls}")
        self.max_trial_calls = max_trial_calls
        self.drift = drift
        self.drift_window = drift_window
        self.candidates = tuple(candidates)
        self.min_gain = min_gain
        self.repeats = repeats
        self.explore = explore
        self.trials = trials
        self.recheck = recheck
        self._cache: dict[tuple, Calibration] = {}
        self._quick: dict[tuple, Calibration] = {}  # :meth:`quick_calibration`, until the full
        self._codec: dict[tuple, float] = {}
        self._shapes: dict[tuple, _Trials] = {}
        self._calls: dict[tuple, int] = {}  # choose() calls per group: the handshake's digest
        self._unsettled: dict[tuple, int] = {}  # those not quiet_for: settled_digest
        self._errors: dict[tuple, ModelError] = {}  # per group: the model against its trials
        self._overlaps: "weakref.WeakSet[BatchOverlapDecision]" = weakref.WeakSet()
        # the last forward's choice per weight tensor and shape (:meth:`shape_key`), for a
        # call made again in a backward: weights may serve calls of several shapes
        self._forward_choice: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def calibration(self, weights: ExpertWeights | ModuleExperts, group: Any, strategy: str = "loop",
                    rows: int | None = None) -> Calibration:
        """Measure (a collective: every rank of ``group`` calls it together) or reuse.

        ``rows``: the routed rows per rank of the shape to price (agreed by the group); the
        expert line and the link are measured up to that shape's sizes (:func:`priced_sizes`),
        so a calibration is kept per weights, group and those sizes."""
        key = (weights.cache_key, group_key(group), priced_sizes(rows, weights, group))
        if key not in self._cache:
            self._cache[key] = self._measure(weights, group, strategy, sizes=key[-1])
        return self._cache[key]

    def quick_calibration(self, weights: ExpertWeights | ModuleExperts, group: Any,
                          strategy: str = "loop") -> Calibration:
        """The cheap part of :meth:`calibration` (a collective, like it), enough to rule
        splits out: the expert line fitted on 4 and 32 rows, the link's latency and bandwidth
        fitted on 1 and 64 rows per peer (each point the median of ``repeats`` timings, the
        larger one grown until it stands out of the timings' spread:
        :meth:`_Probe.resolved_line`), the row moves of 512 rows, and no interference.

        Why: the full calibration's largest parts, a 256-row expert step and the
        interference of a transfer under one, took ~1 s of a decode-sized first call
        (hidden 1024, ffn 2048; docs/measurements.md), where they decide nothing: leaving
        interference out only makes splits look better, so a split this calibration rules
        out, the full one would too. Where a split keeps a chance, the full calibration
        follows (reusing these measurements) and the trials with it."""
        key = (weights.cache_key, group_key(group))
        if key not in self._quick:
            self._quick[key] = self._measure(weights, group, strategy, full=False)
        return self._quick[key]

    def predictions(self, *, max_tokens: int, topk: int,
                    weights: ExpertWeights | ModuleExperts, group: Any, strategy: str = "loop",
                    wire: WirePair = PLAIN_PAIR,
                    sent_rows: int | None = None, quick: bool = False) -> dict[int, float]:
        """The model's step seconds of every candidate K this size allows (K = 1 always),
        in ascending K (``quick``: on :meth:`quick_calibration`, optimistic for splits)."""
        cal = self.quick_calibration(weights, group, strategy) if quick else \
            self.calibration(weights, group, strategy, rows=max_tokens * topk)
        return predicted_steps(cal, self.workload(max_tokens, topk, weights, group, wire,
                                                  sent_rows), self.candidates, max_tokens)

    def model_error(self, group: Any) -> ModelError:
        """How far the cost model has been from the trials on ``group`` (:mod:`chance`)."""
        return self._errors.setdefault(group_key(group), ModelError())

    def choose(self, *, max_tokens: int, topk: int, weights: ExpertWeights | ModuleExperts, group: Any,
               strategy: str = "loop", wire: WirePair = PLAIN_PAIR,
               sent_rows: int | None = None, watch: bool = True, trained: bool = True
               ) -> Choice:
        """K for this call: a trial while the shape is explored, then the locked winner.

        A collective whenever it calibrates or decides; every rank calls it with the same
        agreed values, in the same order, so every rank takes the same branch (the handshake
        checks that every rank's planner has made as many choices for the group:
        :meth:`digest`). ``sent_rows``: where rows go once per destination, the most rows any
        rank sends (agreed in the handshake): the link is priced for those, the experts for
        the pairs. ``watch``: time the locked calls for the drift guard (every rank passes
        the same; capacity calls pass ``False``). ``trained``: a backward follows (agreed in
        the handshake). Training calls and forwards alone run trials of their own: timed
        without a backward, a forward alone says nothing of the backward a training call
        runs, and forward-only trials (an evaluation before training) locked the K that
        training then ran (found by a review). A recompute (:meth:`again`) finds its
        forward's K whatever the kind.
        """
        shape = dict(max_tokens=max_tokens, topk=topk, weights=weights, group=group,
                     strategy=strategy, sent_rows=sent_rows)
        key = self.shape_key(wire=wire, **shape)
        quiet = self._quiet((*key, trained), group, max_tokens, weights, watch)
        # nothing to hide (one rank), or nothing to split (one token)
        choice = self._choose((*key, trained), shape, wire, watch) \
            if group_size(group) > 1 and max_tokens > 1 else Choice(1)
        self._calls[group_key(group)] = self.digest(group) + 1
        if not quiet:
            self._unsettled[group_key(group)] = self.settled_digest(group) + 1
        by_shape = self._forward_choice.setdefault(weights.anchor, {})
        by_shape[key, trained] = Choice(choice.micro_batches, plain_rows=choice.plain_rows)
        return choice

    def quiet_for(self, *, max_tokens: int, topk: int, weights: ExpertWeights | ModuleExperts,
                group: Any, strategy: str = "loop", wire: WirePair = PLAIN_PAIR,
                sent_rows: int | None = None, watch: bool = True, trained: bool = True
                ) -> bool:
        """Whether :meth:`choose` with these arguments runs no collective: nothing to
        choose (one rank, one token), or the shape is locked and this call ends no drift
        window (unwatched, or its window not full). (A capacity call that is not quiet waits
        for its handshake before choosing, so that ranks whose planners differ raise there
        instead of one calibrating alone.)"""
        key = self.shape_key(max_tokens, topk, weights, group, strategy, wire, sent_rows)
        return self._quiet((*key, trained), group, max_tokens, weights, watch)

    def _quiet(self, trials_key: tuple, group: Any, max_tokens: int,
               weights: ExpertWeights | ModuleExperts, watch: bool) -> bool:
        """:meth:`quiet_for` of the trials under ``trials_key`` (:meth:`shape_key` and the
        kind), which :meth:`choose` has already made."""
        if group_size(group) <= 1 or max_tokens <= 1:
            return True
        held = self._shapes.get(trials_key)
        if held is None or held.locked is None:
            return False
        return (not watch or not self._watching(held, weights)
                or len(held.steady) < self.drift_window)

    @staticmethod
    def shape_key(max_tokens: int, topk: int, weights: ExpertWeights | ModuleExperts, group: Any,
                  strategy: str, wire: WirePair,
                  sent_rows: int | None) -> tuple:
        """What a choice depends on besides the weights themselves: the shape whose trials
        and locked K it is (token count within 1/16, top-k, the weights' shape, the group,
        the GEMM strategy, the wire formats, rows once per destination or not)."""
        return (bucket(max_tokens), topk, weights.cache_key, group_key(group), strategy,
                wire.dispatch.code, wire.combine.code, sent_rows is not None)

    def digest(self, group: Any) -> int:
        """How many calls on ``group`` this planner has chosen K for. Ranks whose planners
        differ here would take different branches (one calibrating, with collectives its
        peers do not run), so the handshake makes them agree first."""
        return self._calls.get(group_key(group), 0)

    def settled_digest(self, group: Any) -> int:
        """How many of this planner's choices on ``group`` could have run a collective (all
        but those :meth:`quiet_for` finds quiet). The handshake of a capacity call carries this, not
        :meth:`digest`: its steady calls are trusted without reading anything while their
        shared values stay the same, which a count of every call would end; a fresh planner
        on some ranks still differs here, before it calibrates alone."""
        return self._unsettled.get(group_key(group), 0)

    def again(self, *, max_tokens: int, topk: int, weights: ExpertWeights | ModuleExperts,
              group: Any, strategy: str = "loop", wire: WirePair = PLAIN_PAIR,
              sent_rows: int | None = None) -> Choice:
        """The choice of the last forward with these weights and this shape (the arguments
        of :meth:`choose`), for a call made again during a backward (a recompute under
        activation checkpointing: it must run the K its forward ran, or PyTorch finds other
        saved shapes). Keyed on the shape too: one experts module over two inputs of
        different token counts may have run two K. Counts no trial, runs no collective.

        The last training forward's K first: a forward alone of the shape (an evaluation)
        between a checkpointed training forward and its backward ran its own trials' K,
        which the recompute took, and PyTorch refused its saved shapes (found by a review).
        A reentrant checkpoint's forward runs without gradients: where no training forward
        of the shape ran, the last forward alone's."""
        key = self.shape_key(max_tokens, topk, weights, group, strategy, wire, sent_rows)
        known = self._forward_choice.get(weights.anchor, {})
        return known.get((key, True)) or known.get((key, False)) or Choice(1)

    def _choose(self, key: tuple, shape: dict[str, Any], wire: WirePair,
                watch: bool) -> Choice:
        """:meth:`choose` for the shape of ``key`` (``shape``: its arguments but ``wire``)."""
        weights, group = shape["weights"], shape["group"]
        state = self._shapes.get(key)
        if state is None:
            state = self._shapes[key] = self._first_trials(shape, wire)
            if state.ruled_out is not None:  # no split has a chance: no trials at all
                _log.info("mc2 auto (%s): %s", _shape_text(weights, group), state.ruled_out)
                return Choice(1, decided=state.ruled_out)
        if state.locked is None and state.explored():
            self._decide(state, weights, group, wire)
            if state.locked is not None:
                return Choice(state.locked.k, plain_rows=state.locked.plain_rows,
                              decided=describe(state.stats, state.locked, state.rechecks,
                                               state.widened))
        if state.locked is not None:
            if not watch or not self._watching(state, weights):
                return Choice(state.locked.k, plain_rows=state.locked.plain_rows)
            why = self._drifted(state, weights, group)
            if why is None:
                sample: dict[str, Interval] = {}
                state.steady.append(sample)
                return Choice(state.locked.k, plain_rows=state.locked.plain_rows,
                              on_pass_done=sample.__setitem__)
            if state.ruled_out is not None:  # the model's call, on a machine that changed
                return self._revisit(key, shape, wire, why)
            state = self._shapes[key] = state.again(self.trials, why)
            return replace(self._trial(state), decided=f"re-planning: {why}")
        return self._trial(state)

    def _first_trials(self, shape: dict[str, Any], wire: WirePair
                      ) -> _Trials:
        """A new shape's trials: K = 1 and the model's ``explore - 1`` best splits among those
        it gives a chance (:mod:`mc2.engine.decide.chance`); with a wire format, K = 1 and the
        best such K with plain rows too. Where no split has a chance (and no wire format asks
        for plain rows' trial), K = 1 is locked at once."""
        margin = self.model_error(shape["group"]).margin()
        wired = any(f.kind is not None for f in wire)
        optimistic = self.predictions(wire=wire, quick=True, **shape)
        if not wired and not with_a_chance(optimistic, margin):
            return _Trials.serial_only(ruled_out(optimistic, margin))
        predicted = self.predictions(wire=wire, **shape)
        chance = with_a_chance(predicted, margin)  # best predicted first
        tried = [Candidate.of(k) for k in [1] + chance[: self.explore - 1]]
        if wired:  # plain rows where the model gives them a chance against the format's best
            plain = self.predictions(**shape)
            best = min([1, *with_a_chance(plain, margin)], key=lambda k: (plain[k], k))
            fastest = min(predicted.values())
            tried += [Candidate.of(k, plain_rows=True) for k in sorted({1, best})
                      if plain[k] <= fastest * margin]
        tried = tried[:self.max_trial_calls // (self.trials + 1)]  # a first round that fits
        order = _in_order(tried)
        ladder = tuple(sorted({1, *chance}))
        if order == (SERIAL,):
            return _Trials.serial_only(ruled_out(predicted, margin), ladder, predicted)
        return _Trials(order, {c: [] for c in order}, dict.fromkeys(order, self.trials),
                       ladder, active=order, predicted=predicted)

    def _revisit(self, key: tuple, shape: dict[str, Any], wire: WirePair,
                 why: str) -> Choice:
        """A K = 1 locked without trials whose step changed: calibrate again (what the model
        knew of the link and the experts is what changed) and decide the shape afresh, once:
        its trials where a split now has a chance, else K = 1 again."""
        weights, group = shape["weights"], shape["group"]
        self._quick.pop((weights.cache_key, group_key(group)), None)
        self._cache = {k: v for k, v in self._cache.items()
                       if k[:2] != (weights.cache_key, group_key(group))}
        state = self._shapes[key] = self._first_trials(shape, wire)
        state.replanned = why
        if state.ruled_out is not None:
            _log.info("mc2 auto (%s): %s", _shape_text(weights, group), state.ruled_out)
            return Choice(1, decided=f"re-planning: {why}; {state.ruled_out}")
        return replace(self._trial(state), decided=f"re-planning: {why}")

    @staticmethod
    def _trial(state: _Trials) -> Choice:
        """The next trial call of an undecided shape: timed, or settling
        (:meth:`_Trials.next_call`)."""
        c, timed = state.next_call()
        if not timed:
            return Choice(c.k, trial=True, plain_rows=c.plain_rows, settling=True)
        sample: dict[str, Interval] = {}
        state.samples[c].append(sample)
        return Choice(c.k, trial=True, on_pass_done=sample.__setitem__, plain_rows=c.plain_rows)

    def _watching(self, state: _Trials, weights: ExpertWeights | ModuleExperts) -> bool:
        """Whether this locked call is timed for the drift guard: the guard is on, the shape
        has not been re-planned already, and no graph is being captured (a capture runs no
        check; every rank captures the same calls, so all skip alike)."""
        return (self.drift > 0 and state.replanned is None
                and (bool(state.stats) or state.ruled_out is not None)
                and not streams.capturing(weights.device))

    def _drifted(self, state: _Trials, weights: ExpertWeights | ModuleExperts, group: Any
                 ) -> str | None:
        """At the end of a window of ``drift_window`` locked calls, why the shape must be
        re-planned (its steady state ran clearly slower than its trials), else ``None``.

        A collective at the window's end (one all-reduce of two numbers: the slowest rank's
        median, the fewest complete calls), reached at the same call on every rank: the
        windows count the group's agreed calls."""
        if len(state.steady) < self.drift_window:
            return None
        serial = state.ruled_out is not None
        # a K = 1 locked without trials has no trials' phases: its windows are timed as they
        # ran, forward alone or forward + backward, each against a baseline of its own kind
        trained = serial and any("backward" in t for t in state.steady)
        median, count = state.steady_median(("forward", "backward") if trained else None)
        state.steady = []
        flat = upload([median, -float(count), float(trained), -float(trained)], weights.device,
                      torch.float64)
        slowest, fewest, any_trained, all_trained = read(all_reduce_max(flat, group))
        if -fewest < self.drift_window // 2 or any_trained != -all_trained:
            return None  # too few calls with every phase timed, or windows of two kinds
        why = self._serial_drift(state, slowest, trained) if serial \
            else self._trials_drift(state, slowest)
        if why is not None:
            _log.info("mc2 auto (%s): %s", _shape_text(weights, group), why)
        return why

    def _trials_drift(self, state: _Trials, slowest: float) -> str | None:
        """Why a locked shape's steady state (``slowest``: the window's median, the group's
        slowest rank's) ran clearly slower than its trials, or ``None``."""
        mine = next(st for st in state.stats if st.candidate == state.locked)
        if slowest <= mine.median_s * (1 + self.drift) + mine.spread_s:
            return None
        return (f"the steady state of {state.locked.name} ran "
                f"{slowest * 1e3:.1f} ms a call, {slowest / mine.median_s - 1:.0%} slower than "
                f"its trials ({mine.median_s * 1e3:.1f} ms +-{mine.spread_s * 1e3:.1f}); "
                "its trials run again, once")

    def _serial_drift(self, state: _Trials, slowest: float, trained: bool) -> str | None:
        """The same for a K = 1 locked without trials: no trial to compare with, so its first
        window of each kind (``trained``: with a backward) is that kind's baseline, and a
        window more than ``drift`` off it, either way, counts. (Compared across kinds, going
        from no-grad calls to training ones read as a drift of the machine.)"""
        baseline = state.baseline_s.get(trained)
        if baseline is None:
            state.baseline_s[trained] = slowest
            return None
        change = slowest / baseline - 1
        if abs(change) <= self.drift:
            return None
        return (f"the steady state of K=1, locked without trials, ran {slowest * 1e3:.1f} ms "
                f"a call, {change:+.0%} against its first {self.drift_window} calls of the "
                f"kind ({baseline * 1e3:.1f} ms); the model is calibrated again and decides "
                "once more")

    def _decide(self, state: _Trials, weights: ExpertWeights | ModuleExperts, group: Any,
                wire: WirePair) -> None:
        """Lock a candidate, or once, where the lead is within the noise, ask for
        ``recheck`` more calls of the close candidates (one collective: the group's slowest
        rank per call)."""
        times = state.times()
        flat = upload([t for per in times for t in per], weights.device, torch.float64)
        slowest = iter(read(all_reduce_max(flat, group)))
        reduced = [[next(slowest) for _ in per] for per in times]
        stats = trial_stats(state.candidates, reduced)
        best = min(stats, key=lambda st: st.median_s).candidate
        left = self.max_trial_calls - state.calls()  # each candidate's run: settle + timed
        if state.widened is None:
            fits = left // (self.trials + 1)
            state.widened = tuple(untried_neighbours(state.ladder, state.candidates,
                                                     best)[:fits])
            if state.widened:  # the neighbours, next to the best's own calls
                state.candidates = _in_order(state.candidates + state.widened)
                state.samples.update({k: [] for k in state.widened})
                state.targets.update(dict.fromkeys(state.widened, self.trials))
                state.active = state.widened
                return
        close = contenders(stats, RECHECK_WITHIN)
        if (len(close) > 1 and state.rechecks < RECHECK_ROUNDS and self.recheck > 0
                and left >= len(close) * (self.recheck + 1)):
            state.rechecks += 1
            # the other way round from the candidates' order: a drift of the machine over the
            # trials falls on both ends alike
            state.active = tuple(sorted(close, key=state.candidates.index,
                                        reverse=state.rechecks % 2 == 1))
            state.targets.update({k: len(state.samples[k]) + self.recheck for k in close})
            return
        medians = [st.median_s for st in stats]
        state.locked = trial_winner(state.candidates, medians, self.min_gain)
        state.stats = tuple(stats)
        self.model_error(group).learn(
            state.predicted, {st.candidate.k: st.median_s for st in stats
                              if not st.candidate.plain_rows})
        _log.info("mc2 auto (%s): %s", _shape_text(weights, group),
                  describe(stats, state.locked, state.rechecks, state.widened))
        if state.locked.plain_rows:
            _say_plain_rows_won(wire, weights.dtype, medians, state)

    def most_trial_calls(self, wire: bool = True) -> int:
        """The most calls one shape's trials can take (settling calls included; ``wire``: with
        a wire format, whose plain-rows candidates add two): what a caller that runs calls
        until :meth:`settled` may allow before calling the planner stuck. Every stage of the
        trials starts only where it fits ``max_trial_calls``."""
        del wire  # the budget bounds every schedule alike
        return self.max_trial_calls

    def settled(self) -> bool:
        """Whether every shape seen so far has finished its trials and locked a K."""
        return all(s.locked is not None for s in self._shapes.values())

    def batch_overlap(self, mode: bool | str, *, min_tokens: int = MIN_TOKENS,
                      group: Any = None, trials: int = 3) -> BatchOverlapDecision:
        """A model's batch-overlap decision (:mod:`~mc2.engine.decide.batch_split`): the
        split of a forward into two micro-batches, decided by this planner's rules (its
        ``"auto"`` measured with the trials' statistics, the split kept where it wins by
        3%). Held weakly here (:meth:`batch_overlaps`); its model holds it."""
        decision = BatchOverlapDecision(mode, min_tokens=min_tokens, group=group, trials=trials)
        self._overlaps.add(decision)
        return decision

    def batch_overlaps(self) -> list[dict[str, Any]]:
        """What each live batch-overlap decision chose (``None``: still measuring) and the
        times it measured each way (the group's slowest rank's seconds): a training step's,
        and a forward's alone under ``"forward_only"``
        (:meth:`~mc2.engine.decide.batch_split.BatchOverlapDecision.report`)."""
        return [d.report() for d in self._overlaps]

    def decisions(self) -> dict[tuple, dict[str, Any]]:
        """What ``"auto"`` tried and chose per shape: ``{key: {"tried", "locked",
        "plain_rows", "times", "stats", ...}}``. ``tried`` and ``locked`` are K; ``times`` and
        ``stats`` are keyed by K for the requested wire format's rows and ``plain_times`` and
        ``plain_stats`` by K for plain rows (with a wire format)."""
        def by_k(values: dict[Candidate, Any], plain: bool, f: Callable[[Any], Any]
                 ) -> dict[int, Any]:
            return {c.k: f(v) for c, v in values.items() if c.plain_rows == plain}

        def times(calls: list[dict[str, Interval]]) -> list[dict[str, float]]:
            return [{p: i.seconds for p, i in t.items()} for t in calls]

        def stat(st: Any) -> dict[str, Any]:
            return {"median_s": st.median_s, "spread_s": st.spread_s, "calls": st.calls}

        out = {}
        for key, s in self._shapes.items():
            stats = {st.candidate: st for st in s.stats}
            out[key] = {
                "tried": tuple(c.k for c in s.candidates),
                "locked": None if s.locked is None else s.locked.k,
                "plain_rows": s.locked is not None and s.locked.plain_rows,
                "times": by_k(s.samples, False, times),
                "plain_times": by_k(s.samples, True, times),
                "stats": by_k(stats, False, stat), "plain_stats": by_k(stats, True, stat),
                "rechecked": s.rechecks,
                "widened": tuple(c.k for c in s.widened or ()),
                "replanned": s.replanned,
                "settle_calls": s.settle_calls,
                "why": describe(s.stats, s.locked, s.rechecks, s.widened) if s.stats
                else s.ruled_out}
        return out

    def workload(self, max_tokens: int, topk: int, weights: ExpertWeights | ModuleExperts, group: Any,
                 wire: WirePair = PLAIN_PAIR,
                 sent_rows: int | None = None) -> Workload:
        hidden, dtype = weights.hidden, weights.dtype
        pairs = max_tokens * topk
        per_row = sum(f.bytes_per_row(hidden, dtype) for f in wire) / 2 \
            if any(f.kind is not None for f in wire) else None
        return Workload(rows_per_rank=pairs, hidden=hidden,
                        local_experts=weights.local_experts, world_size=group_size(group),
                        element_size=weights.element_size, wire_bytes_per_row=per_row,
                        codec_s_per_row=self.codec_cost(wire, weights, group),
                        sent_share=1.0 if sent_rows is None or not pairs
                        else sent_rows / pairs)

    def codec_cost(self, wire: WirePair, weights: ExpertWeights | ModuleExperts,
                   group: Any) -> float:
        """Measured seconds per routed row to encode + decode (the group's maximum; cached)."""
        if all(f.kind is None for f in wire):
            return 0.0
        key = ("codec", wire.dispatch.code, wire.combine.code, weights.hidden, weights.dtype,
               weights.device.type, group_key(group))
        if key not in self._codec:
            with kept_rng(weights.device):
                local = _measure_codec(wire, weights.hidden, weights.dtype, weights.device,
                                       self.repeats)
            value = upload([local], weights.device, torch.float64)
            self._codec[key] = read(all_reduce_max(value, group))[0]
        return self._codec[key]

    def _measure(self, weights: ExpertWeights | ModuleExperts, group: Any, strategy: str, *,
                 full: bool = True, sizes: tuple[int, int] = (256, 256)) -> Calibration:
        """Every constant of the model, each rank's own, then the group's maximum.

        Each point is the median of ``repeats`` timings, and a line's larger point grows
        until it stands out of the points' spread (:meth:`_Probe.resolved_line`: where an
        expert's GEMM costs the same at 4 and 32 rows, as on a GPU, a line through those two
        says rows are free). ``full=False``: the quick stage (:meth:`quick_calibration`):
        the expert line from 4 rows up, the link from 1 row per peer up to 64, no
        interference. ``sizes``: the full stage's largest expert rows and rows per peer,
        the sizes of the shape it prices (:func:`priced_sizes`)."""
        one = weights.for_calibration()
        probe = _Probe(one, strategy, group, self.repeats)
        expert_rows, peer_rows = sizes if full else (32, 64)
        with torch.no_grad(), kept_rng(one.device):  # its draws are not the caller's
            probe.expert_step(4)  # warm-up
            fixed, per_row = probe.resolved_line(probe.expert_step, 4, expert_rows, float,
                                                 agree=False)
            latency, per_byte = probe.link(peer_rows, most=peer_rows if full else 4 * peer_rows) \
                if group_size(group) > 1 else (0.0, 0.0)
            row_overhead = _measure_row_overhead(one.hidden, one.dtype, one.device,
                                                 self.repeats, rows=2048 if full else 512)
            interference = 0.0
            if full and group_size(group) > 1:
                interference = probe.interference(per_row, expert_rows, latency, per_byte)
        values = upload([fixed, per_row, latency, per_byte, interference, row_overhead],
                        one.device, torch.float64)
        return Calibration(*read(all_reduce_max(values, group)))


# the largest sizes a line is grown to (rows through one expert; rows per peer), and the most
# bytes of rows the link probe sends (its receive buffer is as large)
MOST_EXPERT_ROWS = 4096
MOST_PEER_ROWS = 4096
PROBE_BYTES = 64 * 2 ** 20


def priced_sizes(rows: int | None, weights: ExpertWeights | ModuleExperts, group: Any
                 ) -> tuple[int, int]:
    """The full calibration's largest expert rows and rows per peer for a shape of ``rows``
    routed rows per rank: what one expert and one peer see at K = 1 (the largest a trial
    prices), rounded up to a power of two, within ``[256, MOST_*]``; (256, 256) unknown."""
    if not rows:
        return 256, 256
    world = group_size(group)

    def clamp(n: float, most: int) -> int:
        return min(max(256, 1 << max(0, int(n) - 1).bit_length()), most)

    return (clamp(rows / max(1, weights.local_experts), MOST_EXPERT_ROWS),
            clamp(rows / max(1, world), MOST_PEER_ROWS))


@dataclass
class _Probe:
    """The measurements behind a :class:`Calibration`, on one expert of this rank's."""

    one: ExpertWeights | ModuleExperts
    strategy: str
    group: Any
    repeats: int

    def time(self, fn: Callable[[], Any]) -> float:
        return self.timing(fn)[0]

    def timing(self, fn: Callable[[], Any]) -> tuple[float, float]:
        """``(median, half the range)`` of ``repeats`` timings of ``fn()``."""
        clock = clock_for(self.one.device)
        times = [clock.time(fn) for _ in range(self.repeats)]
        return statistics.median(times), (max(times) - min(times)) / 2

    def resolved_line(self, run: Callable[[int], Any], small: int, large: int,
                      size: Callable[[int], float], *, agree: bool,
                      most: int = MOST_EXPERT_ROWS) -> tuple[float, float]:
        """``(fixed, per unit)`` of ``run(n)``'s time, fitted on ``small`` and ``large``
        (``size(n)``: the units of ``n``). The larger point grows fourfold (up to ``most``)
        until its median stands out of both points' spread: a line through two points inside
        the noise says the units are free. ``agree``: ``run`` is a collective, so the group
        decides each growth on its slowest rank's timings (one all-reduce a step), and every
        rank runs the same sizes."""
        t_small, noise_small = self.timing(lambda: run(small))
        while True:
            t_large, noise_large = self.timing(lambda n=large: run(n))
            seen = [t_small, t_large, max(noise_small, noise_large)]
            if agree:
                seen = read(all_reduce_max(upload(seen, self.one.device, torch.float64),
                                           self.group))
            if seen[1] - seen[0] > 2 * seen[2] or large >= most:
                break
            large = min(4 * large, most)
        return _fit_line(size(small), t_small, size(large), t_large)

    def expert_step(self, rows: int) -> None:
        """Forward and backward of ``rows`` rows through one expert."""
        self.one.step(rows, self.strategy)

    def a2a(self, rows_per_peer: int, async_op: bool = False) -> Any:
        world = group_size(self.group)
        rows = torch.zeros(rows_per_peer * world, self.one.hidden, dtype=self.one.dtype,
                           device=self.one.device)
        splits = [rows_per_peer] * world
        return all_to_all_rows(rows, splits, splits, self.group, async_op=async_op,
                               operation="planner measurement")

    def bytes_per(self, rows_per_peer: int) -> int:
        """Bytes one rank sends off-rank in :meth:`a2a` of ``rows_per_peer``."""
        world = group_size(self.group)
        return rows_per_peer * (world - 1) * self.one.hidden * self.one.element_size

    def link(self, row_large: int = 256, most: int = MOST_PEER_ROWS) -> tuple[float, float]:
        """``(latency, seconds per byte)`` of the group's All-to-All, fitted on 1 and
        ``row_large`` rows per peer, grown where the two are inside the noise up to ``most``
        (the full stage: the priced size itself) and never past :data:`PROBE_BYTES` of rows
        to send (a 64-rank group of hidden 7168 would otherwise allocate gigabytes on a
        decode-sized first call)."""
        self.a2a(1).wait()
        barrier(self.group, "planner measurement", self.one.device)
        row_bytes = group_size(self.group) * self.one.hidden * self.one.element_size
        most = max(2, min(most, MOST_PEER_ROWS, PROBE_BYTES // max(1, row_bytes)))
        row_large = min(row_large, most)  # the budget bounds where it starts, too
        return self.resolved_line(lambda n: self.a2a(n).wait(), 1, row_large, self.bytes_per,
                                  agree=True, most=most)

    def interference(self, per_row: float, large: int, latency: float,
                     per_byte: float) -> float:
        """How much a transfer in flight slows compute down, per second of transfer."""
        row_large = 256
        t_big = latency + per_byte * self.bytes_per(row_large)
        rows = min(max(large, int(4 * t_big / max(per_row, 1e-9))), 4096)
        alone = self.time(lambda: self.expert_step(rows))
        barrier(self.group, "planner measurement", self.one.device)

        def with_transfer() -> None:
            pending = self.a2a(row_large * 4, async_op=True)
            self.expert_step(rows)
            pending.wait()

        together = self.time(with_transfer)
        moved = latency + per_byte * self.bytes_per(row_large * 4)
        return min(max((together - alone) / max(moved, 1e-9), 0.0), 1.0)


def planner_for(group: Any) -> Planner:
    """The planner ``micro_batches="auto"`` uses when the caller passes none.

    One per live group, held by its state (:mod:`~mc2.engine.transport.group_state`): the
    measurements describe the machine and the group, not one call, so every layer and step of
    the model shares them; the planner goes with its group.
    Callers who want control hold their own :class:`Planner` and pass it as ``planner=``.
    """
    return group_state(group).of(Planner)


def default_decisions() -> list[dict[str, Any]]:
    """What ``"auto"`` decided in this process through the default planners (the calls that
    passed no ``planner=``, e.g. a framework's layers): every shape's
    :meth:`Planner.decisions` entry, for logs and benchmarks that do not hold the planner."""
    planners = (state.held(Planner) for state in live_states())
    return [d for planner in planners if planner is not None
            for d in planner.decisions().values()]
