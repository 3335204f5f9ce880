"""Moving bytes between the ranks of an expert-parallel group; owns no schedule.

Every function takes the group explicitly and never falls back to another communicator. A group
of one rank (or no initialised ``torch.distributed``) is served locally without collectives, so
the same code runs in a single process. Small control tensors (the handshake, the counts) live
on the device of the call's data: the backend serving that device moves them (Gloo stages CUDA
tensors through the host; NCCL moves them on the device).

How a transfer is waited for depends on the backend serving the device
(:mod:`mc2.engine.transport.backend`): on a host backend (Gloo) ``wait`` blocks the caller, with the call's
deadline; on a stream backend (NCCL, HCCL) it makes the current stream wait and returns at once,
and the deadline is kept by :mod:`mc2.engine.transport.watchdog`. Either way :class:`PendingTransfer` holds
the send and receive buffers until its ``wait`` has been issued, and the backend keeps them
alive on its stream until the transfer is done, so no memory is reused under a running transfer.

Each wait's deadline is the call's, cut to the group's own timeout
(:func:`~mc2.engine.transport.deadline.wait_deadline`). After a group timed out, every later
operation on it raises a :class:`~mc2.engine.transport.deadline.CommTimeout` naming the first
before it issues anything (:func:`refuse`). While the current stream is capturing a CUDA graph
(:func:`mc2.device.streams.capturing`) nothing is watched and nothing observed: no deadline
(no start event, no host clock, no watchdog), no observer stream, so the capture holds only the
collectives and the stream waits on them.

Control messages (the handshake, the counts exchange and gather) run on a communicator of their
own over the same ranks, :func:`control_group`, never on the one that moves the rows. On a
stream backend a communicator runs its collectives in order on one stream: under batch overlap
the next micro-batch's handshake would otherwise queue behind the other micro-batch's dispatch,
and the host read after it would wait for that transfer too.
"""

from __future__ import annotations

import time
import weakref
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from mc2.engine.transport.backend import HOST_BACKENDS, LOCAL, CommStyle, backend_for, comm_style
from mc2.device.clock import clock_for
from mc2.device import streams
from mc2.engine.transport.deadline import (
    CommTimeout, current, failure, group_timeout, record_failure, wait_deadline,
    wait_future, wait_work
)
from mc2.engine.transport.env import force_collectives
from mc2.device.streams import side_stream
from mc2.engine.transport.group_state import group_state
from mc2.engine.transport.host import read
from mc2.engine.transport.watchdog import expired, start_stamp, stream_wait, surfaced, watchdog
from mc2.engine.transport.workspace import Workspace

# (issued, done) stamps of an asynchronous transfer: host seconds or device events
OnComplete = Callable[[Any, Any], None]
def abandon(*in_flight: Any) -> None:
    """Keep ``in_flight`` transfers or buffers alive as long as their group (each's, else the
    default group's): held so that no buffer a backend may still write into is handed out
    again (after a timeout the process must end)."""
    for transfer in in_flight:
        group_state(getattr(transfer, "group", None)).abandoned.append(transfer)


def initialized() -> bool:
    """Whether ``torch.distributed`` is available and a process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def group_size(group: Any) -> int:
    """Ranks in ``group`` (1 when ``torch.distributed`` is not initialised)."""
    return dist.get_world_size(group) if initialized() else 1


def group_rank(group: Any) -> int:
    """This process's rank in ``group`` (0 when ``torch.distributed`` is not initialised)."""
    return dist.get_rank(group) if initialized() else 0


def is_local(group: Any) -> bool:
    """Whether ``group`` is served without collectives: one rank, unless
    ``MC2_DEBUG_FORCE_COLLECTIVES`` asks for the distributed path anyway (a device check on a
    world of one)."""
    return group_size(group) == 1 and not (initialized() and force_collectives())


def carries_host_memory(group: Any) -> bool:
    """Whether ``group``'s collectives can take CPU tensors (a Gloo group, or a mixed
    ``"cpu:gloo,cuda:nccl"`` one): there, host integers meet with no device read."""
    if is_local(group):
        return False
    try:
        return backend_for(group, "cpu") in HOST_BACKENDS
    except (RuntimeError, ValueError):
        return False


