"""Moving bytes between the ranks of an expert-parallel group; owns no schedule.

Every function takes the group explicitly and never falls back to another communicator. A group
of one rank (or no initialised ``torch.distributed``) is served locally without collectives, so
the same code runs in a single process.

Device notes: with NCCL/HCCL, ``async_op=True`` enqueues the All-to-All on the backend's own
communication stream after the current stream's pending work, and ``Work.wait()`` makes the
current stream wait for it; the backend keeps the tensors alive while in flight and
:class:`PendingTransfer` holds references until ``wait()`` returns, so no memory is reused
under a running transfer. With Gloo the transfer runs on Gloo's worker threads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from .deadline import current, wait_future, wait_work
from .env import sync_reason
from .workspace import Workspace


def initialized() -> bool:
    """Whether ``torch.distributed`` is available and a process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def group_size(group: Any) -> int:
    """Ranks in ``group`` (1 when ``torch.distributed`` is not initialised)."""
    if not initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Any) -> int:
    """This process's rank in ``group`` (0 when ``torch.distributed`` is not initialised)."""
    if not initialized():
        return 0
    return dist.get_rank(group)


def comm_device(group: Any, like: Tensor) -> torch.device:
    """Device for small control tensors: CPU for Gloo, the data's device otherwise."""
    if group_size(group) > 1 and dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return like.device


@dataclass
class PendingTransfer:
    """An All-to-All in flight: ``wait()`` returns the received rows.

    Attributes:
        output: ``[sum(recv_splits), hidden]`` the receive buffer (valid after ``wait``).
        work: the backend's work handle, ``None`` when the transfer already completed.
        issued_at: ``time.perf_counter()`` when the transfer was issued.
        keep_alive: tensors that must not be freed while the transfer runs (the send buffer).
        future: a ``concurrent.futures.Future`` whose result is the output (an exchange run on
            the communication thread), instead of ``work``.
    """

    output: Tensor | None
    work: Any = None
    issued_at: float = 0.0
    keep_alive: tuple[Tensor, ...] = field(default_factory=tuple)
    future: Any = None
    operation: str = "exchange"

    def wait(self) -> Tensor:
        """The received rows; :class:`~mc2.engine.deadline.CommTimeout` past the call's deadline."""
        if self.work is not None:
            wait_work(self.work, self.operation)
            self.work = None
        if self.future is not None:
            self.output = wait_future(self.future, self.operation)
            self.future = None
        self.keep_alive = ()
        assert self.output is not None
        return self.output


def all_to_all_rows(
    rows: Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group: Any,
    *,
    async_op: bool,
    on_complete: Callable[[float, float], None] | None = None,
    workspace: Workspace | None = None,
    operation: str = "exchange",
) -> PendingTransfer:
    """Variable-size All-to-All of rows (dropless): ``rows[sum(send_splits), H]`` out.

    Rows ``[sum(send_splits[:j]), sum(send_splits[:j+1]))`` go to rank ``j``; the result holds
    the rows from rank 0, then rank 1, ..., as ``[sum(recv_splits), H]``. ``on_complete(issued,
    done)`` is called with ``perf_counter`` times when an asynchronous transfer completes (from
    the backend's thread); used for profiling only.
    """
    issued = time.perf_counter()
    if group_size(group) == 1:
        return PendingTransfer(output=rows, issued_at=issued)
    rows = rows.contiguous()
    shape = (int(sum(recv_splits)),) + tuple(rows.shape[1:])
    output = (workspace or Workspace.transient()).empty(shape, rows.dtype, rows.device)
    if not async_op:
        collective(lambda a: dist.all_to_all_single(output, rows, recv_splits, send_splits,
                                                     group=group, async_op=a),
                   group, operation)
        return PendingTransfer(output=output, issued_at=issued, operation=operation)
    work = dist.all_to_all_single(
        output, rows, recv_splits, send_splits, group=group, async_op=True
    )
    if on_complete is not None:
        work.get_future().then(lambda _: on_complete(issued, time.perf_counter()))
    return PendingTransfer(output=output, work=work, issued_at=issued, keep_alive=(rows,),
                           operation=operation)


@dataclass(frozen=True)
class FlatExchange:
    """One micro-batch's exchange as a single All-to-All over the whole group."""

    send_splits: list[int]
    recv_splits: list[int]
    group: Any
    workspace: Workspace | None = None  # where receive buffers come from

    def dispatch(self, rows: Tensor, *, async_op: bool,
                 on_complete: Callable[[float, float], None] | None = None) -> PendingTransfer:
        return all_to_all_rows(rows, self.send_splits, self.recv_splits, self.group,
                               async_op=async_op, on_complete=on_complete,
                               workspace=self.workspace)

    def combine(self, rows: Tensor, *, async_op: bool,
                on_complete: Callable[[float, float], None] | None = None) -> PendingTransfer:
        return all_to_all_rows(rows, self.recv_splits, self.send_splits, self.group,
                               async_op=async_op, on_complete=on_complete,
                               workspace=self.workspace)


def exchange_counts(send_counts: Tensor, group: Any) -> Tensor:
    """The one up-front exchange of per-micro-batch, per-expert row counts.

    Args:
        send_counts: ``[world, K, local_experts] int64``: rows this rank sends to each rank's
            local experts in each micro-batch (destination-major).

    Returns:
        ``[world, K, local_experts] int64``: rows each source rank sends to *this* rank's
        experts (source-major).
    """
    if group_size(group) == 1:
        return send_counts.clone()
    send = send_counts.contiguous()
    recv = torch.empty_like(send)
    collective(lambda a: dist.all_to_all_single(recv, send, group=group, async_op=a), group,
               "counts exchange")
    return recv


def gather_counts(send_totals: Tensor, group: Any) -> Tensor:
    """Every rank's per-micro-batch row counts to every rank: ``[world(src), K, world(dst)]``.

    Args:
        send_totals: ``[K, world] int64`` rows this rank sends to each rank per micro-batch.
    """
    if group_size(group) == 1:
        return send_totals.unsqueeze(0).clone()
    parts = [torch.empty_like(send_totals) for _ in range(group_size(group))]
    send = send_totals.contiguous()
    collective(lambda a: dist.all_gather(parts, send, group=group, async_op=a), group,
               "counts gather")
    return torch.stack(parts)


def all_reduce_max(values: Tensor, group: Any, operation: str = "agreement") -> Tensor:
    """Element-wise maximum over the group (identity for one rank)."""
    if group_size(group) == 1:
        return values
    values = values.clone()
    collective(lambda a: dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group,
                                         async_op=a), group, operation)
    return values


def barrier(group: Any, operation: str = "barrier") -> None:
    """``dist.barrier`` under the call's deadline."""
    if group_size(group) > 1:
        collective(lambda a: dist.barrier(group=group, async_op=a), group, operation)


def collective(issue: Callable[[bool], Any], group: Any, operation: str) -> None:
    """Run a collective to completion under the call's deadline (:mod:`mc2.engine.deadline`).

    ``issue(async_op)`` starts it. With a deadline and an asynchronous backend it is issued
    asynchronously and waited for with the deadline; otherwise (no deadline, or
    ``MC2_FORCE_SYNC`` / a backend without asynchronous collectives) it runs synchronously and
    only the process group's own timeout applies.
    """
    if current() is None or sync_reason(dist.get_backend(group)) is not None:
        issue(False)
        return
    wait_work(issue(True), operation)


def gather_objects(obj: Any, group: Any) -> list[Any]:
    """Every rank's ``obj`` (used only on the error path, where cost does not matter)."""
    if group_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
