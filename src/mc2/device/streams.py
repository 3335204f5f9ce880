"""Side streams of an accelerator, made once per device and purpose.

The pipeline's compute runs on the caller's current stream. Work that must wait for a transfer
without making the compute wait with it runs on a side stream: the middle step of a 2-D
exchange (a permutation between its two stages) and the observer that times transfers. On CPU
there are no streams: :func:`side_stream` returns a do-nothing context, so the same code runs
there.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from mc2.device.per_device import device_state


def full_device(device: torch.device | str) -> torch.device:
    """``device`` with its index (``"cuda"`` -> ``cuda:<current>``); CPU as it is."""
    device = torch.device(device)
    if device.index is None and device.type not in ("cpu", "meta") \
            and torch.accelerator.is_available():
        return torch.device(device.type, torch.accelerator.current_device_index())
    return device


def side_stream(device: torch.device | str, purpose: str) -> Any:
    """The stream for ``purpose`` on ``device`` (a ``torch.Stream``, usable as a context that
    makes it current), or a null context on CPU."""
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return contextlib.nullcontext()
    device = full_device(device)
    streams = device_state(device).streams
    if purpose not in streams:
        streams[purpose] = torch.Stream(device=device)
    return streams[purpose]


def capturing(device: torch.device | str | None) -> bool:
    """Whether the current stream of ``device`` is capturing a graph (CUDA's
    ``torch.cuda.is_current_stream_capturing``, or the same function of another accelerator's
    module, e.g. ``torch.npu``); ``False`` on CPU.

    Why one function: inside a capture nothing may poll a work or an event, read a host clock
    or leave a side stream unjoined, and every place of mc2 that would asks here (a test makes
    it say ``True`` on CPU).
    """
    if device is None:
        return False
    kind = torch.device(device).type
    if kind in ("cpu", "meta"):
        return False
    module = getattr(torch, kind, None)
    ask = getattr(module, "is_current_stream_capturing", None)
    return bool(ask()) if ask is not None else False


def current_stream(device: torch.device | str) -> Any:
    """The caller's current stream on ``device`` (``None`` on CPU)."""
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return None
    return torch.accelerator.current_stream(full_device(device))


def wait_for_current(stream: Any, device: torch.device | str) -> None:
    """``stream`` waits for the work queued so far on the current stream (no-op on CPU)."""
    current = current_stream(device)
    if current is not None and hasattr(stream, "wait_stream"):
        stream.wait_stream(current)
