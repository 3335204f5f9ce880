"""A local multi-process ``torch.distributed`` world: the embedded default (Gloo on CPU).

``run_local(fn, world_size)`` spawns ``world_size`` processes on this machine, joins them in a
process group over loopback (127.0.0.1 only), calls ``fn(rank, world_size, *args)`` in each and
returns every rank's result. A rank that raises, dies or runs past ``deadline_s`` makes the whole
call raise :class:`LocalWorldError` with each rank's story, and every process is ended: a broken
world never hangs the caller. For real clusters launch with ``torchrun`` instead.

Ranks are forked from a *preloaded fork server* (``multiprocessing``'s ``forkserver`` with torch
and mc2 imported once): importing torch costs each fresh interpreter about 3 s of CPU, which is
most of what a small world costs, and a process that calls ``run_local`` many times (a test
suite, a benchmark's rounds) pays it once. Each rank still starts from a clean copy of the
server, so no state leaks between worlds, and it takes the caller's environment as it is at the
call. :func:`preload` adds modules (a test's workers, transformers) before the server starts.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import queue
import signal
import time
import traceback
from datetime import timedelta
from typing import Any, Callable


class LocalWorldError(RuntimeError):
    """One or more ranks of a local world failed; ``failures`` maps rank -> traceback text,
    ``values`` rank -> result for the ranks that did finish."""

    def __init__(self, message: str, failures: dict[int, str],
                 values: dict[int, Any] | None = None):
        super().__init__(message)
        self.failures = failures
        self.values = values or {}


_PRELOAD: list[str] = ["torch", "torch.distributed", "mc2"]
_START_METHOD = "forkserver"


def preload(*modules: str) -> None:
    """Import ``modules`` once in the fork server the ranks are forked from.

    Only modules named before the first :func:`run_local` of this process take effect (the
    server starts then and keeps what it imported); a module that fails to import there is
    imported by each rank as usual.
    """
    for name in modules:
        if name not in _PRELOAD:
            _PRELOAD.append(name)


def _context() -> Any:
    """The multiprocessing context ranks start from: the preloaded fork server where the
    platform has one (Linux, macOS), else ``spawn``."""
    if _START_METHOD in mp.get_all_start_methods():
        ctx = mp.get_context(_START_METHOD)
        ctx.set_forkserver_preload(list(_PRELOAD))
        atexit.unregister(_stop_server)  # registered once, however many worlds start
        atexit.register(_stop_server)
        return ctx
    return mp.get_context("spawn")


def _stop_server() -> None:
    """End the fork server with this process. Left alone it would notice that its last client
    is gone and shut its interpreter down (torch's included) for a second or more after this
    process has exited: a Ctrl-C'd command would seem to leave a process behind. It holds no
    state, and its ranks are ended by :func:`run_local` already."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def steady_allocator() -> bool:
    """Keep freed heap memory in the process instead of returning it to the OS (glibc only).

    Why: by default glibc serves blocks above a threshold with ``mmap`` and gives them back with
    ``munmap`` on free, so every training step page-faults its large activations back in (the
    kernel zeroes each page). That costs more than 10% of a CPU MoE step here and, worse for a
    benchmark, flatters whichever schedule allocates smaller blocks. Accelerator caching
    allocators never pay it, so the local world removes it for every mode alike.
    Returns whether the setting took effect.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok_mmap = mallopt(_M_MMAP_THRESHOLD, 1 << 30)
    ok_trim = mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)
    return bool(ok_mmap and ok_trim)


def use_device(device: str | None, local_rank: int) -> str:
    """Make ``device`` this process's device: ``"cuda"`` (or another accelerator type) picks
    ``local_rank``'s device, several ranks sharing one device when there are fewer devices
    than ranks (Gloo moves CUDA tensors through the host, so that works). Returns the device
    string the rank computes on (``"cpu"`` for ``None``)."""
    import torch

    if device is None or device == "cpu":
        return "cpu"
    kind = torch.device(device).type
    if not torch.accelerator.is_available() or \
            torch.accelerator.current_accelerator().type != kind:
        raise RuntimeError(f"device {device!r} requested but this process has no {kind} "
                           "accelerator")
    index = torch.device(device).index
    if index is None:
        index = local_rank % torch.accelerator.device_count()
    torch.accelerator.set_device_index(index)
    return f"{kind}:{index}"


def _store(rank: int, world_size: int, ports: Any, timeout_s: float) -> Any:
    """The world's ``TCPStore``. Rank 0 listens on a port the OS picks as it binds (port 0) and
    hands it to the other ranks through ``ports``. A port picked by the parent and bound later
    by rank 0 could be taken in between: two test workers making worlds at once did that
    (``EADDRINUSE`` on rank 0, and rank 1 connecting to another world's store)."""
    from torch.distributed import TCPStore

    host, timeout = os.environ["MASTER_ADDR"], timedelta(seconds=timeout_s)
    if rank == 0:
        store = TCPStore(host, 0, world_size, is_master=True, timeout=timeout,
                         wait_for_workers=False)
        for _ in range(world_size - 1):
            ports.put(store.port)
    else:
        store = TCPStore(host, ports.get(timeout=timeout_s), world_size, is_master=False,
                         timeout=timeout)
    os.environ["MASTER_PORT"] = str(store.port)  # as torchrun's ranks see it
    return store


def _all_initialised(store: Any, rank: int, world_size: int, timeout_s: float) -> None:
    """Wait, through the store, until every rank's process group is made. Without it a rank
    whose function returns at once could exit while a slower peer was still connecting its
    Gloo pairs: the peer's init failed ("Failed to recv, got 0 bytes"), not its function (seen
    once, under load, in ``test_failing_rank_is_reported_and_world_ends``). Not torch's own
    ``TORCH_DIST_INIT_BARRIER=1``: that would also put a barrier in every ``new_group`` the
    ranks' functions make, and reach their environment."""
    store.set(f"mc2/initialised/{rank}", "1")
    store.wait([f"mc2/initialised/{r}" for r in range(world_size)], timedelta(seconds=timeout_s))


def _worker(
    rank: int, world_size: int, ports: Any, backend: str, threads: int, timeout_s: float,
    steady: bool, per_node: int, extra_env: dict[str, str], fn: Callable[..., Any],
    args: bytes, results: Any, device: str | None = None,
    before_init: Callable[[], None] | None = None, environment: dict[str, str] | None = None,
) -> None:
    if environment is not None:  # the caller's environment now, not the fork server's
        os.environ.clear()
        os.environ.update(environment)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % per_node),
                      LOCAL_WORLD_SIZE=str(per_node))
    os.environ.update(extra_env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if steady:
        steady_allocator()
    try:
        if "MC2_NETNS" in extra_env:  # before any socket is opened
            from mc2.tools.netns import enter_namespace

            enter_namespace(extra_env["MC2_NETNS"])
        use_device(device, rank % per_node)
        if before_init is not None:
            before_init()
        store = _store(rank, world_size, ports, timeout_s)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        _all_initialised(store, rank, world_size, timeout_s)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    try:
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *pickle.loads(args)))))
    except BaseException:  # report everything, including KeyboardInterrupt
        results.put((rank, False, traceback.format_exc()))
    # reported before tearing down: after a timed-out collective the teardown may block (the
    # parent then ends this process)
    try:
        dist.destroy_process_group()
    except BaseException:
        pass


