"""Whether a model's forward splits its batch in two (batch overlap): agreed on every rank, and
under ``"auto"`` measured, on the group's planner.

Why here and not in the integration: it is the same kind of decision as ``"auto"``'s K (a
split of the work into micro-batches, kept only where it measured faster), made with the same
rules (:func:`mc2.engine.decide.trials.trial_winner`: the split must beat the unsplit run by a
margin, or the unsplit one stays) and the same collectives; an integration only asks
(:meth:`mc2.engine.decide.planner.Planner.batch_overlap`).

When it runs: every rank must split or not (the micro-batches make different collectives), so
the decision is agreed in one small ``all_reduce`` per forward. It is off, and says so once
(:class:`BatchOverlapWarning`), where it cannot or should not run: a batch of fewer than two
sequences, fewer tokens than ``min_tokens`` (too small to hide anything behind: the measured
threshold is in ``docs/batch_overlap.md``), or what the caller names (a KV cache that holds
tokens, a block that cannot be staged, ...). ``"auto"`` also measures: the first forwards (with
their backwards, in training: :func:`timed_forward`) alternate with and without the split, and
the faster one stays.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from mc2.device.clock import clock_for
from mc2.engine.decide.trials import Candidate, trial_stats, trial_winner
from mc2.engine.transport.comm import all_reduce_max
from mc2.engine.transport.host import read, upload
from mc2.observation.once import warn_once

MIN_TOKENS = 1024  # tokens per rank below which the split cannot pay (docs/batch_overlap.md)
# micro-batches per forward: more shrank the fill and drain but not the step in any sitting
# (its backward's weight gradients ran in GEMMs of half the rows; docs/batch_overlap.md)
SPLITS = 2
MIN_GAIN = 0.03  # the split must be this much faster than the unsplit forward
_SIDES = {False: Candidate.of(1), True: Candidate.of(SPLITS)}


class BatchOverlapWarning(UserWarning):
    """Batch overlap was asked for and does not run (said once per reason)."""


def say_once(reason: str) -> None:
    warn_once(f"mc2 batch overlap is off: {reason}", BatchOverlapWarning, stacklevel=3)


class BatchOverlapDecision:
    """Whether a forward runs with batch overlap; the same answer on every rank.

    Args:
        mode: ``True``, ``False`` or ``"auto"`` (measure, see the module docstring).
        min_tokens: tokens per rank below which it is off.
        group: the expert-parallel group the agreement runs on.
        trials: forwards measured each way under ``"auto"`` (each with its backward through
            the layers, when one follows: :func:`timed_forward`).
    """

    def __init__(self, mode: bool | str, *, min_tokens: int = MIN_TOKENS, group: Any = None,
                 trials: int = 3) -> None:
        if mode not in (True, False, "auto"):
            raise ValueError(f"batch_overlap must be True, False or 'auto', got {mode!r}")
        self.mode, self.min_tokens, self.group, self.trials = mode, min_tokens, group, trials
        self.times: dict[bool, list[float]] = {True: [], False: []}
        self.chosen: bool | None = None if mode == "auto" else bool(mode)
        # "auto": the first forward after switching sides is not timed. It reallocates the
        # workspace for the other side's buffer sizes; timed, batch overlap's trials (each
        # right after a plain one) measured 11-15% over its steady state in
        # benchmarks/model_overlap.py, and "auto" turned it off where it was 9% faster. A job
        # runs the steady state. (The K trials settle a switch the same way.)
        self.warming: bool = False
        self._last: bool | None = None

    def wanted(self, batch: int, tokens: int, device: torch.device,
               problem: str | None = None) -> bool:
        """This forward's answer (one ``all_reduce`` when batch overlap may run); ``problem``:
        why the caller cannot split this forward, if it cannot."""
        if self.chosen is False:
            return False
        reason = problem
        if reason is None and batch < SPLITS:
            reason = f"a batch of fewer than {SPLITS} sequences cannot be split in two"
        elif reason is None and tokens < self.min_tokens:
            reason = (f"{tokens} tokens per rank are fewer than min_tokens={self.min_tokens} "
                      "(too few to hide communication behind)")
        # one all_reduce and one read a forward: whether any rank cannot split
        flag = upload([0 if reason is None else 1], device)
        (cannot,) = read(all_reduce_max(flag, self.group, "batch overlap"))
        if cannot:
            say_once(reason or "another rank cannot split its batch")
            self._last = False  # the plain side runs: a trial of it next is no switch
            return False
        if self.chosen is None:  # "auto": alternate until both sides are measured
            side = len(self.times[True]) <= len(self.times[False])
            self.warming, self._last = side != self._last, side
            return side
        return self.chosen

    def measured(self, overlapped: bool, seconds: float, device: torch.device) -> None:
        """One forward's time (with its backward's), the group's slowest rank's; decides
        ``"auto"`` once both sides have ``trials`` times, as the K trials decide."""
        if self.chosen is not None:
            return
        agreed = all_reduce_max(upload([seconds], device, torch.float64), self.group,
                                "batch overlap")
        self.times[overlapped].append(float(read(agreed)[0]))
        if min(len(t) for t in self.times.values()) < self.trials:
            return
        sides = (False, True)
        stats = trial_stats([_SIDES[s] for s in sides], [self.times[s] for s in sides])
        winner = trial_winner([_SIDES[s] for s in sides], [s.median_s for s in stats],
                              MIN_GAIN)
        self.chosen = winner == _SIDES[True]
        if not self.chosen:
            off, on = (s.median_s for s in stats)
            say_once(f"measured slower here ({on * 1e3:.1f} ms against {off * 1e3:.1f} ms "
                     "a forward)")


def timed_forward(decision: BatchOverlapDecision, overlapped: bool, run: Callable[[], Tensor],
                  device: torch.device, first: Tensor | None = None) -> Tensor:
    """``run()``, timed for an undecided ``"auto"``.

    A forward that a backward will follow (``first``, the layers' input, and the output
    both need gradients) is timed with that backward through the layers: batch overlap
    interleaves both passes, and on a link slow against the compute it can gain more in one
    than in the other. The backward is timed from the moment the output's gradient reaches
    the layers to the moment the input's gradient is complete (tensor hooks), so what the
    caller does between forward and backward (the loss, the head) does not count. A forward
    without a backward (inference, a no-grad prefill) is timed alone.
    """
    if decision.chosen is not None or decision.warming:
        return run()
    clock = clock_for(device)
    start = clock.stamp()
    out = run()
    forward = clock.elapsed(start, clock.stamp())
    if first is None or not (first.requires_grad and out.requires_grad):
        decision.measured(overlapped, forward, device)
        return out
    began: list[Any] = []

    def backward_begins(grad: Tensor) -> None:
        began.append(clock.stamp())

    def backward_ends(grad: Tensor) -> None:
        for handle in handles:  # once: a caller's own input tensor keeps no hooks of ours
            handle.remove()
        if began:
            decision.measured(overlapped, forward + clock.elapsed(began[0], clock.stamp()),
                              device)

    handles = [out.register_hook(backward_begins), first.register_hook(backward_ends)]
    return out