def style_of(group: Any, device: torch.device) -> CommStyle:
    """How ``group``'s collectives on ``device`` run (:func:`mc2.engine.transport.backend.comm_style`)."""
    return LOCAL if is_local(group) else comm_style(group, device)


@dataclass
class PendingTransfer:
    """An All-to-All in flight: ``wait()`` returns the received rows.

    Attributes:
        output: ``[sum(recv_splits), hidden]`` the receive buffer (valid after ``wait``).
        work: the backend's work handle, ``None`` when the transfer already completed.
        keep_alive: tensors that must not be freed while the transfer runs (the send buffer).
        future: a ``concurrent.futures.Future`` whose result is the output (an exchange run on
            the communication thread), instead of ``work``.
        operation: what moves, for error messages.
        stream: the work completes on a device stream (its wait is stream-ordered).
        start: where a stream backend's deadline counts from
            (:func:`~mc2.engine.transport.watchdog.start_stamp`, taken before the issue: a
            device event on an accelerator, ``time.monotonic()`` seconds on CPU).
        group: the group the transfer runs on.
        deadline_s: its wait's deadline (``None``: none of mc2's own).
    """

    output: Tensor | None
    work: Any = None
    keep_alive: tuple[Tensor, ...] = field(default_factory=tuple)
    future: Any = None
    operation: str = "exchange"
    stream: bool = False
    start: Any = 0.0
    group: Any = None
    deadline_s: float | None = None

    def wait(self, *, micro_batch: int | None = None, phase: str | None = None) -> Tensor:
        """The received rows; :class:`~mc2.engine.transport.deadline.CommTimeout` past the call's deadline.

        On a stream backend the rows are ready for work queued on the current stream after this
        returns; the host does not wait for them.
        """
        if self.work is not None:
            _wait(self.work, self.operation, stream=self.stream, start=self.start,
                  group=self.group, deadline_s=self.deadline_s, micro_batch=micro_batch,
                  phase=phase)
            self.work = None
        if self.future is not None:
            self.output = wait_future(self.future, self.operation)
            self.future = None
        self.keep_alive = ()
        assert self.output is not None
        return self.output


def _wait(work: Any, operation: str, *, stream: bool, start: Any, group: Any,
          deadline_s: float | None, micro_batch: int | None = None,
          phase: str | None = None) -> None:
    """The one wait of an asynchronous collective: stream-ordered and watched on a stream
    backend (the deadline counting from ``start``), blocking with ``deadline_s`` on a host
    backend, where a timeout leaves ``group`` refused from then on (:func:`refuse`)."""
    if stream:
        stream_wait(work, operation, deadline_s=deadline_s, start=start,
                    micro_batch=micro_batch, phase=phase, group=group)
        return
    try:
        wait_work(work, operation, deadline_s)
    except CommTimeout as exc:
        record_failure(group, exc)
        raise


def refuse(group: Any, operation: str) -> None:
    """Raise a :class:`~mc2.engine.transport.deadline.CommTimeout` naming the first timeout
    when ``group`` (or, after the watchdog aborted every group, any group) timed out before;
    before anything is issued, so that no dead communicator is touched or waited for."""
    first = expired() or failure(group)
    if first is not None:
        raise first.refused(operation)


def _deadline(group: Any, device: torch.device | str | None) -> float | None:
    """The deadline of a wait on ``group`` now: ``None`` while the current stream is capturing
    a graph (the graph launches the collective at each replay; nothing of mc2 runs there to
    watch it), else the call's cut to the group's own timeout."""
    if streams.capturing(device):
        watchdog().pause()
        return None
    return wait_deadline(current(), group, device)


