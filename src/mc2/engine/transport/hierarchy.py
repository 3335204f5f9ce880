"""Two-stage (hierarchical, "2d") All-to-All: few, large messages across the slow link.

With ``N`` nodes of ``G`` ranks, rank ``(n, l)`` (node ``n``, local rank ``l``):

1. *inter-node stage*, among the ranks with local rank ``l``: send to ``(n', l)`` one message
   holding every row bound for any rank of node ``n'`` (``N - 1`` messages cross the slow link
   instead of ``N*G - G``);
2. *intra-node stage*, among the ranks of the node: forward each received row to its
   destination's local rank over the fast link.

The combine runs the two stages backwards. Rows arrive ordered by (forwarding local rank,
source node, expert); :func:`mc2.engine.decide.routing.expert_grouping_indices` takes that arrival
order, so the experts see exactly the rows, in exactly the order, of the flat exchange: the
results are bitwise the flat ones.

The second stage needs the first's rows, permuted. How an asynchronous exchange chains them
depends on the backend (:mod:`mc2.engine.transport.backend`):

* **stream backends** (NCCL, HCCL): everything is issued at once from the caller's thread, in
  stream order. A side stream waits for stage 1, permutes, and issues stage 2; the caller's
  ``wait`` makes its own stream wait for stage 2. The host never blocks and the compute stream
  never waits for stage 1. Collectives of both sub-groups are issued from the one thread, in
  the same order on every rank.
* **host backends** (Gloo): a wait blocks its thread, so the chain runs on a
  :class:`CommWorker`, one thread per process that executes exchanges one after another in the
  order they were submitted (every rank submits the same exchanges in the same order, so every
  sub-group sees its collectives in one order on all its members).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import queue
import statistics
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from mc2.device.clock import clock_for
from mc2.engine.transport.comm import (
    FlatExchange, OnComplete, PendingTransfer, abandon, all_reduce_max, all_to_all_rows, barrier, style_of
)
from mc2.engine.transport.group_state import group_state
from mc2.engine.transport.host import read, upload
from mc2.engine.transport.row_sums import sum_rows
from mc2.engine.transport.wire import NONE
from mc2.device.streams import current_stream, side_stream, wait_for_current


def regroup_index(lengths: Tensor, perm: Sequence[int], total: int) -> Tensor:
    """Gather index that reorders blocks of rows, for every micro-batch at once, on the device.

    Args:
        lengths: ``[K, *grid]`` rows per block, the blocks of each micro-batch laid out in
            arrival order (row-major over ``grid``).
        perm: the target order of the grid's axes (as ``lengths.permute(0, *perm)``, axes
            numbered from 1).
        total: ``lengths.sum()``, known on the host (so nothing is read back).

    Returns:
        ``[total] int64``: micro-batch after micro-batch, for each position of the target order
        the position (within its micro-batch) of the row it takes in arrival order.
    """
    k = lengths.shape[0]
    flat = lengths.reshape(k, -1)
    starts = (torch.cumsum(flat, 1) - flat).view(lengths.shape)  # arrival position of blocks
    target_lengths = lengths.permute(0, *perm).reshape(k, -1)
    target_starts = starts.permute(0, *perm).reshape(k, -1)
    dest = torch.cumsum(target_lengths, 1) - target_lengths
    per_micro = target_lengths.sum(1, keepdim=True)
    base = torch.cumsum(per_micro, 0) - per_micro  # where each micro-batch starts
    delta = (target_starts - dest - base).reshape(-1)
    offset = torch.repeat_interleave(delta, target_lengths.reshape(-1), output_size=total)
    return offset + torch.arange(total, dtype=torch.int64, device=lengths.device)


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


@functools.cache
def comm_worker() -> CommWorker:
    """The process's communication thread, started on first use (host backends only)."""
    return CommWorker()