def run_local(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple[Any, ...] = (),
    backend: str = "gloo",
    threads: int = 1,
    timeout_s: float = 60.0,
    deadline_s: float = 600.0,
    steady_memory: bool = False,
    ranks_per_node: int | None = None,
    rank_env: Callable[[int], dict[str, str]] | None = None,
    device: str | None = None,
    before_init: Callable[[], None] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks; return their results.

    Args:
        fn: a module-level (picklable) function; its return value must be picklable.
        world_size: number of processes (ranks).
        backend: ``torch.distributed`` backend; ``"gloo"`` runs anywhere on CPU.
        threads: ``torch.set_num_threads`` per rank (1 keeps ranks from fighting over cores).
        timeout_s: collective timeout of the process group (a dead peer becomes an error).
        deadline_s: wall-clock limit for the whole world.
        steady_memory: apply :func:`steady_allocator` in every rank (off by default: measure
            what a user's ``torchrun`` process gets; mc2's own workspace keeps memory put).
        ranks_per_node: present the ranks as nodes of this many ranks (``LOCAL_WORLD_SIZE``),
            so topology-aware code sees several nodes; the links stay loopback.
        rank_env: extra environment per rank, e.g. :meth:`mc2.tools.netns.EmulatedCluster.
            rank_environment` to run each rank inside its emulated node's namespace.
        device: ``None``/``"cpu"``, or an accelerator (``"cuda"``): each rank's current
            device is set before the group is made (:func:`use_device`; ranks share devices
            when there are fewer than ranks). ``fn`` then puts its tensors there.
        before_init: a module-level function each rank calls before ``init_process_group``,
            e.g. to register a third-party backend.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    per_node = ranks_per_node or world_size
    if per_node < 1 or world_size % per_node:
        raise ValueError(f"ranks_per_node ({per_node}) must divide world_size ({world_size})")
    ctx = _context()
    results, ports = ctx.Queue(), ctx.Queue()  # ports: rank 0's store port, to the others
    # pickled by value here: multiprocessing's own pickler would hand every tensor over as a
    # shared-memory file descriptor, and a fork server takes at most 256 of those per process
    payload = pickle.dumps(args)
    procs = [
        ctx.Process(target=_worker, daemon=True,
                    args=(r, world_size, ports, backend, threads, timeout_s, steady_memory, per_node,
                          rank_env(r) if rank_env else {}, fn,
                          payload, results, device, before_init, dict(os.environ)))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, deadline_s)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


def _collect(procs: list[Any], results: Any, deadline_s: float) -> list[Any]:
    """Every rank's result, in rank order; :class:`LocalWorldError` with each failed rank's
    story when a rank raised, died, or the world passed ``deadline_s``."""
    world_size = len(procs)
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + deadline_s
    while len(values) + len(failures) < world_size:
        try:
            rank, ok, payload = results.get(timeout=0.5)
        except queue.Empty:
            if time.monotonic() > deadline:
                raise LocalWorldError(
                    f"local world of {world_size} ranks passed its {deadline_s:.0f}s deadline",
                    failures, values) from None
            dead = [r for r, p in enumerate(procs)
                    if not p.is_alive() and p.exitcode not in (0, None)
                    and r not in values and r not in failures]
            for r in dead:
                failures[r] = f"rank {r} died with exit code {procs[r].exitcode}"
            continue
        if ok:
            values[rank] = pickle.loads(payload)
        else:
            failures[rank] = payload
    if failures:
        detail = "\n".join(f"--- rank {r} ---\n{t}" for r, t in sorted(failures.items()))
        raise LocalWorldError(f"{len(failures)} of {world_size} ranks failed:\n{detail}",
                              failures, values)
    return [values[r] for r in range(world_size)]
