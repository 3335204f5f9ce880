"""Whether a model's forward splits its batch in two (batch overlap): agreed on every rank, and
under ``"auto"`` measured, on the group's planner.

Why here and not in the integration: it is the same kind of decision as ``"auto"``'s K (a
split of the work into micro-batches, kept only where it measured faster), made with the same
rules (:func:`mc2.engine.decide.trials.trial_winner`: the split must beat the unsplit run by a
margin, or the unsplit one stays) and the same collectives; an integration only asks
(:meth:`mc2.engine.decide.planner.Planner.batch_overlap`). The agreement is in host memory
(:func:`~mc2.engine.transport.comm.host_max`) so that a capacity-mode step reads nothing from
the device.

See docs/batch_overlap.md, 'When it runs' (when it is off, how ``"auto"`` times a training
step and a forward alone apart).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from mc2.device.clock import clock_for
from mc2.engine.decide.trials import Candidate, trial_stats, trial_winner
from mc2.engine.transport.comm import host_max, host_ranges
from mc2.observation.once import warn_once

MIN_TOKENS = 1024  # tokens per rank below which the split cannot pay (docs/batch_overlap.md)
# micro-batches per forward: more shrank the fill and drain but not the step in any sitting
# (its backward's weight gradients ran in GEMMs of half the rows; docs/batch_overlap.md)
SPLITS = 2
MIN_GAIN = 0.03  # the split must be this much faster than the unsplit forward
_SIDES = {False: Candidate.of(1), True: Candidate.of(SPLITS)}
MODE_CODES = {False: 0, True: 1, "auto": 2}  # a mode, as the ranks agree it


def check_mode(value: Any, name: str, who: str = "") -> None:
    """Refuse a mode other than those of :data:`MODE_CODES` (``ValueError`` naming ``name``,
    after ``who: `` where given): checked where it is passed, before any rank agrees it."""
    if value not in tuple(MODE_CODES):  # a tuple: compared, not hashed (a list is refused too)
        prefix = f"{who}: " if who else ""
        raise ValueError(f"{prefix}{name} must be True, False or 'auto', got {value!r}")


def mode_name(code: float) -> str:
    """The mode of a code of :data:`MODE_CODES`, as the caller wrote it."""
    return next(repr(mode) for mode, c in MODE_CODES.items() if c == int(code))


class BatchOverlapWarning(UserWarning):
    """Batch overlap was asked for and does not run (said once per reason)."""


def say_once(reason: str, what: str = "batch overlap") -> None:
    warn_once(f"mc2 {what} is off: {reason}", BatchOverlapWarning, stacklevel=3)


@dataclass
class SideTrials:
    """One kind of forward's trials under ``"auto"`` (a training step's, or a forward's alone).

    Attributes:
        times: the group's slowest rank's seconds, per side (``True``: split).
        chosen: the side decided (``None``: still measuring).
        warming: this forward switched sides, so it is not timed (see :class:`BatchOverlapDecision`).
        last: the side the previous forward ran.
    """

    chosen: bool | None
    times: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})
    warming: bool = False
    last: bool | None = None


class BatchOverlapDecision:
    """Whether a forward runs with batch overlap; the same answer on every rank.

    Args:
        mode: ``True``, ``False`` or ``"auto"`` (measure: docs/batch_overlap.md).
        min_tokens: tokens per rank below which it is off.
        group: the group the agreement runs on.
        trials: forwards measured each way under ``"auto"`` (each with its backward through
            the layers, when one follows: :func:`timed_forward`).

    ``"auto"``: the first forward after switching sides is not timed. It reallocates the
    workspace for the other side's buffer sizes; timed, it made ``"auto"`` turn batch overlap
    off where it was faster. A job runs the steady state. (The K trials settle a switch the
    same way.)
    """

    def __init__(self, mode: bool | str, *, min_tokens: int = MIN_TOKENS, group: Any = None,
                 trials: int = 3, what: str = "batch overlap", unit: str = "forward") -> None:
        check_mode(mode, "batch_overlap")
        self.mode, self.min_tokens, self.group, self.trials = mode, min_tokens, group, trials
        # what is measured, and per what, in its messages (mc2.forward_backward decides its
        # pairing so, per step)
        self.what, self.unit = what, unit
        first = None if mode == "auto" else bool(mode)
        # by whether a backward may follow (gradients on): a training step's and a forward's
        self.kinds = {True: SideTrials(first), False: SideTrials(first)}

    def now(self) -> SideTrials:
        """The trials of the forward about to run: a training step's where gradients are on."""
        return self.kinds[torch.is_grad_enabled()]

    @property
    def chosen(self) -> bool | None:
        """What this kind of forward runs (``None``: ``"auto"`` still measuring it)."""
        return self.now().chosen

    @chosen.setter
    def chosen(self, value: bool | None) -> None:
        self.now().chosen = value

    @property
    def times(self) -> dict[bool, list[float]]:
        return self.now().times

    @property
    def warming(self) -> bool:
        return self.now().warming

    def wanted(self, batch: int, tokens: int, problem: str | None = None) -> bool:
        """This forward's answer (one host ``all_reduce`` when batch overlap may run);
        ``problem``: why the caller cannot split this forward, if it cannot."""
        trials = self.now()
        if trials.chosen is False:
            return False
        reason = problem
        if reason is None and batch < SPLITS:
            reason = f"a batch of fewer than {SPLITS} sequences cannot be split in two"
        elif reason is None and tokens < self.min_tokens:
            reason = (f"{tokens} tokens per rank are fewer than min_tokens={self.min_tokens} "
                      "(too few to hide communication behind)")
        # whether any rank cannot split, and the mode (True on one rank and "auto" on
        # another split different forwards: a hang, or rows exchanged with the wrong call):
        # host numbers, agreed with no device read
        (_, cannot), (low, high) = host_ranges(
            [0 if reason is None else 1, MODE_CODES[self.mode]], self.group, "batch overlap")
        if low != high:
            raise ValueError(f"mc2 {self.what}: ranks disagree on its mode (between "
                             f"{mode_name(low)} and {mode_name(high)}); every rank must pass "
                             "the same")
        if cannot:
            say_once(reason or "another rank cannot split its batch", self.what)
            trials.last = False  # the plain side runs: a trial of it next is no switch
            return False
        if trials.chosen is None:  # "auto": alternate until both sides are measured
            side = len(trials.times[True]) <= len(trials.times[False])
            trials.warming, trials.last = side != trials.last, side
            return side
        return trials.chosen

    def measured(self, overlapped: bool, seconds: float, trials: SideTrials | None = None
                 ) -> None:
        """One forward's time (with its backward's), the group's slowest rank's, for
        ``trials`` (the current kind's by default); decides ``"auto"`` for that kind once
        both sides have ``trials`` times, as the K trials decide."""
        trials = trials or self.now()
        if trials.chosen is not None:
            return
        (agreed,) = host_max([seconds], self.group, "batch overlap")
        trials.times[overlapped].append(agreed)
        if min(len(t) for t in trials.times.values()) < self.trials:
            return
        sides = (False, True)
        stats = trial_stats([_SIDES[s] for s in sides], [trials.times[s] for s in sides])
        winner = trial_winner([_SIDES[s] for s in sides], [s.median_s for s in stats],
                              MIN_GAIN)
        trials.chosen = winner == _SIDES[True]
        if not trials.chosen:
            off, on = (s.median_s for s in stats)
            say_once(f"measured slower here ({on * 1e3:.1f} ms against {off * 1e3:.1f} ms "
                     f"a {self.unit})", self.what)

    def report(self) -> dict[str, Any]:
        """What it chose and measured: a training step's at the top, a forward's alone
        under ``"forward_only"``."""
        def one(t: SideTrials) -> dict[str, Any]:
            return {"chosen": t.chosen, "times": {"on": list(t.times[True]),
                                                 "off": list(t.times[False])}}
        return {"mode": self.mode, **one(self.kinds[True]), "forward_only": one(self.kinds[False])}