def _drain_comm_worker() -> None:
    """Wait until the communication thread has run every exchange submitted so far. A
    measurement issues collectives on the intra- and inter-node groups from the caller's
    thread; a 2-D exchange of another call may still be running on that thread (a backward's
    combine beside a paired forward, one half's dispatch under batch overlap), and two
    threads issuing on one group issue in different orders on different ranks (Gloo pairs
    collectives by the order they were issued in). Its peers drain the same exchanges, issued
    in the same order; each runs under its call's deadline."""
    if comm_worker.cache_info().currsize:
        comm_worker().submit(lambda: None).result()


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
    # rows once per node (mc2.engine.decide.dedup): intra_gather repeats a row for each rank
    # of the node it goes to, and the combine sums the rows that come back for it (decoding
    # and encoding again where the rows travel quantised: (format, hidden, dtype))
    reduces: bool = False
    codec: Any = None

    def _chained(self, rows: Tensor, first: tuple[list[int], list[int], Any],
                 second: tuple[list[int], list[int], Any], between: Callable[[Tensor, Tensor], Any],
                 name: str, on_complete: OnComplete | None) -> PendingTransfer:
        """Stream backends: stage 1, ``between(stage-1 rows, out)``, stage 2, all queued now.

        Every buffer is allocated on the caller's stream before the side stream touches it and
        is held until the caller's wait: the caller's stream is then ordered after stage 2,
        which starts after the side stream's permutation, so none is reused in flight.
        """
        (send1, recv1, group1), (send2, recv2, group2) = first, second
        hidden = tuple(rows.shape[1:])
        middle = torch.empty((sum(recv1),) + hidden, dtype=rows.dtype, device=rows.device)
        staged = torch.empty((sum(send2),) + hidden, dtype=rows.dtype, device=rows.device)
        output = torch.empty((sum(recv2),) + hidden, dtype=rows.dtype, device=rows.device)
        side = side_stream(rows.device, f"two-stage {name}")
        wait_for_current(side, rows.device)
        try:
            with side:
                arrived = all_to_all_rows(rows, send1, recv1, group1, async_op=True,
                                          output=middle, operation=f"{name} (first stage)").wait()
                between(arrived, staged)
                last = all_to_all_rows(staged, send2, recv2, group2, async_op=True,
                                       output=output, on_complete=on_complete,
                                       operation=f"{name} (second stage)")
        except BaseException:
            # the caller's stream must not reuse these buffers before the side stream is done
            current = current_stream(rows.device)
            if current is not None:
                current.wait_stream(side)
            abandon(rows, middle, staged, output)
            raise
        # the side stream's permutation reads the stage-2 gather (a plan's tensor, made on the
        # caller's stream): a pass that abandons the transfer (a given-up paired forward) drops
        # the plan without a wait, and the buffer must not be handed out again meanwhile
        last.keep_alive = (rows, middle, staged, self.intra_gather)
        return last

    def _exchange(self, rows: Tensor, first: tuple[list[int], list[int], Any],
                  second: tuple[list[int], list[int], Any],
                  between: Callable[[Tensor, Tensor], Tensor], name: str, async_op: bool,
                  on_complete: OnComplete | None) -> PendingTransfer:
        """Stage 1, ``between(stage-1 rows, out)`` into a buffer of stage 2's rows, stage 2
        (``first``, ``second``: each stage's send splits, receive splits and group): queued at
        once on a stream backend (:meth:`_chained`), else run now or, asynchronous, on the
        communication thread."""
        if async_op and style_of(self.inter_group, rows.device).on_streams:
            return self._chained(rows, first, second, between, name, on_complete)

        def run() -> Tensor:
            arrived = all_to_all_rows(rows, *first, async_op=False).wait()
            out = arrived.new_empty((sum(second[0]),) + tuple(arrived.shape[1:]))
            return all_to_all_rows(between(arrived, out), *second, async_op=False).wait()
        if not async_op:
            return PendingTransfer(output=run())
        issued = time.perf_counter()
        context = contextvars.copy_context()  # the call's deadline holds on the thread too
        # device tensors (Gloo stages them through the host): the thread orders its copies and
        # permutation on the caller's stream, as the caller's own collectives would be
        stream = current_stream(rows.device)

        def job() -> Tensor:
            with stream if stream is not None else contextlib.nullcontext():
                out = context.run(run)
            if on_complete is not None:
                on_complete(issued, time.perf_counter())
            return out
        return PendingTransfer(output=None, future=comm_worker().submit(job),
                               operation="two-stage exchange")

    def _permute(self, across: Tensor, out: Tensor) -> Tensor:
        """The dispatch's step between the stages: stage-1 rows in stage-2 send order."""
        return torch.index_select(across, 0, self.intra_gather, out=out)

    def _unpermute(self, inside: Tensor, out: Tensor) -> Tensor:
        """The combine's step between the stages: :meth:`_permute` undone (rows once per
        node: the rows back for each stage-1 row summed, :meth:`_summed`)."""
        return self._summed(inside, out) if self.reduces else \
            out.index_copy_(0, self.intra_gather, inside)

    def dispatch(self, rows: Tensor, *, async_op: bool,
                 on_complete: OnComplete | None = None) -> PendingTransfer:
        return self._exchange(rows, (self.inter_send, self.inter_recv, self.inter_group),
                              (self.intra_send, self.intra_recv, self.intra_group),
                              self._permute, "dispatch", async_op, on_complete)

    def _summed(self, inside: Tensor, out: Tensor) -> Tensor:
        """The combine's node reduction: the rows back from each rank, summed per stage-1
        row (in float32 for 16-bit rows), into ``out``."""
        fmt, hidden, dtype = self.codec if self.codec is not None else (NONE, None, None)
        total = sum_rows(fmt.decode(inside, hidden, dtype), self.intra_gather, out.shape[0])
        return out.copy_(fmt.encode(total))  # NONE's decode and encode are the rows as they are

    def combine(self, rows: Tensor, *, async_op: bool,
                on_complete: OnComplete | None = None) -> PendingTransfer:
        return self._exchange(rows, (self.intra_recv, self.intra_send, self.intra_group),
                              (self.inter_recv, self.inter_send, self.inter_group),
                              self._unpermute, "combine", async_op, on_complete)


