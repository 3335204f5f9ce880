"""Rank functions for the fault matrix: peers that stall or die, and what the others see."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

import mc2
from tests.problems import make_problem

TIMEOUT_S = 3.0


def _call(p, rank: int, **options: Any):
    x = p.xs[rank].clone().requires_grad_(True)
    ws = [w.clone().requires_grad_(True) for w in p.local_weights(rank)]
    return mc2.fused_expert(x, *ws, p.ids[rank], p.rws[rank], timeout=TIMEOUT_S, **options)


def _fault(kind: str) -> None:
    if kind == "stalled":
        os.kill(os.getpid(), signal.SIGSTOP)  # alive, silent, until someone ends it
    else:
        os._exit(17)  # gone, without a goodbye


class _FaultyPlanner(mc2.Planner):
    """A planner whose calibration is where the fault strikes (after the call's handshake)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def _measure(self, *args: Any, **kwargs: Any) -> Any:
        _fault(self.kind)
        return super()._measure(*args, **kwargs)


def faulty_peer(rank: int, world: int, kind: str, where: str) -> dict[str, Any]:
    """The last rank stalls or dies ``where`` (forward, backward, calibration); the survivors
    report what they raised and how long after the fault's moment."""
    import torch.distributed as dist

    p = make_problem(world, "uniform", tokens=64)
    _call(p, rank, micro_batches=2).sum().backward()  # a good step first
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    culprit = rank == world - 1
    # fresh: "auto" calibrates on its first call; on the culprit the calibration is the fault
    planner = _FaultyPlanner(kind) if culprit else mc2.Planner()
    options: dict[str, Any] = {"micro_batches": "auto", "planner": planner} \
        if where == "calibration" else {"micro_batches": 2}
    start = time.monotonic()
    try:
        if culprit and where == "forward":
            _fault(kind)
        out = _call(p, rank, **options)
        if culprit and where == "backward":
            _fault(kind)
        out.sum().backward()
        return {"raised": None, "after_s": time.monotonic() - start}
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        after = time.monotonic() - start
        if kind == "stalled":  # what a launcher does with a stuck worker, once all raised
            _kill_when_all_raised(rank, world, pids)
        return {"raised": type(exc).__name__, "message": str(exc), "after_s": after}


def _kill_when_all_raised(rank: int, world: int, pids: list[int]) -> None:
    """Each survivor says it raised (a file named by rank 0's pid); rank 0 kills the stalled
    last rank once every survivor has. Killed earlier, a survivor still inside its deadline
    sees the culprit's sockets close (Gloo's read error) instead of its own deadline: a
    loaded machine did that (rank 1 began its wait later than rank 0)."""
    import tempfile
    from pathlib import Path

    flags = [Path(tempfile.gettempdir()) / f"mc2-faulty-{pids[0]}-{r}" for r in range(world - 1)]
    flags[rank].touch()
    if rank != 0:
        return
    give_up = time.monotonic() + 30.0  # a survivor that never raises fails the test anyway
    while not all(f.exists() for f in flags) and time.monotonic() < give_up:
        time.sleep(0.02)
    os.kill(pids[-1], signal.SIGKILL)
    for flag in flags:
        flag.unlink(missing_ok=True)


def nonfinite_token(rank: int, world: int, value: float, check: bool,
                    capacity: int | None = None) -> dict[str, Any]:
    """One token of rank 0 holds ``value`` (nan or inf): where does it end up? ``capacity``:
    capacity mode, the bad call after a clean one agreed the configuration (a steady call)."""
    p = make_problem(world, "uniform", tokens=16)
    options = dict(micro_batches=2, check_finite=check, capacity=capacity)
    if capacity is not None:  # the same call on clean tokens, as a training step's first
        mc2.fused_expert(p.xs[rank].clone().requires_grad_(True),
                         *(w.clone().requires_grad_(True) for w in p.local_weights(rank)),
                         p.ids[rank], p.rws[rank], **options)
    if rank == 0:
        p.xs[0][3, 5] = value
    x = p.xs[rank].clone().requires_grad_(True)
    ws = [w.clone().requires_grad_(True) for w in p.local_weights(rank)]
    try:
        out = mc2.fused_expert(x, *ws, p.ids[rank], p.rws[rank], **options)
    except ValueError as exc:
        return {"error": str(exc)}
    out.backward(p.grad_outs[rank])
    bad_rows = (~torch.isfinite(out)).any(-1).nonzero().flatten().tolist()
    bad_x_rows = (~torch.isfinite(x.grad)).any(-1).nonzero().flatten().tolist()
    experts_poisoned = [int(e) for e in range(ws[0].shape[0])
                        if not all(torch.isfinite(w.grad[e]).all() for w in ws)]
    return {"error": None, "bad_rows": bad_rows, "bad_grad_rows": bad_x_rows,
            "poisoned_local_experts": experts_poisoned,
            "token_experts": p.ids[0][3].tolist() if rank == 0 else None}


# the functions whose collectives a recorded call attributes, by what they send
_SENDERS = {"agree": "handshake", "exchange_counts": "counts", "gather_counts": "counts",
            "all_to_all_rows": "rows", "_new_control_group": "setup"}


def _sender() -> str:
    """Which of mc2's senders issued the collective being recorded (walks up the stack)."""
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in _SENDERS:
            return _SENDERS[frame.f_code.co_name]
        frame = frame.f_back
    return "other"


def control_messages(rank: int, world: int) -> dict[str, Any]:
    """Which process group each collective of a call ran on: the handshake and the counts
    (exchange and, with the 2-D exchange, gather) against the row transfers; the outputs and
    input gradients of a flat and a 2-D call, for the dense reference."""
    import torch.distributed as dist

    from mc2.engine.transport import comm

    seen: list[tuple[str, str]] = []

    def name_of(group: Any) -> str:
        return (group if group is not None else dist.group.WORLD).group_name

    def recorded(real: Any) -> Any:
        def collective(*args: Any, group: Any = None, **kwargs: Any) -> Any:
            seen.append((_sender(), name_of(group)))
            return real(*args, group=group, **kwargs)
        return collective

    for fn in ("all_reduce", "all_to_all_single", "all_gather"):
        setattr(dist, fn, recorded(getattr(dist, fn)))
    p = make_problem(world, "uneven", seed=3)
    results = {}
    for name, options in {"flat": {"micro_batches": 3},
                          "2d": {"micro_batches": 2, "hierarchy": "2d"}}.items():
        x = p.xs[rank].clone().requires_grad_(True)
        ws = [w.clone().requires_grad_(True) for w in p.local_weights(rank)]
        out = mc2.fused_expert(x, *ws, p.ids[rank], p.rws[rank], timeout=30, **options)
        out.backward(p.grad_outs[rank])
        results[name] = {"out": out.detach(), "x": x.grad}
    by_sender: dict[str, list[str]] = {}
    for sender, group in seen:
        by_sender.setdefault(sender, []).append(group)
    make = getattr(comm, "control_group", None)
    shared = None
    if make is not None:  # a group made anew over the same ranks: its own control group
        other = dist.new_group(list(range(world)))
        shared = make(other) is make(None)
    return {"by_sender": by_sender, "world": name_of(None), "results": results,
            "control": make(None).group_name if make is not None else None,
            "shared_by_ranks": shared}


def stream_stall_aborts(rank: int, world: int) -> dict[str, Any]:
    """On the emulated stream backend rank 1 stalls a dispatch past the deadline: what the
    watchdog aborted, and the groups this process has."""
    import torch.distributed as dist

    from tests import fake_stream_backend as fake

    p = make_problem(world, "uniform", tokens=20)
    error = None
    x = p.xs[rank].clone().requires_grad_(True)
    try:
        mc2.fused_expert(x, *p.local_weights(rank), p.ids[rank], p.rws[rank], micro_batches=3,
                         timeout=1.0).sum().backward()
    except mc2.CommTimeout as exc:
        error = exc.operation
    return {"error": error, "aborts": fake.STATE.get("aborts", 0),
            "aborted_groups": fake.STATE.get("aborted_groups", 0),
            "groups": len(dist.distributed_c10d._world.pg_names)}
