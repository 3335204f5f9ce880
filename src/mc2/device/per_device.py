"""What this process keeps per accelerator device: one object per device, in one table.

Why module-level: a device is the process's, not a group's or a call's. Its side streams
(:mod:`~mc2.device.streams`), its clock, whose host anchor is taken once
(:mod:`~mc2.device.clock`), and measurements of what runs faster on it (the GEMM strategy
of ``gemm="auto"``, :mod:`~mc2.engine.decide.gemm_strategy`) hold for every group and call on
it; keeping them on one object per device leaves one table where there were three.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class DeviceState:
    """One device's state in this process.

    Attributes:
        streams: side streams by purpose.
        clock: its clock (made on first use).
        gemm: the GEMM strategy measured faster, by the weights' layout and shape.
    """

    streams: dict[str, Any] = field(default_factory=dict)
    clock: Any = None
    gemm: dict[tuple, str] = field(default_factory=dict)


_DEVICES: dict[torch.device, DeviceState] = {}


def device_state(device: torch.device) -> DeviceState:
    """``device``'s state (``device`` with its index: :func:`~mc2.device.streams.full_device`)."""
    state = _DEVICES.get(device)
    if state is None:
        state = _DEVICES[device] = DeviceState()
    return state
