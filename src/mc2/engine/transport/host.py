"""The only places where a call moves small values between the host and the device.

On an accelerator every device-to-host read (``.tolist()``, ``.item()``, ``.cpu()``, ``int(t)``,
``nonzero``, ``bincount``, boolean masks) waits until the device has run everything queued
before it, so the host stops queueing work and the pipeline drains. A call of
:func:`mc2.fused_expert` needs split sizes on the host (``all_to_all_single`` takes Python lists),
so it reads exactly twice per forward and never in the backward:

1. :func:`read` after the handshake (errors, agreed values, the expert-id range: one vector);
2. :func:`read` after the counts exchange (every split of every micro-batch: one vector).

and uploads once (:func:`upload`: the handshake's host facts, pinned and non-blocking).

Under ``torch.cuda.set_sync_debug_mode("error")`` these two reads are the whitelisted ones:
:func:`read` lifts the mode for its own copy and restores it, so any other synchronisation on
the call's path raises (``benchmarks/device_check.py`` runs a call that way).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from mc2.engine.transport.watchdog import surfaced


@contextlib.contextmanager
def allowed_sync(device: torch.device) -> Iterator[None]:
    """A deliberate host synchronisation: lifts CUDA's sync debug mode for its duration."""
    mode = torch.cuda.get_sync_debug_mode() if device.type == "cuda" else 0
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        if mode:
            torch.cuda.set_sync_debug_mode(mode)


def read(values: Tensor) -> list[Any]:
    """One device-to-host read of a 1-D tensor, as a Python list (one of the call's two).

    Behind a stalled collective on a stream backend this is where the host would block; the
    watchdog then aborts the group and the read raises the :class:`~mc2.CommTimeout` it
    recorded (:func:`mc2.engine.transport.watchdog.surfaced`).
    """
    with allowed_sync(values.device), surfaced():
        return values.tolist()


def upload(values: list[Any], device: torch.device, dtype: torch.dtype = torch.int64) -> Tensor:
    """Host numbers onto ``device`` without stalling the host: through pinned memory and a
    non-blocking copy on accelerators (a pageable copy would wait), a plain tensor on CPU."""
    host = torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if torch.accelerator.is_available():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def read_host_memory(values: Tensor) -> list[Any]:
    """``values.tolist()`` of a CPU tensor, outside any ``TorchFunctionMode``: reading host
    memory synchronises nothing, so the host-sync counter (which counts what code would do on
    an accelerator) must not count a read that only a CPU path makes."""
    if values.device.type != "cpu":
        raise ValueError(f"read_host_memory reads CPU tensors only, got one on {values.device}")
    with torch._C.DisableTorchFunction():
        return values.tolist()


def host_vector(values: list[int]) -> Tensor:
    """Host integers as a CPU tensor that stays in host memory (a collective over a host
    backend carries it): no upload on any machine, so made outside any ``TorchFunctionMode``
    for the host-sync counter's sake, as :func:`read_host_memory` reads."""
    with torch._C.DisableTorchFunction():
        return torch.tensor(values, dtype=torch.int64)
