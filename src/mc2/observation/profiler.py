"""See the overlap: a per-rank timeline of every micro-batch's dispatch, compute, combine and wait.

Usage::

    with mc2.profile() as prof:          # every fused_expert call inside is recorded
        with prof.step():                # optional: mark training steps
            loss = model(x).sum(); loss.backward()
    ranks = prof.gather()                # collective: every rank's spans (call on all ranks)
    print(prof.metrics(tokens=x.shape[0]))
    write_chrome_trace("trace.json", {"mc2": ranks})

The profiler is an object the caller holds; ``profile()`` only makes it the *active* one for the
calls made inside the ``with`` block (a ``contextvars`` variable, so threads and tasks do not
leak into each other). Recording costs a ``perf_counter`` pair per span and one future callback
per asynchronous transfer; ``mc2 bench --trace`` reports the measured overhead.
"""

from __future__ import annotations

import contextvars
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch.distributed as dist

from mc2.observation.timeline import Span, Timeline

_ACTIVE: contextvars.ContextVar["Profiler | None"] = contextvars.ContextVar(
    "mc2_active_profiler", default=None
)


def active_timeline() -> Timeline | None:
    """The timeline of the profiler active in this context, if any."""
    prof = _ACTIVE.get()
    return None if prof is None else prof.timeline


@dataclass(frozen=True)
class RankMetrics:
    """The quantities of :mod:`mc2.observation.metrics` for one rank over the profiled window (seconds)."""

    step_s: float  # window (or mean marked step) time
    comm_s: float  # union of communication intervals (sync collectives and transfers)
    exposed_comm_s: float  # time the caller was blocked on communication
    compute_s: float
    comm_share: float  # exposed / step
    tokens_per_s: float


def union_length(intervals: Sequence[tuple[float, float]]) -> float:
    """The length ``intervals`` cover (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def metrics_of(spans: Sequence[Span], *, tokens: int = 0, steps: int = 1) -> RankMetrics:
    """Metrics of one rank's spans; ``steps`` divides the totals into per-step values. Where
    steps are marked, only what falls inside them counts (before, a warm-up's spans outside
    them were counted over the marked window: a 2 s wait in a 10 s step beside a warm-up gave
    a comm share of 0.70), and exposed communication is the union of the waits, not their
    sum (two threads' overlapping waits block the rank once)."""
    work = [s for s in spans if s.kind != "step"]
    marked = [(s.start, s.end) for s in spans if s.kind == "step"]
    if marked:
        window = sum(end - start for start, end in marked)
        steps = len(marked)
    elif work:
        window = max(s.end for s in work) - min(s.start for s in work)
    else:
        window = 0.0

    def inside(kinds: tuple[str, ...]) -> list[tuple[float, float]]:
        got = [(s.start, s.end) for s in work if s.kind in kinds]
        if not marked:
            return got
        return [(max(a, start), min(b, end)) for a, b in got for start, end in marked
                if min(b, end) > max(a, start)]

    comm = union_length(inside(("comm", "transfer")))
    exposed = union_length(inside(("comm", "wait")))
    compute = sum(b - a for a, b in inside(("compute",)))
    step = window / steps if steps else 0.0
    return RankMetrics(
        step_s=step, comm_s=comm / steps, exposed_comm_s=exposed / steps,
        compute_s=compute / steps, comm_share=exposed / window if window else 0.0,
        tokens_per_s=tokens / step if step else 0.0,
    )


class Profiler:
    """Records the spans of the ``fused_expert`` calls made while it is active."""

    def __init__(self) -> None:
        self.timeline = Timeline()
        self.wall_offset = time.time() - time.perf_counter()  # aligns ranks on other hosts

    @contextmanager
    def step(self) -> Iterator[None]:
        """Mark one training step (forward + backward); metrics are then per marked step."""
        with self.timeline.span("step", "step", "step"):
            yield

    @property
    def spans(self) -> list[Span]:
        return self.timeline.spans

    @property
    def sync_fallback(self) -> str | None:
        """Why a call that asked for overlap ran synchronously (``None``: it did not)."""
        return self.timeline.sync_fallback

    def gather(self, group: Any = None) -> list[list[Span]]:
        """Every rank's spans, in rank order, on a common wall clock (a collective)."""
        shifted = [Span(s.kind, s.name, s.phase, s.micro_batch, s.start + self.wall_offset,
                        s.end + self.wall_offset) for s in self.spans]
        if not dist.is_available() or not dist.is_initialized() or \
                dist.get_world_size(group) == 1:
            return [shifted]
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, shifted, group=group)
        return out

    def metrics(self, *, tokens: int = 0) -> RankMetrics:
        """This rank's metrics; ``tokens`` is the local tokens per step, for tokens/s."""
        return metrics_of(self.spans, tokens=tokens)


@contextmanager
def profile() -> Iterator[Profiler]:
    """Make a new :class:`Profiler` active for the calls inside the ``with`` block."""
    prof = Profiler()
    token = _ACTIVE.set(prof)
    try:
        yield prof
    finally:
        _ACTIVE.reset(token)


def aggregate(per_rank: Sequence[RankMetrics]) -> RankMetrics:
    """The group's view: the slowest rank's step, the mean of the other quantities."""
    n = max(len(per_rank), 1)
    means = {f.name: sum(getattr(m, f.name) for m in per_rank) / n for f in fields(RankMetrics)}
    return RankMetrics(**{**means, "step_s": max(m.step_s for m in per_rank)})


# --- Chrome trace / Perfetto ------------------------------------------------------------------

ENGINES = {"compute": 0, "wait": 0, "comm": 1, "transfer": 1}
ENGINE_NAMES = {0: "compute", 1: "communication"}


def _label(s: Span) -> str:
    what = {"wait": f"wait {s.name}", "transfer": s.name, "comm": s.name}.get(s.kind, s.name)
    return what if s.micro_batch < 0 else f"{what} [{s.phase[:3]} {s.micro_batch}]"


def chrome_trace(runs: dict[str, Sequence[Sequence[Span]]]) -> dict[str, Any]:
    """A Chrome-trace (Perfetto) JSON object: one process per (run, rank), one thread per engine.

    Args:
        runs: run label (e.g. ``"serial"``, ``"mc2 K=4"``) -> per-rank span lists, as returned
            by :meth:`Profiler.gather`. Every run starts at time 0 so they compare side by side.
    """
    events: list[dict[str, Any]] = []
    for run_index, (label, ranks) in enumerate(runs.items()):
        origin = min((s.start for spans in ranks for s in spans), default=0.0)
        for rank, spans in enumerate(ranks):
            pid = run_index * 1000 + rank
            events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                           "args": {"name": f"{label} / rank {rank}"}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                           "args": {"sort_index": pid}})
            for tid, name in ENGINE_NAMES.items():
                events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                               "args": {"name": name}})
            for s in spans:
                if s.kind == "step":
                    continue
                events.append({
                    "name": _label(s), "cat": s.kind, "ph": "X", "pid": pid,
                    "tid": ENGINES[s.kind], "ts": (s.start - origin) * 1e6,
                    "dur": max(s.duration, 0.0) * 1e6,
                    "args": {"phase": s.phase, "micro_batch": s.micro_batch, "kind": s.kind},
                })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, runs: dict[str, Sequence[Sequence[Span]]]) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(runs)))
    return path
