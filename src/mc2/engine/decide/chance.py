"""Which splits the cost model gives a chance, so that ``"auto"`` tries only those.

Why: every trial of a split that cannot win is a slow call a user pays for. At decode sizes (a
few tokens per rank) each extra micro-batch runs every local expert's GEMMs once more and adds
two All-to-All latencies per pass, with nothing to hide behind. The model already ranks those
splits far behind K = 1; the trials are for what it cannot tell apart.

A split is tried only where its predicted step is within a margin of K = 1's: the model's own
error on this group times :data:`SAFETY`, or :data:`PRIOR_MARGIN` before any trial has
finished; errors in the other direction only ever make splits lose, which the trials see.
See docs/planner.md, 'Trials only where a split has a chance' (the rule, why 1.4x).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

# Before any measurement: a split predicted up to 1.4x K = 1's step is tried (the model
# over-states splits' losses at small sizes; why 1.4: docs/planner.md)
PRIOR_MARGIN = 1.4
# On top of the measured error: trial medians of one K differ between runs (docs/planner.md)
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