def _observe(work: Any, style: CommStyle, rows: Tensor, on_complete: OnComplete) -> None:
    """Report when an asynchronous transfer completes: from the backend's future on a host
    backend; from an event behind the transfer on a side stream on a stream backend. A
    stream backend whose work's wait blocks the host (NCCL under ``TORCH_NCCL_BLOCKING_WAIT``)
    must not wait on the work here; its future, complete once the collective is *enqueued*,
    waits by making the current stream wait for the collective, and returns at once (a host
    clock in its callback timed the launch, and its floats met the device events of the
    timeline's clock when read)."""
    if not style.on_streams:
        issued = time.perf_counter()
        work.get_future().then(lambda _: on_complete(issued, time.perf_counter()))
        return
    clock = clock_for(rows.device)
    start = clock.stamp()  # the collective starts after the work queued before it
    observer = side_stream(rows.device, "observer")
    with observer:  # the observer stream, not the caller's, waits for the transfer
        work.wait() if style.stream else work.get_future().wait()
        on_complete(start, clock.stamp(observer))


def all_to_all_rows(
    rows: Tensor,
    send_splits: list[int] | None,
    recv_splits: list[int] | None,
    group: Any,
    *,
    async_op: bool,
    on_complete: OnComplete | None = None,
    workspace: Workspace | None = None,
    operation: str = "exchange",
    output: Tensor | None = None,
    style: CommStyle | None = None,
) -> PendingTransfer:
    """Variable-size All-to-All of rows (dropless): ``rows[sum(send_splits), H]`` out.

    Rows ``[sum(send_splits[:j]), sum(send_splits[:j+1]))`` go to rank ``j``; the result holds
    the rows from rank 0, then rank 1, ..., as ``[sum(recv_splits), H]``. ``on_complete(issued,
    done)`` receives the transfer's stamps (host seconds or device events, see
    :mod:`mc2.device.clock`) when it is asynchronous; used for profiling only. ``output``:
    the receive buffer, when the caller already has one. ``style``: the group's
    :class:`CommStyle` on the rows' device, when the caller knows it (else looked up).
    ``None`` splits: equal blocks, as many rows in as out (fixed-size slabs: nothing
    data-dependent reaches the host).
    """
    style = style or style_of(group, rows.device)
    if style is LOCAL:  # to itself: the rows are what arrives (in the caller's buffer if any)
        return PendingTransfer(output=rows if output is None else output.copy_(rows))
    refuse(group, operation)
    rows = rows.contiguous()
    if output is None:
        shape = ((int(sum(recv_splits)),) if recv_splits is not None else
                 (rows.shape[0],)) + tuple(rows.shape[1:])
        output = (workspace or Workspace.transient()).empty(shape, rows.dtype, rows.device)
    if not async_op:
        collective(lambda a: dist.all_to_all_single(output, rows, recv_splits, send_splits,
                                                     group=group, async_op=a),
                   group, operation, rows.device, style)
        return PendingTransfer(output=output, operation=operation)
    seconds = _deadline(group, rows.device)
    # before the issue: the device gets there
    start = start_stamp(rows.device, style.stream) if seconds is not None else None
    with surfaced():  # an aborted communicator refuses new work: report the timeout instead
        work = dist.all_to_all_single(
            output, rows, recv_splits, send_splits, group=group, async_op=True
        )
    if on_complete is not None and not streams.capturing(rows.device):
        _observe(work, style, rows, on_complete)
    return PendingTransfer(output=output, work=work, keep_alive=(rows,), operation=operation,
                           stream=style.stream, start=start, group=group, deadline_s=seconds)


@dataclass(frozen=True)
class FlatExchange:
    """One micro-batch's exchange as a single All-to-All over the whole group (``None``
    splits: equal slabs, capacity mode's)."""

    send_splits: list[int] | None
    recv_splits: list[int] | None
    group: Any
    workspace: Workspace | None = None  # where receive buffers come from
    style: CommStyle | None = None  # the group's, looked up once per call

    def dispatch(self, rows: Tensor, *, async_op: bool,
                 on_complete: OnComplete | None = None) -> PendingTransfer:
        return all_to_all_rows(rows, self.send_splits, self.recv_splits, self.group,
                               async_op=async_op, on_complete=on_complete,
                               workspace=self.workspace, operation="dispatch", style=self.style)

    def combine(self, rows: Tensor, *, async_op: bool,
                on_complete: OnComplete | None = None) -> PendingTransfer:
        return all_to_all_rows(rows, self.recv_splits, self.send_splits, self.group,
                               async_op=async_op, on_complete=on_complete,
                               workspace=self.workspace, operation="combine", style=self.style)


