"""A minimal, caller-owned recorder of where a call's time goes.

The pipeline reports spans to a :class:`Timeline` when one is passed (``fused_expert(...,
timeline=tl)``); nothing is recorded otherwise and there is no global state. Spans are host
wall-clock (``time.perf_counter``) seen from the calling thread:

* ``compute``: expert math of one micro-batch (plus local permutes);
* ``comm``: a synchronous collective, blocking the caller for its whole duration;
* ``wait``: the caller blocked in ``wait()`` on an asynchronous collective: communication that
  was *not* hidden;
* ``transfer``: an asynchronous collective in flight, from its issue to its completion as the
  backend reports it (recorded from the backend's thread; on accelerators this is when the
  host learns of completion).

Exposed communication (DESIGN.md §6) is the sum of ``comm`` and ``wait`` spans.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Literal

SpanKind = Literal["compute", "comm", "wait", "transfer", "step"]


@dataclass(frozen=True)
class Span:
    """One recorded interval (seconds, ``perf_counter`` clock)."""

    kind: SpanKind
    name: str  # e.g. "dispatch", "combine", "experts", "counts"
    phase: str  # "forward" or "backward"
    micro_batch: int  # -1 for whole-call work such as the counts exchange
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """Spans recorded by the pipeline; ``clear()`` between steps, or keep accumulating."""

    spans: list[Span] = field(default_factory=list)
    sync_fallback: str | None = None  # why overlap was requested but ran synchronously

    def clear(self) -> None:
        self.spans.clear()
        self.sync_fallback = None

    @contextmanager
    def span(self, kind: SpanKind, name: str, phase: str, micro_batch: int = -1) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append(Span(kind, name, phase, micro_batch, start, time.perf_counter()))

    def add(self, kind: SpanKind, name: str, phase: str, micro_batch: int, start: float,
            end: float) -> None:
        """Record a span measured elsewhere (e.g. a transfer completed on a backend thread)."""
        self.spans.append(Span(kind, name, phase, micro_batch, start, end))

    def total(self, *kinds: SpanKind) -> float:
        """Summed duration of the spans of the given kinds (seconds)."""
        return sum(s.duration for s in self.spans if s.kind in kinds)

    @property
    def exposed_comm(self) -> float:
        """Seconds the caller spent blocked on communication."""
        return self.total("comm", "wait")


@contextmanager
def maybe_span(
    timeline: Timeline | None, kind: SpanKind, name: str, phase: str, micro_batch: int = -1
) -> Iterator[None]:
    """``timeline.span(...)`` when recording, a no-op otherwise."""
    if timeline is None:
        yield
    else:
        with timeline.span(kind, name, phase, micro_batch):
            yield
