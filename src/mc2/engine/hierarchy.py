"""Two-stage (hierarchical, "2d") All-to-All: few, large messages across the slow link.

With ``N`` nodes of ``G`` ranks, rank ``(n, l)`` (node ``n``, local rank ``l``):

1. *inter-node stage*, among the ranks with local rank ``l``: send to ``(n', l)`` one message
   holding every row bound for any rank of node ``n'`` (``N - 1`` messages cross the slow link
   instead of ``N*G - G``);
2. *intra-node stage*, among the ranks of the node: forward each received row to its
   destination's local rank over the fast link.

The combine runs the two stages backwards. Rows arrive ordered by (forwarding local rank,
source node, expert); :func:`mc2.engine.routing.expert_grouping_index` takes that arrival order, so the
experts see exactly the rows, in exactly the order, of the flat exchange: the results are
bitwise the flat ones.

Both stages depend on each other, so an asynchronous two-stage exchange runs on a
:class:`CommWorker`: one thread per process that executes exchanges one after another, in the
order they were submitted. Every rank submits the same exchanges in the same order, so every
group sees its collectives in the same order on all its members.
"""

from __future__ import annotations

import contextvars
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import (
    FlatExchange,
    PendingTransfer,
    all_reduce_max,
    all_to_all_rows,
    barrier,
    comm_device,
)


class CommWorker:
    """A thread that runs submitted communication functions in FIFO order."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="mc2-comm", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the waiter, who re-raises it
                future.set_exception(exc)

    def submit(self, fn: Callable[[], Tensor]) -> Future:
        future: Future = Future()
        self._jobs.put((fn, future))
        return future


_WORKER: list[CommWorker] = []
_WORKER_LOCK = threading.Lock()


def comm_worker() -> CommWorker:
    """The process's communication thread, started on first use."""
    with _WORKER_LOCK:
        if not _WORKER:
            _WORKER.append(CommWorker())
        return _WORKER[0]


@dataclass(frozen=True)
class TwoStageExchange:
    """The two stages of one micro-batch's exchange, as seen by this rank."""

    inter_send: list[int]  # rows to each node (same local rank), stage 1
    inter_recv: list[int]  # rows from each node, stage 1
    intra_gather: Tensor  # stage-1 rows -> stage-2 send order (grouped by local destination)
    intra_send: list[int]  # rows to each local rank, stage 2
    intra_recv: list[int]  # rows from each local rank, stage 2
    intra_group: Any
    inter_group: Any

    def _run(self, fn: Callable[[], Tensor], async_op: bool,
             on_complete: Callable[[float, float], None] | None) -> PendingTransfer:
        issued = time.perf_counter()
        if not async_op:
            return PendingTransfer(output=fn(), issued_at=issued)
        context = contextvars.copy_context()  # the call's deadline holds on the thread too

        def job() -> Tensor:
            out = context.run(fn)
            if on_complete is not None:
                on_complete(issued, time.perf_counter())
            return out

        return PendingTransfer(output=None, future=comm_worker().submit(job), issued_at=issued)

    def dispatch(self, rows: Tensor, *, async_op: bool,
                 on_complete: Callable[[float, float], None] | None = None) -> PendingTransfer:
        def run() -> Tensor:
            across = all_to_all_rows(rows, self.inter_send, self.inter_recv, self.inter_group,
                                     async_op=False).wait()
            gather = self.intra_gather.to(across.device)
            return all_to_all_rows(across.index_select(0, gather), self.intra_send,
                                   self.intra_recv, self.intra_group, async_op=False).wait()
        return self._run(run, async_op, on_complete)

    def combine(self, rows: Tensor, *, async_op: bool,
                on_complete: Callable[[float, float], None] | None = None) -> PendingTransfer:
        def run() -> Tensor:
            inside = all_to_all_rows(rows, self.intra_recv, self.intra_send, self.intra_group,
                                     async_op=False).wait()
            staged = torch.empty_like(inside)
            staged.index_copy_(0, self.intra_gather.to(inside.device), inside)
            return all_to_all_rows(staged, self.inter_recv, self.inter_send, self.inter_group,
                                   async_op=False).wait()
        return self._run(run, async_op, on_complete)