# operations of all_reduce_max that are control messages (run on the control group)
CONTROL_OPERATIONS = frozenset({"handshake"})


def group_key(group: Any) -> tuple:
    """What names a group alike on every rank, and after the group is rebuilt: its ranks and
    backend (never ``id(group)``, which differs between processes); ``("local",)`` without an
    initialised ``torch.distributed``."""
    if not initialized():
        return ("local",)
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    return ranks, str(dist.get_backend(group))


def _registered(group: Any) -> bool:
    """Whether ``group`` is still a live group of this process (not destroyed)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def control_group(group: Any, device: torch.device | str | None = None) -> Any:
    """The communicator of ``group``'s control messages: a process group over the same ranks
    with the same backend, made once and held by the group's state
    (:mod:`~mc2.engine.transport.group_state`), dropped with the group.

    Made with ``dist.new_group(ranks, use_local_synchronization=True)``, so only the members
    take part. Making a group is itself a collective of the members, so it is made at the
    first control message on ``group``, which every member sends at the same point of the same
    call. ``torch.distributed`` names such a group from its ranks and the number of groups the
    process has already made: the members first agree on that number, on ``group`` itself (one
    small collective, once); where they differ, the names would not match and the creation
    would hang, so the control messages stay on ``group`` (with a warning). For the same reason
    code that later makes groups with ``use_local_synchronization=True`` must have their
    members in step (torch's own rule): a member that ran ``fused_expert`` on a group holds one
    group more than one that did not. A local group (one rank, or no ``torch.distributed``) is
    returned as it is and nothing is made.

    Args:
        device: where the agreement's tensor lives (the device of the call's data).
    """
    if is_local(group):
        return group
    state = group_state(group)
    if state.control is None or not _registered(state.control):
        state.control = _new_control_group(group, group_key(group), device)
        if state.control is not group:  # its timeouts are the group's
            group_state(state.control).carries_for = weakref.ref(state)
    return state.control


def groups_made_agree(group: Any, device: torch.device | str | None = None) -> str | None:
    """Whether every member of ``group`` has made as many process groups so far (one small
    collective on ``group``, which every member calls at the same point): ``None``, else the
    start of the error that says they have not.

    Why: a group made with ``use_local_synchronization=True`` is named from its ranks and the
    number of groups the calling process has made; members that made different numbers would
    name it differently and hang in its creation.
    """
    try:
        made = len(dist.distributed_c10d._world.pg_names)
    except AttributeError:  # a torch without the registry: trust the creation order
        made = -1
    groups = torch.tensor([made, -made], dtype=torch.int64, device=device or "cpu")
    collective(lambda a: dist.all_reduce(groups, op=dist.ReduceOp.MAX, group=group,
                                         async_op=a), group, "group agreement", groups.device)
    most, fewest = read(groups)
    return None if most == -fewest else ("mc2: the ranks of a group have made different numbers "
                                          f"of process groups ({-fewest} to {most})")


def _new_group(ranks: Sequence[int], backend: str | None, parent: Any,
               device: torch.device | str | None) -> Any:
    """A process group over ``ranks`` made by its members alone, with ``parent``'s own
    timeout: not torch's default for a new group (30 minutes on Gloo), so that nothing on it
    outwaits what the user gave ``parent``."""
    own = group_timeout(parent, device)
    return dist.new_group(list(ranks), backend=backend, use_local_synchronization=True,
                          timeout=None if own is None else timedelta(seconds=own))


def member_groups(parent: Any, member_lists: list[list[int]], *, backend: str | None = None,
                  device: torch.device | str | None = None) -> list[Any]:
    """New process groups over the global ``member_lists`` (each a subset of ``parent``'s
    ranks), made by ``parent``'s members alone: the calling rank makes only the groups it is a
    member of (``None`` stands for the others), in list order.

    Why not a plain ``dist.new_group``: that is a collective of the *whole world*, named by a
    world-wide counter, so an expert-parallel group inside a larger mesh (two EP groups of a
    DP x EP job making their node groups at the same time) would create groups under the same
    names and hang. With ``use_local_synchronization=True`` each group is named from its ranks,
    and only its members take part; the members first agree that they have made the same
    number of groups (:func:`groups_made_agree`), else the names would differ: then every
    member raises the same ``RuntimeError`` rather than hanging.
    """
    if (differ := groups_made_agree(parent, device)) is not None:
        raise RuntimeError(f"{differ}, so the groups over {member_lists} cannot be made by its "
                           "members alone; make the same process groups, in the same order, on "
                           "every rank")
    me = dist.get_rank()
    return [_new_group(ranks, backend, parent, device) if me in ranks else None
            for ranks in member_lists]


def _new_control_group(group: Any, key: tuple[tuple[int, ...], str],
                       device: torch.device | str | None) -> Any:
    ranks, backend = key
    if (differ := groups_made_agree(group, device)) is not None:
        warnings.warn(f"{differ}, so a control group over ranks {list(ranks)} cannot be made; "
                      "its handshake and counts share the row transfers' communicator",
                      RuntimeWarning, stacklevel=3)
        return group
    # the group's own timeout (_new_group): the handshake must not outwait it
    return _new_group(ranks, None if backend == str(dist.get_backend()) else backend, group,
                      device)


def exchange_counts(send_counts: Tensor, group: Any) -> Tensor:
    """The one up-front exchange of per-micro-batch, per-expert row counts (on the control
    group, :func:`control_group`).

    Args:
        send_counts: ``[world, n] int64``: what this rank tells each rank (destination-major).

    Returns:
        ``[world, n] int64``: what each rank told this one (source-major).
    """
    return exchange_slots(send_counts, None, None, group, "counts exchange")


def exchange_slots(send: Tensor, send_splits: list[int] | None, recv_splits: list[int] | None,
                   group: Any, operation: str = "slot exchange") -> Tensor:
    """A variable-size exchange of small per-row tables (the slot tables of
    :mod:`mc2.engine.decide.dedup`, and their gradients back), on the control group
    (:func:`control_group`): rows ``[sum(send_splits), w]`` out, ``[sum(recv_splits), w]`` in
    (``None`` splits: equal blocks, as many rows in as out)."""
    if is_local(group):
        return send.clone()
    send = send.contiguous()
    rows = send.shape[0] if recv_splits is None else sum(recv_splits)
    recv = send.new_empty((rows,) + tuple(send.shape[1:]))
    control = control_group(group, send.device)
    collective(lambda a: dist.all_to_all_single(recv, send, recv_splits, send_splits,
                                                 group=control, async_op=a),
               control, operation, send.device)
    return recv


def gather_counts(send_totals: Tensor, group: Any) -> Tensor:
    """Every rank's tensor to every rank: ``[world, *send_totals.shape]`` (on the control
    group, :func:`control_group`).

    Args:
        send_totals: e.g. ``[K, world] int64`` rows this rank sends to each rank per
            micro-batch.
    """
    if is_local(group):
        return send_totals.unsqueeze(0).clone()
    send = send_totals.contiguous()
    parts = [torch.empty_like(send) for _ in range(group_size(group))]
    control = control_group(group, send.device)
    collective(lambda a: dist.all_gather(parts, send, group=control, async_op=a), control,
               "counts gather", send.device)
    return torch.stack(parts)


def all_reduce_max(values: Tensor, group: Any, operation: str = "agreement") -> Tensor:
    """Element-wise maximum over the group (identity for one rank), on the group's control
    communicator (:func:`control_group`) for the operations in :data:`CONTROL_OPERATIONS`
    (the handshake), on ``group`` otherwise."""
    return all_reduce_max_later(values, group, operation)()


def all_reduce_max_later(values: Tensor, group: Any, operation: str = "agreement"
                         ) -> Callable[[], Tensor]:
    """:func:`all_reduce_max` issued now; the returned function waits for it and returns the
    maximum (work done in between hides the collective's latency)."""
    if is_local(group):
        return lambda: values
    on = control_group(group, values.device) if operation in CONTROL_OPERATIONS else group
    values = values.clone()
    done = collective_later(lambda a: dist.all_reduce(values, op=dist.ReduceOp.MAX, group=on,
                                                      async_op=a), on, operation, values.device)
    return lambda: (done(), values)[1]


def host_max(values: Sequence[float], group: Any, operation: str) -> list[float]:
    """Element-wise maximum of host numbers over the group, with no device in the way.

    Why: a decision agreed at every forward from host facts (batch overlap's: can this rank
    split its batch, how long did its step take) would otherwise upload a flag, reduce it on
    the device and read it back, a host synchronisation in every step. Here the numbers stay
    in host memory: on ``group`` itself where its collectives take CPU tensors (Gloo, or a
    mixed ``"cpu:gloo,cuda:nccl"`` group), else on a Gloo group over the same ranks
    (:func:`host_group`, made once)."""
    if is_local(group):
        return [float(v) for v in values]
    on = host_group(group)
    numbers = torch.tensor([float(v) for v in values], dtype=torch.float64)
    collective(lambda a: dist.all_reduce(numbers, op=dist.ReduceOp.MAX, group=on, async_op=a),
               on, operation, numbers.device)
    return numbers.tolist()


def host_ranges(values: Sequence[float], group: Any, operation: str
                ) -> list[tuple[float, float]]:
    """Each value's smallest and largest over the group (one :func:`host_max` of the values
    and their negations): where they differ, the ranks disagree, and every rank knows it."""
    high = host_max([*values, *(-v for v in values)], group, operation)
    return [(-high[len(values) + i], high[i]) for i in range(len(values))]


def host_group(group: Any) -> Any:
    """Where :func:`host_max` meets: ``group`` if it carries host memory, else a Gloo group
    over its ranks, made by its members at the first host agreement (which every member
    reaches at the same point) and held by the group's state."""
    if carries_host_memory(group):
        return group
    state = group_state(group)
    if state.host is None or not _registered(state.host):
        device = torch.device(torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        if (differ := groups_made_agree(group, device)) is not None:
            raise RuntimeError(f"{differ}, so the Gloo group of its host agreements cannot be "
                               "made; make the same process groups, in the same order, on "
                               "every rank")
        state.host = _new_group(dist.get_process_group_ranks(group), "gloo", group, device)
        group_state(state.host).carries_for = weakref.ref(state)
    return state.host


def barrier(group: Any, operation: str = "barrier", device: torch.device | None = None) -> None:
    """A barrier under the call's deadline: a one-element ``all_reduce`` on ``device`` (a
    ``dist.barrier`` on NCCL guesses a device and may pick the wrong one)."""
    if not is_local(group):
        all_reduce_max(torch.zeros(1, device=device or "cpu"), group, operation)


def collective(issue: Callable[[bool], Any], group: Any, operation: str,
               device: torch.device | str | None = None, style: CommStyle | None = None) -> None:
    """Run a collective to completion under the call's deadline (:mod:`mc2.engine.transport.deadline`).

    ``issue(async_op)`` starts it. Without a deadline, or on a backend without asynchronous
    collectives (or ``MC2_FORCE_SYNC``), it runs synchronously and only the process group's own
    timeout applies. Otherwise it is issued asynchronously and waited for: on a host backend
    with the deadline; on a stream backend stream-ordered, watched by the watchdog ("to
    completion" then means: for every later use on the current stream).
    """
    collective_later(issue, group, operation, device, style)()


def collective_later(issue: Callable[[bool], Any], group: Any, operation: str,
                     device: torch.device | str | None = None, style: CommStyle | None = None
                     ) -> Callable[[], None]:
    """:func:`collective` issued now; the returned function waits for it (at once where it
    runs synchronously)."""
    style = style or style_of(group, torch.device(device or "cpu"))
    refuse(group, operation)
    seconds = _deadline(group, device)
    if seconds is None or not style.asynchronous:
        with surfaced():
            issue(False)
        return lambda: None
    start = start_stamp(device, style.stream)
    with surfaced():
        work = issue(True)
    return lambda: _wait(work, operation, stream=style.stream, start=start, group=group,
                         deadline_s=seconds)


def gather_objects(obj: Any, group: Any) -> list[Any]:
    """Every rank's ``obj`` (used only on the error path, where cost does not matter)."""
    if is_local(group):
        return [obj]
    out: list[Any] = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
