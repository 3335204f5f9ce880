"""Workers for the drift guard of ``"auto"``: a shape whose steady state slows down after its
lock (an experts stage that starts taking longer, as a slower link or a neighbour's job would).

The passes are timed on a simulated clock that only the experts advance: the decisions then
depend on what the test sets, never on how loaded the machine is."""

from __future__ import annotations

import logging
from typing import Any

import torch

import mc2
from tests.workers import PriorPlanner


class SimulatedClock:
    """A host clock whose time passes only when :meth:`advance` says."""

    def __init__(self) -> None:
        self.now = 0.0

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def stamp(self, *_: Any) -> float:
        return self.now

    def elapsed(self, start: float, end: float) -> float:
        return end - start


class _SlowableExperts(torch.nn.Module):
    """Two local linear experts; each forward takes 1 ms of ``clock``, plus ``delay``, plus
    ``training`` where gradients are on (a training forward keeps what its backward needs)."""

    def __init__(self, hidden: int, seed: int, clock: SimulatedClock) -> None:
        super().__init__()
        self.clock = clock
        g = torch.Generator().manual_seed(seed)
        self.num_experts = 2
        self.w = torch.nn.Parameter(torch.randn(2, hidden, hidden, generator=g) / hidden**0.5)
        self.delay = self.training_s = 0.0

    def forward(self, rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        self.clock.advance(0.001 + self.delay + self.training_s * torch.is_grad_enabled())
        return torch.bmm(rows.unsqueeze(1), self.w[ids[:, 0]]).squeeze(1) * weights


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def drifting_shape(rank: int, world: int, drift: float, quiet: int, slow: int,
                   delay: float) -> dict[str, Any]:
    """``quiet`` calls after the lock as the trials saw them, then ``slow`` calls with every
    experts forward ``delay`` seconds slower. Returns per call the K used and whether it was
    a trial, the decision, the planner's log lines and the outputs' largest error against the
    first call's."""
    lines = _Lines()
    log = logging.getLogger("mc2.engine.decide.planner")
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    import mc2.engine.passes.run as passes

    clock = SimulatedClock()
    passes.clock_for = lambda device: clock  # the passes' times, which the planner reads
    hidden, tokens = 32, 64
    experts = _SlowableExperts(hidden, 10 + rank, clock)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.randint(0, world * 2, (tokens, 2), generator=g)
    planner = PriorPlanner([1, 2], candidates=(1, 2), explore=2, trials=2, recheck=0,
                           drift=drift, drift_window=4)
    calls: list[dict[str, Any]] = []
    first = None
    errors = []

    def call() -> None:
        nonlocal first
        out = _auto_call(x, experts, ids, planner, calls)
        first = out.detach() if first is None else first
        errors.append(float((out.detach() - first).abs().max()))

    call()  # a first call: the shape's trials begin
    while not planner.settled():  # the call that locks the shape settles it
        call()
    locked_at = len(calls)  # the first call that runs the lock
    for _ in range(quiet):
        call()
    experts.delay = delay
    for _ in range(slow):
        call()
    log.removeHandler(lines)
    (decision,) = planner.decisions().values()
    return {"calls": calls, "locked_at": locked_at, "decision": decision, "lines": lines.lines,
            "max_err": max(errors)}


class ChangingModelPlanner(mc2.Planner):
    """A planner whose cost model gives K = 2 no chance on its first calibration and a good
    one on every later calibration (as a model measured again on a link that got slower
    would): its calibrations are counted, not measured."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.measured = 0

    def _measure(self, *args: Any, **kwargs: Any) -> Any:
        from mc2.engine.decide.planner import Calibration

        self.measured += 1
        return Calibration(0.0, 0.0, 0.0, 0.0, 0.0)

    def predictions(self, *, quick: bool = False, **shape: Any) -> dict[int, float]:
        if quick:
            self.quick_calibration(shape["weights"], shape["group"])
        else:
            self.calibration(shape["weights"], shape["group"],
                             rows=shape["max_tokens"] * shape["topk"])
        return {1: 1.0, 2: 3.0 if self.measured <= 1 else 0.9}


def serial_lock_revisited(rank: int, world: int, quiet: int, slow: int, delay: float,
                          no_grad_first: bool = False) -> dict[str, Any]:
    """A shape the model locks at K = 1 without trials; ``quiet`` calls as they were, then
    ``slow`` calls with every experts forward ``delay`` seconds slower (the simulated clock of
    :func:`drifting_shape`). Per call the K used, whether it was a trial or a re-plan; the
    decision and how often the planner calibrated. ``no_grad_first``: the ``quiet`` calls run
    without gradients (forwards alone), and a training forward takes 50 ms more."""
    import mc2.engine.passes.run as passes

    clock = SimulatedClock()
    passes.clock_for = lambda device: clock
    hidden, tokens = 32, 64
    experts = _SlowableExperts(hidden, 10 + rank, clock)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.randint(0, world * 2, (tokens, 2), generator=g)
    planner = ChangingModelPlanner(candidates=(1, 2), explore=2, trials=2, recheck=0,
                                   drift=0.5, drift_window=4)
    calls: list[dict[str, Any]] = []

    experts.training_s = 0.05 if no_grad_first else 0.0
    for _ in range(quiet):
        with torch.set_grad_enabled(not no_grad_first):
            _auto_call(x, experts, ids, planner, calls)
    experts.delay = delay
    for _ in range(slow):
        _auto_call(x, experts, ids, planner, calls)
    # the last kind's (training calls after forwards alone: each kind decides on its own)
    decision = list(planner.decisions().values())[-1]
    return {"calls": calls, "decision": decision, "measured": planner.measured}


def _auto_call(x: torch.Tensor, experts: torch.nn.Module, ids: torch.Tensor, planner: Any,
               calls: list[dict[str, Any]]) -> torch.Tensor:
    """One ``"auto"`` forward and backward of the experts module; filed in ``calls``: the K
    it ran, whether it was a trial, whether it re-planned. Returns its output."""
    tl = mc2.Timeline()
    grad = torch.is_grad_enabled()
    out = mc2.fused_expert_module(x.clone().requires_grad_(grad), experts, ids,
                                  micro_batches="auto", planner=planner, timeline=tl)
    if grad:
        out.sum().backward()
    marks = [s.name for s in tl.spans if s.name.startswith("auto")]
    calls.append({"k": 1 + max((s.micro_batch for s in tl.spans), default=0),
                  "trial": any(m.startswith("auto trial") for m in marks),
                  "replan": any(m.startswith("auto re-planning") for m in marks)})
    return out