@dataclass(frozen=True)
class TwoStagePlan:
    """The two-stage exchanges of every micro-batch of one call.

    Args:
        totals: ``[world(src)][K][world(dst)]`` rows each rank sends each rank (host, read with
            the call's counts).
        totals_device: the same on the device, where the stage-2 gathers are built.
    """

    totals: list[list[list[int]]]
    totals_device: Tensor
    rank: int
    nodes: int
    per_node: int
    intra_group: Any
    inter_group: Any
    node_totals: list[list[list[int]]] | None = None  # rows once per node: [src][K][node]

    def _splits(self, micro_batch: int) -> dict[str, list[int]]:
        """This rank's four split lists for one micro-batch (stage 1 and stage 2). Rows once
        per node: stage 1 moves :attr:`node_totals`, stage 2 the (row, rank) pairs."""
        t = [self.totals[src][micro_batch] for src in range(len(self.totals))]
        g, nodes = self.per_node, self.nodes
        node, local = divmod(self.rank, g)

        def rows(src_node: int, src_local: int, dst_local: int, dst_node: int = node) -> int:
            return t[src_node * g + src_local][dst_node * g + dst_local]

        if self.node_totals is not None:
            per_node = [self.node_totals[src][micro_batch] for src in range(len(self.totals))]
            inter = {"inter_send": per_node[self.rank],
                     "inter_recv": [per_node[n * g + local][node] for n in range(nodes)]}
        else:
            inter = {
                "inter_send": [sum(rows(node, local, d, n) for d in range(g))
                               for n in range(nodes)],
                "inter_recv": [sum(rows(n, local, d) for d in range(g)) for n in range(nodes)]}
        return {
            **inter,
            "intra_send": [sum(rows(n, local, d) for n in range(nodes)) for d in range(g)],
            "intra_recv": [sum(rows(n, src, local) for n in range(nodes)) for src in range(g)],
        }

    def gathers(self, splits: list[dict[str, list[int]]]) -> list[Tensor]:
        """Per micro-batch, stage-1 arrival order (source node, destination local rank) ->
        stage-2 send order (destination local rank, source node); built on the device."""
        g, (node, local) = self.per_node, divmod(self.rank, self.per_node)
        world, k, _ = self.totals_device.shape
        mine = self.totals_device.view(self.nodes, g, k, self.nodes, g)[:, local, :, node, :]
        lengths = mine.permute(1, 0, 2)  # [K, source node, destination local rank]
        sizes = [sum(s["intra_send"]) for s in splits]
        return list(torch.split(regroup_index(lengths, (2, 1), sum(sizes)), sizes))

    def splits(self) -> list[dict[str, list[int]]]:
        """Every micro-batch's four split lists."""
        return [self._splits(i) for i in range(len(self.totals[0]))]

    def exchanges(self, gathers: list[Tensor] | None = None, codec: Any = None
                  ) -> list[TwoStageExchange]:
        """This rank's exchange of every micro-batch. ``gathers``: rows once per node, the
        stage-2 gathers (:func:`mc2.engine.decide.dedup.node_gathers`); ``codec``: the combine's
        wire format, as the node reduction decodes it."""
        splits = self.splits()
        reduces = gathers is not None
        gathers = gathers if gathers is not None else self.gathers(splits)
        return [TwoStageExchange(intra_gather=gather, intra_group=self.intra_group,
                                 inter_group=self.inter_group, reduces=reduces,
                                 codec=codec if reduces else None, **s)
                for s, gather in zip(splits, gathers)]


