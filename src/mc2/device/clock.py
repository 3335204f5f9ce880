"""One clock for every time mc2 takes: the host's on CPU, device events on accelerators.

Why: on a GPU the host only *queues* work. A NCCL collective's future completes when it is
enqueued and a kernel launch returns at once, so a host clock around either measures the
launch, not the work: the planner would choose K from numbers that mean nothing and a trace
would show transfers of zero length. Device events are recorded into the stream with the work
and time it where it runs.

Both clocks speak in *stamps*: :meth:`Clock.stamp` marks "now" (on a device: after the work
queued so far on the current stream), :meth:`Clock.elapsed` gives the seconds between two
stamps, :meth:`Clock.seconds` places a stamp on the host's ``perf_counter`` axis so that host
and device spans share one time line. Reading a device stamp waits for it to be reached: a
host synchronisation, so it is done only where a number is needed (the planner's decisions,
a timeline being read), never on the pipeline's path.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from mc2.device.per_device import device_state
from mc2.device.streams import full_device


class HostClock:
    """``time.perf_counter``: the truth on CPU, where work runs when the host issues it."""

    device_type = "cpu"

    def stamp(self, stream: Any = None) -> float:
        """Now (``stream``: ignored; the host has one timeline)."""
        return time.perf_counter()

    def elapsed(self, start: Any, end: Any) -> float:
        return end - start

    def seconds(self, stamp: Any) -> float:
        return stamp

    def synchronize(self) -> None:
        """Nothing to wait for: host work is done when the host returns."""

    def time(self, fn: Callable[[], Any]) -> float:
        """Seconds ``fn()`` takes."""
        start = self.stamp()
        fn()
        return self.elapsed(start, self.stamp())

    def median(self, fn: Callable[[], Any], repeats: int) -> float:
        """The median of ``repeats`` timings of ``fn()``."""
        return statistics.median(self.time(fn) for _ in range(repeats))


class DeviceClock(HostClock):
    """Timing events in the device's current stream (``torch.Event(enable_timing=True)``).

    Args:
        device: the accelerator device whose streams are timed.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.device_type = self.device.type
        self._anchor: tuple[Any, float] | None = None

    def _event(self) -> Any:
        return torch.Event(device=self.device, enable_timing=True)

    def stamp(self, stream: Any = None) -> Any:
        """An event recorded after the work queued so far (on ``stream``, default current)."""
        event = self._event()
        if stream is None:
            event.record()
        else:
            event.record(stream)
        return event

    def elapsed(self, start: Any, end: Any) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def seconds(self, stamp: Any) -> float:
        """The stamp on the host's ``perf_counter`` axis, through an anchor event recorded
        once when the device was idle (so its time is the host's time)."""
        if self._anchor is None:
            self.synchronize()
            anchor = self._event()
            anchor.record()
            anchor.synchronize()
            self._anchor = (anchor, time.perf_counter())
        anchor, host = self._anchor
        stamp.synchronize()
        return host + anchor.elapsed_time(stamp) / 1e3

    def synchronize(self) -> None:
        torch.accelerator.synchronize(self.device)


HOST = HostClock()


def clock_for(device: torch.device | str | None) -> HostClock:
    """The clock that times work on ``device``: :data:`HOST` on CPU, a :class:`DeviceClock`
    (one per device, so that its anchor is taken once) on an accelerator."""
    if device is None or torch.device(device).type in ("cpu", "meta"):
        return HOST
    state = device_state(full_device(device))
    if state.clock is None:  # one per device: its anchor is taken once
        state.clock = DeviceClock(full_device(device))
    return state.clock


class Interval:
    """Two stamps of one clock, read as seconds only when asked (on a device that waits for the
    later stamp, so intervals are kept unread until a decision needs them)."""

    __slots__ = ("clock", "start", "end")

    def __init__(self, clock: HostClock, start: Any, end: Any) -> None:
        self.clock, self.start, self.end = clock, start, end

    @property
    def seconds(self) -> float:
        return self.clock.elapsed(self.start, self.end)
