"""Rank functions of the accelerator-path tests (module level, so spawn can import them)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

import mc2
from mc2.observation.host_syncs import HostSyncCounter
from tests.problems import make_problem


def _counted(fn: Any) -> tuple[Any, dict[str, int]]:
    with HostSyncCounter() as syncs:
        result = fn()
    return result, {"reads": syncs.reads, "uploads": syncs.uploads, "where": syncs.where}


class ExtraRead(torch.autograd.Function):
    """The identity, plus one deliberate host read in its forward and one in its backward.

    Put in front of a call inside the counted region, it must raise the counts by exactly one
    read each way: the proof that the counter sees the forward and, through the autograd
    engine, the backward (where mc2's own backward runs) at all.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        x.sum().tolist()
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad.sum().item()
        return grad


def _fused_step(p: Any, rank: int, extra_read: bool = False, **options: Any) -> dict[str, Any]:
    """A forward (counted) and a backward (counted) of one fused_expert call."""
    x = p.xs[rank].clone().requires_grad_(True)
    ws = [w.clone().requires_grad_(True) for w in p.local_weights(rank)]

    def call() -> torch.Tensor:
        rows = ExtraRead.apply(x) if extra_read else x
        return mc2.fused_expert(rows, *ws, p.ids[rank], p.rws[rank], **options)

    out, fwd = _counted(call)
    _, bwd = _counted(lambda: out.backward(p.grad_outs[rank]))
    return {"forward": fwd, "backward": bwd, "out": out.detach(), "x": x.grad}


def host_syncs(rank: int, world: int) -> dict[str, Any]:
    """The second of two identical calls per case (the first makes groups, calibrates)."""
    p = make_problem(world, "uneven", tokens=40, hidden=32, ffn=16)
    cases: dict[str, dict[str, Any]] = {
        f"K{k}": {"micro_batches": k} for k in (1, 4, 8)}
    cases["K4 serial"] = {"micro_batches": 4, "overlap": False}
    cases["K4 fp8 wire"] = {"micro_batches": 4, "wire_dtype": torch.float8_e4m3fn,
                            "wire_block": 16}
    cases["K4 int8/bf16 wire"] = {"micro_batches": 4, "wire_dtype": ("int8", torch.bfloat16),
                                  "wire_block": 16}
    cases["K4 check_finite"] = {"micro_batches": 4, "check_finite": True}
    cases["K4 dedup"] = {"micro_batches": 4, "dedup": True}
    for k in (1, 4, "auto"):  # capacity mode: nothing read, nothing uploaded, at any K
        cases[f"K{k} capacity"] = {"micro_batches": k, "capacity": 128}  # auto: calibrated
    shared = make_problem(1, "uniform", hidden=32, ffn=8, local_experts=1, seed=5)
    cases["K4 shared experts"] = {"micro_batches": 4, "shared_up": shared.w_up,
                                  "shared_gate": shared.w_gate, "shared_down": shared.w_down}
    # must count one read more each way (forward and backward): the counter is live
    cases["K1 + extra read"] = {"micro_batches": 1, "extra_read": True}
    cases["K4 + extra read"] = {"micro_batches": 4, "extra_read": True}
    if world == 4:
        cases = {"K4 2d": {"micro_batches": 4, "hierarchy": "2d"},
                 "K1 2d": {"micro_batches": 1, "hierarchy": "2d"},
                 "K4 2d dedup": {"micro_batches": 4, "hierarchy": "2d", "dedup": True},
                 "K4 capacity": {"micro_batches": 4, "capacity": 128}}
    counted: dict[str, Any] = {}
    for name, options in cases.items():
        for _ in range(2):
            step = _fused_step(p, rank, **options)
        counted[name] = {"forward": step["forward"], "backward": step["backward"]}
    if world == 2:
        torch.manual_seed(0)
        layer = mc2.MoELayer(32, 16, 4, 2, micro_batches=4).double()
        x = torch.randn(3, 10, 32, dtype=torch.float64, requires_grad=True)
        def loss_of(result: Any) -> Any:
            out, losses = result
            return out.sum() + losses.load_balancing + losses.z_loss

        for _ in range(2):
            result, fwd = _counted(lambda: layer(x, return_losses=True))
            _, bwd = _counted(lambda r=result: loss_of(r).backward())
        counted["MoELayer(return_losses=True)"] = {"forward": fwd, "backward": bwd}
    return counted


def fake_stream_backend(rank: int, world: int, hierarchy: str, blocking: bool = False
                        ) -> dict[str, Any]:
    """fused_expert over the emulated stream backend: results and every wait's timeout
    (``blocking``: its waits block the host, as NCCL's under ``TORCH_NCCL_BLOCKING_WAIT``)."""
    from tests import fake_stream_backend as fake

    stamps: list[float] = []
    if blocking:
        from mc2.device.clock import HostClock

        class Counted(HostClock):  # the device clock's place: which stamps the observer took
            def stamp(self, stream: Any = None) -> float:
                stamps.append(super().stamp(stream))
                return stamps[-1]

        mc2.engine.transport.backend._blocking_wait = lambda name: True
        mc2.engine.transport.comm.clock_for = lambda device: Counted()

    from mc2.engine.transport.hierarchy import TwoStageExchange

    p = make_problem(world, "uneven", seed=1)
    fake.WAITS.clear()
    results = []
    # what each chained 2-D transfer holds until it is waited for, or for good if abandoned
    chained, held = TwoStageExchange._chained, []

    def holding(self: Any, *args: Any, **kwargs: Any) -> Any:
        last = chained(self, *args, **kwargs)
        held.append(all(any(t is kept for kept in last.keep_alive)
                        for t in (args[0], self.intra_gather)))
        return last
    TwoStageExchange._chained = holding
    timeline = mc2.Timeline()  # transfers observed the stream way (an event behind the work)
    for k in (1, 3):
        step = _fused_step(p, rank, micro_batches=k, hierarchy=hierarchy, timeout=30,
                           timeline=timeline if k == 3 else None)
        results.append({"out": step["out"], "x": step["x"]})
    # again, counted: on a stream backend the 2-D stages are chained in the caller's thread,
    # so the counter sees all of the call (on Gloo its thread runs outside the counter's reach)
    counted = {}
    for k in (1, 3):
        step = _fused_step(p, rank, micro_batches=k, hierarchy=hierarchy, timeout=30)
        counted[f"K{k}"] = {"forward": step["forward"], "backward": step["backward"]}
    TwoStageExchange._chained = chained
    return {"results": results, "counted": counted, "waits": list(fake.WAITS), "held": held,
            "transfers": sum(s.kind == "transfer" for s in timeline.spans),
            "observer_stamps": len(stamps),
            "backend": mc2.engine.transport.backend.backend_for(None, "cpu"),
            "style": mc2.engine.transport.backend.comm_style(None, "cpu").stream,
            "watched_now": mc2.engine.transport.watchdog.watchdog().in_flight}


def fake_stream_stall(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 stalls one All-to-All for longer than the deadline: a CommTimeout naming it."""
    from tests import fake_stream_backend as fake

    p = make_problem(world, "uniform", tokens=20)
    error: dict[str, Any] = {}
    try:
        _fused_step(p, rank, micro_batches=3, timeout=1.0)
    except mc2.CommTimeout as exc:
        error = {"operation": exc.operation, "micro_batch": exc.micro_batch,
                 "phase": exc.phase, "waited": exc.waited_s, "message": str(exc)}
    return {"error": error, "aborted": fake.STATE["aborted"], "waits": list(fake.WAITS)}


def backend_by_device(rank: int, world: int) -> dict[str, Any]:
    """A mixed backend string and a backend-less default group: asynchronous, no fallback."""
    p = make_problem(world, "uniform")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tl = mc2.Timeline()
        x = p.xs[rank].clone().requires_grad_(True)
        out = mc2.fused_expert(x, *p.local_weights(rank), p.ids[rank], p.rws[rank],
                               micro_batches=2, timeline=tl)
        out.backward(p.grad_outs[rank])
    return {"get_backend": str(dist.get_backend()),
            "serving_cpu": mc2.engine.transport.backend.backend_for(None, "cpu"),
            "fallback": tl.sync_fallback, "kinds": sorted({s.kind for s in tl.spans}),
            "warnings": [str(w.message) for w in caught
                         if issubclass(w.category, mc2.engine.transport.env.SyncFallbackWarning)],
            "out": out.detach()}


def autocast_bf16(rank: int, world: int) -> dict[str, Any]:
    """fused_expert under CPU bf16 autocast with float32 inputs and weights."""
    p = make_problem(world, "uneven", dtype=torch.float32, hidden=32, ffn=16, seed=2)
    x = p.xs[rank].clone().requires_grad_(True)
    ws = [w.clone().requires_grad_(True) for w in p.local_weights(rank)]
    rw = p.rws[rank].clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mc2.fused_expert(x, *ws, p.ids[rank], rw, micro_batches=3)
    out.float().backward(p.grad_outs[rank])
    return {"dtype": out.dtype, "out": out.detach().float(), "x": x.grad,
            "w_dtypes": [w.grad.dtype for w in ws], "rw": rw.grad}


def capacity_beside_dropless(rank: int, world: int, calls: int) -> dict[str, Any]:
    """Capacity calls and dropless calls, both ``"auto"``, on one planner (a model of both
    kinds of layer on one group): the reads of each capacity call once both shapes locked,
    over more calls than a drift window of the dropless shape."""
    from mc2.observation.host_syncs import HostSyncCounter

    p = make_problem(world, "uniform", tokens=24)
    args = (p.xs[rank], *p.local_weights(rank), p.ids[rank], p.rws[rank])
    planner = mc2.Planner(candidates=(1, 2), repeats=1, drift_window=4)
    reads = []
    for _ in range(calls):
        mc2.fused_expert(*args, micro_batches="auto", planner=planner)
        with HostSyncCounter() as counted:
            mc2.fused_expert(*args, micro_batches="auto", planner=planner, capacity=48)
        if planner.settled():
            reads.append(counted.reads)
    return {"reads": reads, "settled": planner.settled()}
