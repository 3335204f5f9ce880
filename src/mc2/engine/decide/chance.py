"""Which splits the cost model gives a chance, so that ``"auto"`` tries only those.

Why: every trial of a split that cannot win is a slow call a user pays for. At decode sizes (a
few tokens per rank) each extra micro-batch runs every local expert's GEMMs once more and adds
two All-to-All latencies per pass, and nothing is there to hide behind: a K = 4 call measured
20-25 ms against 11-15 ms at K = 1 (2 ranks, hidden 1024, 4 tokens), and the trials ran 8-16 of
80 such calls at K > 1. The model already ranks those splits far behind K = 1; the trials are
for what it cannot tell apart.

The rule: a split is tried only where its predicted step is within ``margin`` times K = 1's.
The margin is the model's own error on this group: the largest factor by which it has
over-predicted a split's cost relative to K = 1 (predicted ratio / measured ratio, over every
split a finished trial measured), times :data:`SAFETY`, never below :data:`SAFETY`. Before any
trial has finished on the group it is :data:`PRIOR_MARGIN`. Errors in the other direction
(a split measured slower than predicted) only ever make splits lose, which the trials see.

Every rank computes the same margin: the predictions come from the group's reduced
calibration, and the measured times are the group's slowest rank's (:mod:`trials`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

# Before any measurement: a split predicted up to 1.4x K = 1's step is tried. Measured on this
# project's 2-core machine (2 ranks, 2 local experts, top-2; docs/measurements.md, "auto at
# decode sizes"): the model's ratio for the best split is 1.6-1.8 at 4 tokens per rank and
# 1.56-1.64 at 16 (measured 1.06-1.48: the model leaves out the per-call cost every K pays,
# so it over-states splits' losses at small sizes), 1.24-1.3 at 64 and 1.02-1.1 at the
# 256-1024-token training shapes, where a split is within a few percent of K = 1 or wins.
PRIOR_MARGIN = 1.4
# On top of the measured error: trial medians of one K differ by up to ~10% between runs here.
SAFETY = 1.2


@dataclass
class ModelError:
    """How far one group's cost model has been from its trials (the worst case seen).

    Attributes:
        worst: the largest ``predicted / measured`` ratio of a split's step to K = 1's seen
            on this group (``None``: no trial has finished yet).
        observations: how many (shape, split) pairs it was learned from.
    """

    worst: float | None = None
    observations: int = 0

    def margin(self) -> float:
        """How many times K = 1's predicted step a split may be predicted at and still be
        tried."""
        return PRIOR_MARGIN if self.worst is None else max(self.worst, 1.0) * SAFETY

    def learn(self, predicted: Mapping[int, float], measured: Mapping[int, float]) -> None:
        """Fold in one shape's trials. ``predicted`` and ``measured``: seconds per candidate K
        (positive K only, K = 1 among them); splits present in both count."""
        if 1 not in predicted or 1 not in measured or measured[1] <= 0 or predicted[1] <= 0:
            return
        for k, seconds in measured.items():
            if k == 1 or k not in predicted or seconds <= 0:
                continue
            ratio = (predicted[k] / predicted[1]) / (seconds / measured[1])
            self.worst = ratio if self.worst is None else max(self.worst, ratio)
            self.observations += 1


def with_a_chance(predicted: Mapping[int, float], margin: float) -> list[int]:
    """The splits (K > 1) whose predicted step is within ``margin`` times K = 1's, best
    predicted first."""
    serial = predicted[1]
    return sorted((k for k, s in predicted.items() if k != 1 and s <= serial * margin),
                  key=lambda k: (predicted[k], k))


def ruled_out(predicted: Mapping[int, float], margin: float) -> str:
    """Why no split is tried (one line, for the log and the timeline)."""
    splits = {k: s / predicted[1] for k, s in predicted.items() if k != 1}
    if not splits:
        return "K=1 locked without trials: no split is allowed at this size"
    best = min(splits, key=lambda k: (splits[k], k))
    return (f"K=1 locked without trials: the model predicts every split slower than K=1 by "
            f"more than its error allows (best K={best} at {splits[best]:.2f}x, margin "
            f"{margin:.2f}x)")