def timed_forward(decision: BatchOverlapDecision, overlapped: bool, run: Callable[[], Tensor],
                  device: torch.device, first: Tensor | None = None) -> Tensor:
    """``run()``, timed for an undecided ``"auto"``.

    A forward with gradients on is a training step's: it is timed with the backward through
    the layers that follows it, since batch overlap interleaves both passes, and on a link
    slow against the compute it can gain more in one than in the other. The backward is timed
    from the moment the output's gradient reaches the layers to the moment the input's
    gradient is complete (tensor hooks; where the input needs none, a frozen embedding under
    an adapter, to the end of the backward), so what the caller does between forward and
    backward (the loss, the head) does not count. A forward without gradients (inference, a
    no-grad prefill) is timed alone, for forwards alone (:class:`BatchOverlapDecision`); so
    is one whose layers need none (nothing of them to run backward).
    """
    trials = decision.now()
    if trials.chosen is not None or trials.warming:
        return run()
    clock = clock_for(device)
    start = clock.stamp()
    out = run()
    forward = clock.elapsed(start, clock.stamp())
    if not (torch.is_grad_enabled() and out.requires_grad):  # no backward through the layers
        decision.measured(overlapped, forward, trials)
        return out
    began: list[Any] = []

    def ended() -> None:
        for handle in handles:  # once: a caller's own input tensor keeps no hooks of ours
            handle.remove()
        if began:
            decision.measured(overlapped, forward + clock.elapsed(began[0], clock.stamp()),
                              trials)

    def backward_begins(grad: Tensor) -> None:
        began.append(clock.stamp())
        if not input_hooked:  # the backward's end is where the engine finishes it
            torch.autograd.Variable._execution_engine.queue_callback(ended)

    input_hooked = first is not None and first.requires_grad
    handles = [out.register_hook(backward_begins)]
    if input_hooked:
        handles.append(first.register_hook(lambda grad: ended()))
    return out