def measured_sizes(group: Any) -> int:
    """How many sizes :func:`two_stage_pays` has measured on ``group`` in this process."""
    return len(group_state(group).two_stage)


def two_stage_pays(group: Any, *, rank: int, nodes: int, per_node: int, intra_group: Any,
                   inter_group: Any, rows_per_rank: int, row_bytes: int,
                   device: torch.device, repeats: int = 3) -> bool:
    """Whether the 2-D exchange beats the flat one for this size here (measured once).

    A collective: every rank of ``group`` calls it together. Both exchanges move the same
    uniform traffic, rows of ``row_bytes`` bytes (what a row takes on the wire, in the call's
    wire format), synchronously, ``repeats`` times each, *alternating* (flat, 2-D, flat, ...:
    a slow spell of the link or the host falls on both), timed with the device's clock. As for
    ``"auto"``'s K (:mod:`mc2.engine.decide.trials`), each exchange counts as the group's
    slowest rank (one all-reduce of every time) and each is scored by the median of its
    exchanges; the 2-D one must be 5% faster. All ranks decide alike. Cached per (group,
    size rounded to a power of two, row bytes) in the group's state.
    """
    world = nodes * per_node
    per = max(1, 1 << max(0, (max(rows_per_rank, 1) // world).bit_length() - 1))
    choices, key = group_state(group).two_stage, (per, row_bytes)
    if key not in choices:
        _drain_comm_worker()
        uniform = [[[per] * world] for _ in range(world)]
        plan = TwoStagePlan(uniform, torch.full((world, 1, world), per, dtype=torch.int64,
                                                device=device),
                            rank, nodes, per_node, intra_group, inter_group)
        two_d = plan.exchanges()[0]
        flat = FlatExchange([per] * world, [per] * world, group)
        rows = torch.zeros(per * world, row_bytes, dtype=torch.uint8, device=device)
        clock = clock_for(device)

        def timed(exchange: Any) -> float:  # a barrier before each, outside the interval
            barrier(group, "hierarchy measurement", device)
            return clock.time(lambda: exchange.dispatch(rows, async_op=False).wait())

        for exchange in (flat, two_d):  # warm-up
            exchange.dispatch(rows, async_op=False).wait()
        times = [timed(exchange) for _ in range(repeats) for exchange in (flat, two_d)]
        slowest = read(all_reduce_max(upload(times, device, torch.float64), group))
        flat_s, two_d_s = (statistics.median(slowest[i::2]) for i in (0, 1))
        choices[key] = two_d_s < 0.95 * flat_s
    return choices[key]
