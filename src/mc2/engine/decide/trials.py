"""``"auto"``'s decision from its trial calls: medians, spread, and a re-check inside the noise.

Why not the best of two calls per K (what ``"auto"`` once did): on a host shared with other
work, or a link whose speed wanders, one lucky call decides, and two runs of the same command
can lock very different K. The trials therefore

- run the candidates *round-robin*, so a slow phase of the machine hits every candidate rather
  than the one whose turn it was;
- time a call only where the call before it (of the same shape) ran the same candidate: a
  call right after another K's runs slower than its own K's steady state (buffers of other
  sizes to re-make), and not evenly (K = 1 after a split pays most), so without it the trials
  ranked the candidates by their predecessors. That untimed call is also the warm-up;
- score each call by the group's *slowest rank* (the step waits for it) and take the
  *median* of a candidate's timed calls, with half their range as the spread;
- re-check the candidates close to the best (:func:`contenders`);
- once, try the best candidate's untried neighbours on the ladder of allowed K
  (:func:`untried_neighbours`): the cost model picks what is tried first, and its calibration
  is measured on the same noisy machine, so one run's prior can leave out the K another run
  finds best;
- keep K = 1 unless a split is at least ``min_gain`` faster (:func:`trial_winner`).

Every rank computes the same decision: the times are the group's maximum, reduced in one
collective per decision step. See docs/planner.md, 'How the trials run'.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, order=True)
class Candidate:
    """One plan a trial measures: K micro-batches, rows in the requested wire format or in the
    compute dtype (``plain_rows``). Two fields, never one signed number (a negative K used to
    mean plain rows, at ~20 sites). Ordered as the trials run them: the wire format's K
    ascending, then plain rows'."""

    plain_rows: bool
    k: int

    @staticmethod
    def of(k: int, plain_rows: bool = False) -> "Candidate":
        return Candidate(plain_rows=plain_rows, k=k)

    @property
    def name(self) -> str:
        return f"K={self.k}" + (" plain rows" if self.plain_rows else "")


@dataclass(frozen=True)
class TrialStats:
    """One candidate's measured calls.

    Attributes:
        candidate: the plan measured.
        median_s: median seconds of its measured calls (the group's slowest rank each).
        spread_s: half the range of those calls (0 with one call).
        calls: how many calls were timed (the untimed calls that settle a switch of K
            not counted).
    """

    candidate: Candidate
    median_s: float
    spread_s: float
    calls: int


def trial_stats(candidates: Sequence[Candidate], times: Sequence[Sequence[float]]
                ) -> list[TrialStats]:
    """Per candidate, the statistics of ``times[i]`` (its timed calls, each the group's
    slowest rank's seconds; each came right after a call of the same candidate, so none is
    cold)."""
    measured = [list(calls) for calls in times]
    return [TrialStats(k, statistics.median(m), (max(m) - min(m)) / 2, len(m))
            for k, m in zip(candidates, measured)]


def trial_winner(candidates: Sequence[Candidate], seconds: Sequence[float], min_gain: float
                 ) -> Candidate:
    """The candidate to lock from its trial times (the group's slowest rank's).

    The fastest, except that a split (|K| > 1) must beat the serial baseline, K = 1 (and K = 1
    with plain rows where it was tried), by at least ``min_gain``, else the faster baseline
    stays: K = 1 has nothing in flight and re-reads no weights, and a smaller gain is within
    what the trial calls on a busy host can tell apart. So no lock is ever a plan that measured
    slower than K = 1 with plain rows, where that was tried. (Between a wire format and plain
    rows at one K, time alone decides.)
    """
    best = min(range(len(seconds)), key=seconds.__getitem__)
    serial = [i for i, c in enumerate(candidates) if c.k == 1]
    if candidates[best].k > 1 and serial:
        baseline = min(serial, key=seconds.__getitem__)
        if seconds[best] > seconds[baseline] * (1 - min_gain):
            return candidates[baseline]
    return candidates[best]


def untried_neighbours(ladder: Sequence[int], tried: Sequence[Candidate], best: Candidate
                       ) -> list[Candidate]:
    """The K next to ``best``'s on ``ladder`` (the allowed K, ascending) that are not in
    ``tried``, with ``best``'s rows, smaller first. Empty when the best candidate is already
    bracketed by measured neighbours (or the ladder's end)."""
    if best.k not in ladder:
        return []
    i = list(ladder).index(best.k)
    near = [Candidate.of(ladder[j], plain_rows=best.plain_rows) for j in (i - 1, i + 1)
            if 0 <= j < len(ladder)]
    return [c for c in near if c not in tried]


def contenders(stats: Sequence[TrialStats], floor: float = 0.0) -> list[Candidate]:
    """The candidates whose median is within the noise of the best one's (the best's spread or
    theirs, whichever is larger, and at least ``floor`` times the best's median), the best
    included; one candidate means the lead is clear.

    Why a floor: the spread of two calls is a poor estimate of the noise. Calls of one K
    differ from call to call in spells, so two of them often land close together and lock a
    split on a lead the steady state does not have (docs/measurements.md)."""
    best = min(stats, key=lambda s: s.median_s)
    return [s.candidate for s in stats
            if s.median_s - best.median_s <= max(s.spread_s, best.spread_s,
                                                 floor * best.median_s)]


def margin(stats: Sequence[TrialStats], winner: Candidate) -> float:
    """How much slower the runner-up is than ``winner``, as a fraction of the winner's median
    (``inf`` with no other candidate)."""
    mine = next(s for s in stats if s.candidate == winner).median_s
    others = [s.median_s for s in stats if s.candidate != winner]
    return min(others) / mine - 1 if others and mine > 0 else float("inf")


def describe(stats: Sequence[TrialStats], winner: Candidate, rechecks: int,
             widened: Sequence[Candidate] | None = ()) -> str:
    """One line: what was measured and why ``winner`` was locked (``widened``: the neighbours
    tried after the first round)."""
    measured = ", ".join(f"{s.candidate.name} {s.median_s * 1e3:.1f} ms +-"
                         f"{s.spread_s * 1e3:.1f} ({s.calls} calls)" for s in stats)
    return (f"locked {winner.name}: {measured}; runner-up {margin(stats, winner):+.1%}"
            + (f"; {', '.join(c.name for c in widened)} tried beside the first round's best"
               if widened else "")
            + (f" after {'a re-check' if rechecks == 1 else f'{rechecks} re-checks'} inside "
               "the noise" if rechecks else ""))
