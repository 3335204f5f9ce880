"""Which communication backend serves a call, and how its collectives must be waited for.

A process group can hold several backends, one per device type:
``init_process_group("cpu:gloo,cuda:nccl")``, or a backend-less ``init_process_group()``, which
PyTorch makes ``gloo`` for CPU tensors and ``nccl`` for CUDA tensors. ``dist.get_backend(group)``
then answers ``"cpu:gloo,cuda:nccl"`` or ``"undefined"``, not a backend name, so mc2 asks the
group which backend serves the device the call's tensors live on (:func:`backend_for`).

That backend decides two things (:class:`CommStyle`):

* whether asynchronous collectives are available at all (else the pipeline runs synchronously,
  says so once and marks the timeline: the article's "RDMA off" case);
* how a wait is done. On a *host* backend (Gloo, MPI, UCC on CPU tensors) the collective runs on
  the backend's threads and ``work.wait(timeout)`` blocks the caller until it is done, which is
  what the call's deadline needs. On a *stream* backend (NCCL, HCCL, XCCL, ...) the collective
  runs on a device stream: ``work.wait()`` only makes the current stream wait and returns at
  once, so the host runs ahead and queues the next micro-batch. A wait with a timeout there
  busy-polls the host until the transfer is over, which would serialise the pipeline, so
  deadlines on stream backends belong to a watchdog (:mod:`mc2.engine.transport.watchdog`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mc2.engine.transport.env import flag, force_sync

# backends whose collectives accept async_op=True and progress on their own threads/streams
# backends whose collectives take CPU tensors: host integers meet there without a device read
HOST_BACKENDS = {"gloo", "mpi"}
ASYNC_BACKENDS = {"gloo", "nccl", "hccl", "mpi", "ucc", "xccl", "fake"}
# backends whose work completes on a device stream: wait() is stream-ordered and non-blocking
STREAM_BACKENDS = {"nccl", "hccl", "xccl"}


def register_stream_backend(name: str) -> None:
    """Declare a third-party backend (registered with ``torch.distributed.Backend.
    register_backend``) whose work completes on a device stream, so mc2 waits on it
    stream-ordered and watches its deadlines from a watchdog instead of blocking the host."""
    STREAM_BACKENDS.add(name.lower())
    ASYNC_BACKENDS.add(name.lower())


def backend_for(group: Any, device: torch.device | str | None) -> str:
    """The name of the backend of ``group`` that serves tensors on ``device`` (lower case).

    Works for single backends (``"gloo"``), mixed ones (``"cpu:gloo,cuda:nccl"``) and the
    default backend-less group. Falls back to parsing the backend string where the group
    object cannot be asked.
    """
    kind = torch.device(device if device is not None else "cpu").type
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        return pg._get_backend(torch.device(kind)).name().lower()
    except (AttributeError, RuntimeError, TypeError):
        pass
    text = str(dist.get_backend(group)).lower()
    if ":" not in text:
        return text
    mapping = dict(part.split(":", 1) for part in text.split(",") if ":" in part)
    return mapping.get(kind, text)


@dataclass(frozen=True)
class CommStyle:
    """How the collectives of one call run.

    Attributes:
        backend: the backend serving the call's device (``"gloo"``, ``"nccl"``, ...).
        sync_reason: why asynchronous collectives cannot be used, or ``None``.
        stream: waits are stream-ordered (non-blocking); deadlines go to a watchdog.
    """

    backend: str
    sync_reason: str | None
    stream: bool

    @property
    def asynchronous(self) -> bool:
        return self.sync_reason is None

    @property
    def on_streams(self) -> bool:
        """The backend runs its collectives on device streams in the order they were issued,
        even where its wait blocks the host (NCCL under ``TORCH_NCCL_BLOCKING_WAIT``): what
        follows a collective is ordered by streams in the issuing thread. Never issued from
        a second thread: NCCL collectives that two threads issue, on several communicators,
        reach the device in a different order on different ranks and can deadlock."""
        return self.backend in STREAM_BACKENDS


LOCAL = CommStyle("local", None, False)


def comm_style(group: Any, device: torch.device | str | None) -> CommStyle:
    """The :class:`CommStyle` of ``group`` for tensors on ``device`` (local without a group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return LOCAL
    name = backend_for(group, device)
    reason = None
    if force_sync():
        reason = "MC2_FORCE_SYNC is set"
    elif name not in ASYNC_BACKENDS:
        reason = f"backend {name!r} is not known to support asynchronous collectives"
    return CommStyle(name, reason, name in STREAM_BACKENDS and not _blocking_wait(name))


def _blocking_wait(name: str) -> bool:
    """``TORCH_NCCL_BLOCKING_WAIT=1`` makes NCCL's ``wait()`` block the host: then waits are
    host waits, with the call's deadline, as on Gloo."""
    return name == "nccl" and (flag("TORCH_NCCL_BLOCKING_WAIT") or flag("NCCL_BLOCKING_WAIT"))


def default_device_type() -> str:
    """The device type the current process computes on: the current accelerator, else CPU."""
    current = torch.accelerator.current_accelerator(check_available=True)
    return "cpu" if current is None else current.type


def mesh_device_type() -> str:
    """The device type for a :class:`DeviceMesh` over the default group: the accelerator when
    the group has a backend for it, else CPU (a Gloo-only group on a GPU machine stays CPU)."""
    kind = default_device_type()
    if kind == "cpu" or not (dist.is_available() and dist.is_initialized()):
        return kind
    pg = dist.distributed_c10d._get_default_group()
    try:
        pg._get_backend(torch.device(kind))
    except RuntimeError:
        return "cpu"
    return kind
