"""A minimal, caller-owned recorder of where a call's time goes.

The pipeline reports spans to a :class:`Timeline` when one is passed (``fused_expert(...,
timeline=tl)``); nothing is recorded otherwise and there is no global state. Spans are taken with
the clock of the call's device (:mod:`mc2.device.clock`): the host's ``perf_counter`` on CPU,
timing events in the device stream on an accelerator (the host only queues work there, so a
host clock would time the queueing). Device spans are resolved onto the host's time axis when
:attr:`Timeline.spans` is read, which waits for the device once.

* ``compute``: expert math of one micro-batch (plus local permutes);
* ``comm``: a synchronous collective, blocking the caller for its whole duration;
* ``wait``: the caller blocked in ``wait()`` on an asynchronous collective: communication that
  was *not* hidden (on a stream backend: the compute stream stalled on the transfer);
* ``transfer``: an asynchronous collective in flight, from its issue to its completion (on a
  host backend as the backend reports it; on a stream backend from device events).

Exposed communication (``docs/profiling.md``) is the sum of ``comm`` and ``wait`` spans.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterator, Literal

from mc2.device.clock import HOST, HostClock, clock_for

SpanKind = Literal["compute", "comm", "wait", "transfer", "step"]


@dataclass(frozen=True)
class Span:
    """One recorded interval (seconds on the host's ``perf_counter`` axis)."""

    kind: SpanKind
    name: str  # e.g. "dispatch", "combine", "experts", "counts"
    phase: str  # "forward" or "backward"
    micro_batch: int  # -1 for whole-call work such as the counts exchange
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


def _seconds(stamp: Any) -> float:
    """A host stamp as it is, a device event through its device's clock."""
    return float(stamp) if isinstance(stamp, (int, float)) else clock_for(stamp.device).seconds(stamp)


@dataclass
class Timeline:
    """Spans recorded by the pipeline; ``clear()`` between steps, or keep accumulating.

    Attributes:
        clock: what spans are timed with; a call on an accelerator binds its device's clock
            (:meth:`bind`).
        sync_fallback: why overlap was requested but ran synchronously, if it did.
        label: the micro-batch every span is filed under (a :meth:`labelled` view), if any.
    """

    _records: list[tuple] = field(default_factory=list)
    sync_fallback: str | None = None
    clock: HostClock = HOST
    label: int | None = None
    _root: "Timeline | None" = None

    def labelled(self, label: int) -> "Timeline":
        """A view of this timeline that files every span under micro-batch ``label`` (batch
        overlap's two micro-batches are 0 and 1, so a trace shows both of every layer); its
        records and ``sync_fallback`` are this timeline's."""
        return Timeline(self._records, clock=self.clock, label=label, _root=self._root or self)

    def fell_back(self, reason: str) -> None:
        """Note that overlap ran synchronously, and why."""
        (self._root or self).sync_fallback = reason

    def bind(self, device: Any) -> None:
        """Time the following spans with ``device``'s clock."""
        self.clock = clock_for(device)

    @property
    def spans(self) -> list[Span]:
        """Every span so far, in host seconds (waits for the device where spans came from it)."""
        resolved = [r if isinstance(r, Span) else Span(*r[:4], _seconds(r[4]), _seconds(r[5]))
                    for r in self._records]
        self._records[:] = resolved
        return list(resolved)

    def clear(self) -> None:
        self._records.clear()
        self.sync_fallback = None

    @contextmanager
    def span(self, kind: SpanKind, name: str, phase: str, micro_batch: int = -1) -> Iterator[None]:
        clock = self.clock
        start = clock.stamp()
        try:
            yield
        finally:
            self.add(kind, name, phase, micro_batch, start, clock.stamp())

    def add(self, kind: SpanKind, name: str, phase: str, micro_batch: int, start: Any,
            end: Any) -> None:
        """Record a span measured elsewhere (e.g. a transfer completed on a backend thread);
        ``start`` and ``end`` are host seconds or device events."""
        label = micro_batch if self.label is None else self.label
        self._records.append((kind, name, phase, label, start, end))

    def mark(self, kind: SpanKind, name: str, phase: str, micro_batch: int = -1) -> None:
        """A zero-length span at "now" (e.g. ``auto trial K=...``)."""
        now = self.clock.stamp()
        self.add(kind, name, phase, micro_batch, now, now)

    def total(self, *kinds: SpanKind) -> float:
        """Summed duration of the spans of the given kinds (seconds)."""
        return sum(s.duration for s in self.spans if s.kind in kinds)

    @property
    def exposed_comm(self) -> float:
        """Seconds the caller spent blocked on communication."""
        return self.total("comm", "wait")


def maybe_span(timeline: Timeline | None, kind: SpanKind, name: str, phase: str,
               micro_batch: int = -1) -> ContextManager[None]:
    """``timeline.span(...)`` when recording, a no-op otherwise."""
    if timeline is None:
        return nullcontext()
    return timeline.span(kind, name, phase, micro_batch)