def two_stage_plan(totals: Tensor, micro_batch: int, *, rank: int, nodes: int, per_node: int,
                   intra_group: Any, inter_group: Any) -> tuple[TwoStageExchange, list[int]]:
    """This rank's exchange for one micro-batch, and the arrival order of source ranks.

    Args:
        totals: ``[world(src), K, world(dst)]`` rows each rank sends each rank, per micro-batch
            (every rank's send counts, gathered).
    """
    t = totals[:, micro_batch, :].tolist()
    g = per_node
    node, local = divmod(rank, g)

    def rows(src_node: int, src_local: int, dst_local: int, dst_node: int = node) -> int:
        return t[src_node * g + src_local][dst_node * g + dst_local]

    inter_send = [sum(rows(node, local, d, n) for d in range(g)) for n in range(nodes)]
    inter_recv = [sum(rows(n, local, d) for d in range(g)) for n in range(nodes)]
    # stage-1 receive buffer: per source node n, the rows of (n, local) for (node, d), d = 0..g-1
    block_start, offset = {}, 0
    for n in range(nodes):
        for d in range(g):
            block_start[n, d] = offset
            offset += rows(n, local, d)
    pieces = [torch.arange(block_start[n, d], block_start[n, d] + rows(n, local, d))
              for d in range(g) for n in range(nodes) if rows(n, local, d)]
    gather = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)
    intra_send = [sum(rows(n, local, d) for n in range(nodes)) for d in range(g)]
    intra_recv = [sum(rows(n, src, local) for n in range(nodes)) for src in range(g)]
    arrival = [n * g + src for src in range(g) for n in range(nodes)]
    exchange = TwoStageExchange(inter_send, inter_recv, gather, intra_send, intra_recv,
                                intra_group, inter_group)
    return exchange, arrival


_CHOICES: dict[tuple, bool] = {}


def two_stage_pays(group: Any, *, rank: int, nodes: int, per_node: int, intra_group: Any,
                   inter_group: Any, rows_per_rank: int, row_bytes: int,
                   device: torch.device, repeats: int = 3) -> bool:
    """Whether the 2-D exchange beats the flat one for this size here (measured once).

    A collective: every rank of ``group`` calls it together. Both exchanges move the same
    uniform traffic, rows of ``row_bytes`` bytes (what a row takes on the wire, in the call's
    wire format), synchronously, ``repeats`` times; the group's slowest times decide, so all
    ranks decide alike. Cached per (group, size rounded to a power of two, row bytes).
    """
    world = nodes * per_node
    per = max(1, 1 << max(0, (max(rows_per_rank, 1) // world).bit_length() - 1))
    key = (tuple(dist.get_process_group_ranks(group or dist.group.WORLD)), per, row_bytes)
    if key not in _CHOICES:
        totals = torch.full((world, 1, world), per, dtype=torch.int64)
        two_d, _ = two_stage_plan(totals, 0, rank=rank, nodes=nodes, per_node=per_node,
                                  intra_group=intra_group, inter_group=inter_group)
        flat = FlatExchange([per] * world, [per] * world, group)
        rows = torch.zeros(per * world, row_bytes, dtype=torch.uint8, device=device)

        def timed(exchange: Any) -> float:
            exchange.dispatch(rows, async_op=False).wait()  # warm-up
            times = []
            for _ in range(repeats):
                barrier(group, "hierarchy measurement")
                start = time.perf_counter()
                exchange.dispatch(rows, async_op=False).wait()
                times.append(time.perf_counter() - start)
            return sorted(times)[len(times) // 2]

        measured = torch.tensor([timed(flat), timed(two_d)], dtype=torch.float64)
        slowest = all_reduce_max(measured.to(comm_device(group, rows)), group).cpu().tolist()
        _CHOICES[key] = slowest[1] < 0.95 * slowest[0]
    return _CHOICES[key]
