#!/usr/bin/env python
"""The accelerator check: what one GPU can show of mc2's device path, in one short run.

NCCL refuses two ranks on one GPU, so the multi-rank NCCL path cannot run on one device. What
one device can show, this script runs, in under five minutes:

(a) **correctness with device tensors**: 2 and 4 Gloo ranks sharing the GPU (Gloo stages CUDA
    tensors through the host), ``fused_expert`` forward and backward against a float64 dense
    reference, flat and 2-D (4 ranks as 2 nodes of 2), float32 and bf16, each wire format;
(b) **no hidden host synchronisation**: an NCCL world of one with the distributed path forced
    (``MC2_DEBUG_FORCE_COLLECTIVES=1``: handshake, counts exchange and All-to-Alls to itself),
    under ``torch.cuda.set_sync_debug_mode("error")``: any synchronisation but mc2's two
    whitelisted reads raises; the reads and uploads are counted as well, and a timeline taken
    with device events must show transfers of non-zero length;
(c) **a hardware preset for** ``mc2 simulate``: bf16 expert GEMMs and ``grouped_mm`` timed with
    device events at the simulator's model shapes, and the device's copy bandwidth;
(d) **a capacity call in a CUDA graph**: ``MC2Config(capacity=N)`` with the default deadline
    (each wait's group's own timeout: the watchdog watches the eager calls) in an NCCL world of
    one with the distributed path forced, captured with ``torch.cuda.graph`` (``"global"``
    capture mode: a poll from any thread would fail it), replayed on three new inputs and
    compared with eager calls; inside the capture mc2 must watch, poll, fork an observer and
    read a host clock not once (counted).

(e) **``mc2.forward_backward`` on the device**: in an NCCL world of one with the distributed
    path forced, a stack of three ``mc2.MoELayer`` (float32), 4 micro-batches, run under a
    side stream made current (the partner thread must carry it over: a forward enqueued on
    another stream would race the backward beside it), each layer plain and under a
    reentrant checkpoint (whose recompute runs in autograd's device thread, where the
    pairing must still be found): the gradients of the paired step against the sequential
    loop's, and how often a backward gave way to the paired forward.

``--dry-run`` runs the same five parts on CPU in seconds (Gloo worlds with CPU tensors, a Gloo
world of one with the host-sync counter instead of CUDA's sync debug mode, tiny GEMMs; for (d)
the capture is emulated: mc2 is told the stream captures, and the call runs eagerly), so CI
keeps the script working without a GPU.

    PYTHONPATH=src:. python benchmarks/device_check.py               # on a GPU machine
    PYTHONPATH=src:. python benchmarks/device_check.py --dry-run     # anywhere
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

import mc2
from tests.problems import make_problem
from tests.reference import dense_moe

FP8 = torch.float8_e4m3fn
# a format's rounding relative to its block maximum, times the gain of a SwiGLU pass (as the
# wire tests): bounds that a wrong route (an O(1) error) cannot meet
WIRE_BOUND = {None: 0.0, torch.bfloat16: 6 * 2 ** -8, FP8: 2 * 2 ** -4, "int8": 24 * 2 ** -8}
DTYPE_BOUND = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class Case:
    world: int
    hierarchy: str
    k: int
    dtype: torch.dtype
    wire: Any

    @property
    def name(self) -> str:
        wire = "none" if self.wire is None else str(self.wire).replace("torch.", "")
        return (f"{self.world} ranks {self.hierarchy:<4} K={self.k} {str(self.dtype)[6:]:<8} "
                f"wire {wire}")

    @property
    def bound(self) -> float:
        return DTYPE_BOUND[self.dtype] + WIRE_BOUND[self.wire]


def cases(world: int, dry_run: bool) -> list[Case]:
    hierarchy = "2d" if world == 4 else "flat"
    if dry_run:
        return [Case(world, hierarchy, 3, torch.float32, w) for w in (None, FP8)]
    out = [Case(world, hierarchy, k, d, None) for k in (1, 3) for d in DTYPE_BOUND]
    out += [Case(world, hierarchy, 3, torch.bfloat16, w) for w in (torch.bfloat16, FP8, "int8")]
    return out


def _problem(world: int):
    return make_problem(world, "uneven", hidden=64, ffn=32, tokens=48, seed=7)


def correctness_rank(rank: int, world: int, dry_run: bool, device: str) -> list[dict]:
    """(a) on each rank: every case's output and input gradient, back on the host."""
    p = _problem(world)
    results = []
    for case in cases(world, dry_run):
        x = p.xs[rank].to(device, case.dtype).requires_grad_(True)
        ws = [w.to(device, case.dtype).requires_grad_(True) for w in p.local_weights(rank)]
        out = mc2.fused_expert(x, *ws, p.ids[rank].to(device), p.rws[rank].to(device, case.dtype),
                               micro_batches=case.k, hierarchy=case.hierarchy,
                               wire_dtype=case.wire, wire_block=16)
        out.backward(p.grad_outs[rank].to(device, case.dtype))
        results.append({"out": out.detach().double().cpu(), "x": x.grad.double().cpu(),
                        "device": str(out.device)})
    return results


def check_correctness(dry_run: bool, device: str) -> bool:
    ok = True
    for world in (2, 4):
        p = _problem(world)
        xs = [x.clone().requires_grad_(True) for x in p.xs]
        want = dense_moe(torch.cat(xs), p.w_up, p.w_gate, p.w_down, torch.cat(p.ids),
                         torch.cat(p.rws))
        want.backward(torch.cat(p.grad_outs))
        want_out, want_x = want.detach(), torch.cat([x.grad for x in xs])
        start = time.perf_counter()
        per_rank = mc2.run_local(correctness_rank, world, args=(dry_run, device),
                                 device=None if device == "cpu" else device,
                                 ranks_per_node=2 if world == 4 else None, deadline_s=240)
        for i, case in enumerate(cases(world, dry_run)):
            got_out = torch.cat([r[i]["out"] for r in per_rank])
            got_x = torch.cat([r[i]["x"] for r in per_rank])
            err = max(((got_out - want_out).abs().max() / want_out.abs().max()).item(),
                      ((got_x - want_x).abs().max() / want_x.abs().max()).item())
            good = err <= case.bound
            ok &= good
            print(f"  {case.name}: max rel err {err:.2e} (bound {case.bound:.1e}) on "
                  f"{per_rank[0][i]['device']} {'ok' if good else 'FAIL'}", flush=True)
        print(f"  ({world} ranks: {time.perf_counter() - start:.1f} s)", flush=True)
    return ok


def sync_rank(rank: int, world: int, dry_run: bool, device: str) -> dict[str, Any]:
    """(b) in a world of one with the distributed path forced."""
    from mc2.observation.host_syncs import HostSyncCounter

    p = make_problem(1, "uneven", hidden=64, ffn=32, tokens=200, local_experts=4, seed=3)
    dtype = torch.float32 if dry_run else torch.bfloat16
    x = p.xs[0].to(device, dtype)
    ws = [w.to(device, dtype).requires_grad_(True) for w in p.local_weights(0)]
    ids, rw, grad = p.ids[0].to(device), p.rws[0].to(device, dtype), p.grad_outs[0].to(device, dtype)

    def step(**options: Any) -> Any:
        xg = x.detach().requires_grad_(True)
        out = mc2.fused_expert(xg, *ws, ids, rw, micro_batches=4, **options)
        out.backward(grad)
        return out

    step(wire_dtype=FP8, wire_block=16)  # warm-up: first-use allocations, fp8 tables
    step()
    on_cuda = torch.device(device).type == "cuda"
    report: dict[str, Any] = {}
    for name, options in (("plain", {}), ("fp8 wire", {"wire_dtype": FP8, "wire_block": 16})):
        if on_cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            with HostSyncCounter() as syncs:
                step(**options)
            report[name] = {"reads": syncs.reads, "uploads": syncs.uploads, "error": None}
        except RuntimeError as exc:
            report[name] = {"reads": -1, "uploads": -1, "error": str(exc).splitlines()[0]}
        finally:
            if on_cuda:
                torch.cuda.set_sync_debug_mode(0)
    tl = mc2.Timeline()
    xg = x.detach().requires_grad_(True)
    mc2.fused_expert(xg, *ws, ids, rw, micro_batches=4, timeline=tl).backward(grad)
    transfers = [s.duration for s in tl.spans if s.kind == "transfer"]
    report["transfers"] = len(transfers)
    report["transfer_ms"] = 1e3 * statistics.median(transfers) if transfers else 0.0
    report["clock"] = type(tl.clock).__name__
    report["backend"] = mc2.engine.transport.backend.backend_for(None, device)
    report["stream"] = mc2.engine.transport.backend.comm_style(None, device).stream
    return report


def _world_of_one(fn: Any, dry_run: bool, device: str) -> tuple[str, dict[str, Any]]:
    """``(backend, fn's result)`` in a world of one with the distributed path forced: NCCL on
    the device, Gloo in a dry run."""
    backend = "gloo" if dry_run else "nccl"
    return backend, mc2.run_local(fn, 1, args=(dry_run, device), backend=backend,
                                  device=None if device == "cpu" else device, deadline_s=120,
                                  rank_env=lambda _: {"MC2_DEBUG_FORCE_COLLECTIVES": "1"})[0]


def check_syncs(dry_run: bool, device: str) -> bool:
    backend, r = _world_of_one(sync_rank, dry_run, device)
    ok = True
    for name in ("plain", "fp8 wire"):
        c = r[name]
        good = c["error"] is None and 0 <= c["reads"] <= 2 and 0 <= c["uploads"] <= 1
        ok &= good
        mode = "sync debug mode 'error'" if not dry_run else "host-sync counter"
        print(f"  {backend} world of one, K=4, {name}, under {mode}: {c['reads']} reads, "
              f"{c['uploads']} uploads per forward+backward"
              + (f"; raised: {c['error']}" if c["error"] else "") + (" ok" if good else " FAIL"),
              flush=True)
    print(f"  backend {r['backend']} (stream-ordered waits: {r['stream']}); timeline clock "
          f"{r['clock']}: {r['transfers']} transfers, median {r['transfer_ms']:.3f} ms", flush=True)
    if r["transfers"] == 0 or (not dry_run and r["transfer_ms"] <= 0):
        ok = False
        print("  FAIL: transfers were not timed", flush=True)
    return ok


def graph_rank(rank: int, world: int, dry_run: bool, device: str) -> dict[str, Any]:
    """(d) a capacity call with the default deadline captured in a CUDA graph (world of one,
    distributed path forced), replayed on new data and compared with eager calls; on CPU the
    capture is emulated (mc2 told the stream captures; the call runs eagerly). Counts what mc2
    did inside the capture (:class:`tests.workers_deadlines.CaptureProbe`)."""
    from mc2.device import streams
    from mc2.engine.transport.watchdog import watchdog
    from tests.workers_deadlines import CaptureProbe

    probe = CaptureProbe()
    p = make_problem(1, "uneven", hidden=64, ffn=32, tokens=32, local_experts=4, seed=4)
    dtype = torch.float32
    x = p.xs[0].to(device, dtype).clone()
    ids, rw = p.ids[0].to(device).clone(), p.rws[0].to(device, dtype).clone()
    ws = [w.to(device, dtype) for w in p.local_weights(0)]
    config = mc2.MC2Config(micro_batches=2, capacity=64)  # the default deadline

    def call() -> torch.Tensor:
        return mc2.fused_expert(x, *ws, ids, rw, config=config)

    report: dict[str, Any] = {"captured": False, "replays": 0, "max_diff": 0.0, "error": None,
                              "in_capture": {}, "eager_deadlines": 0}
    with torch.no_grad():
        try:
            if torch.device(device).type == "cuda":
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):  # warm-up outside the graph (allocations, groups)
                        _, counts = probe.measured(call)
                        report["eager_deadlines"] += counts["start_stamp"]
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                watchdog().wait_idle(30.0)  # nothing of the warm-up left for it to poll
                graph = torch.cuda.CUDAGraph()

                def capture() -> torch.Tensor:
                    with torch.cuda.graph(graph):
                        return call()

                static_out, report["in_capture"] = probe.measured(capture)
                report["captured"] = True
                replay = graph.replay
            else:
                _, counts = probe.measured(call)
                report["eager_deadlines"] = counts["start_stamp"]
                real = streams.capturing
                streams.capturing = lambda device: True  # a capture, as mc2 sees one
                try:
                    static_out, report["in_capture"] = probe.measured(call)
                finally:
                    streams.capturing = real
                replay = lambda: static_out.copy_(call())  # noqa: E731
            g = torch.Generator().manual_seed(7)
            for _ in range(3):
                x.copy_(torch.randn(x.shape, generator=g).to(device, dtype))
                ids.copy_(torch.randperm(p.w_up.shape[0], generator=g)[:ids.shape[1]]
                          .repeat(ids.shape[0], 1).to(device))
                replay()
                eager = call()
                diff = (static_out - eager).abs().max().item()
                report["max_diff"] = max(report["max_diff"], diff)
                report["replays"] += 1
        except RuntimeError as exc:
            report["error"] = str(exc).splitlines()[0]
    return report


def check_graph(dry_run: bool, device: str) -> bool:
    backend, r = _world_of_one(graph_rank, dry_run, device)
    c = r["in_capture"]
    inside = (c.get("watch", -1), c.get("is_completed", -1) + c.get("query", 0),
              c.get("observe", -1), c.get("clock", -1))
    good = r["error"] is None and r["replays"] == 3 and r["max_diff"] <= 1e-5 and \
        (dry_run or r["captured"]) and inside == (0, 0, 0, 0) and \
        c.get("start_stamp", -1) == 0 and r["eager_deadlines"] > 0
    what = "captured in a CUDA graph, replayed" if r["captured"] else \
        "capture emulated on CPU, eager"
    print(f"  {backend} world of one, capacity call K=2, default deadline "
          f"({r['eager_deadlines']} waits under it eagerly), {what} on 3 new inputs: max diff "
          f"{r['max_diff']:.2e} against eager; in the capture: {inside[0]} watched, "
          f"{inside[1]} polls, {inside[2]} observer forks, {inside[3]} host clocks"
          + (f"; raised: {r['error']}" if r["error"] else "") + (" ok" if good else " FAIL"),
          flush=True)
    return good


def pairing_rank(rank: int, world: int, dry_run: bool, device: str) -> dict[str, Any]:
    """(e) the paired step against the sequential loop on the device, under a side stream
    (world of one, distributed path forced), with each layer plain and under a reentrant
    checkpoint (its recompute runs in autograd's device thread on a GPU): per variant the
    worst gradient difference and how often a backward gave way to the paired forward."""
    from torch.utils.checkpoint import checkpoint

    from mc2.engine.autograd import pairing

    gave_way = []
    real_give_way = pairing.Pairing.give_way

    def counted(self: Any) -> None:
        if self.partner is not None and not self.partner.running_here():
            gave_way.append(1)
        real_give_way(self)

    class Checkpointed(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.inner, x, use_reentrant=True)

    def stack(recompute: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        layers = [mc2.MoELayer(64, 96, 4, topk=2, dtype=torch.float32) for _ in range(3)]
        return torch.nn.Sequential(*(Checkpointed(m) if recompute else m
                                     for m in layers)).to(device)

    def loss_fn(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).mean()

    g = torch.Generator().manual_seed(11)
    batches = [torch.randn(2, 64, 64, generator=g).to(device).requires_grad_(True)
               for _ in range(4)]
    side = torch.cuda.Stream() if device != "cpu" else None
    report: dict[str, Any] = {}
    for name, recompute in (("plain", False), ("reentrant checkpoint", True)):
        found: dict[str, Any] = {"error": None, "worst": float("inf"), "gave_way": 0}
        gave_way.clear()
        try:
            with torch.cuda.stream(side):  # no-op where side is None (CPU)
                loop = stack(recompute)
                for x in batches:
                    loss_fn(loop, x).backward()
                paired = stack(recompute)
                pairing.Pairing.give_way = counted
                try:
                    mc2.forward_backward(paired, batches, loss_fn, overlap=True)
                finally:
                    pairing.Pairing.give_way = real_give_way
            if side is not None:
                torch.cuda.synchronize()
            found["worst"] = max(float((a.grad - b.grad).abs().max() / b.grad.abs().max())
                                 for a, b in zip(paired.parameters(), loop.parameters()))
            found["gave_way"] = len(gave_way)
        except RuntimeError as exc:
            found["error"] = str(exc).splitlines()[0]
        report[name] = found
    return report


def check_pairing(dry_run: bool, device: str) -> bool:
    backend, r = _world_of_one(pairing_rank, dry_run, device)
    ok = True
    for name, c in r.items():
        good = c["error"] is None and c["worst"] <= 1e-4 and c["gave_way"] > 0
        ok &= good
        print(f"  {backend} world of one, 3 MoELayers ({name}), 4 micro-batches, under a side "
              f"stream: gradients within {c['worst']:.1e} of the sequential loop's (bound 1e-4 "
              f"of each tensor's scale), the backward gave way {c['gave_way']} times"
              + (f"; raised: {c['error']}" if c["error"] else "") + (" ok" if good else " FAIL"),
              flush=True)
    return ok


def _time(fn: Any, device: str, repeats: int = 5) -> float:
    from mc2.device.clock import clock_for

    clock = clock_for(device)
    fn()
    return statistics.median(clock.time(fn) for _ in range(repeats))


def time_gemms(dry_run: bool, device: str) -> dict[str, float]:
    """(c) expert GEMMs at the simulator's shapes: dense and grouped, TFLOP/s."""
    import torch.nn.functional as F

    from mc2.sim.presets import load_model

    names = ["mixtral-8x7b", "mixtral-8x22b", "deepseek-v3", "qwen3-30b-a3b"]
    dtype = torch.float32 if dry_run else torch.bfloat16
    rates: list[float] = []
    grouped_rates: list[float] = []
    for name in names:
        m = load_model(name)
        hidden, ffn, groups = (64, 128, 4) if dry_run else (m.hidden, m.ffn, 8)
        rows = 256 if dry_run else 8192
        a = torch.randn(rows, hidden, dtype=dtype, device=device)
        w = torch.randn(groups, hidden, ffn, dtype=dtype, device=device) * hidden ** -0.5
        offs = torch.arange(1, groups + 1, device=device, dtype=torch.int32) * (rows // groups)
        flops = 2 * rows * hidden * ffn
        dense = flops / _time(lambda a=a, w=w: a @ w[0], device)
        line = f"  {name:<14} [{rows} x {hidden}] x [{hidden} x {ffn}] {str(dtype)[6:]}: " \
               f"dense {dense / 1e12:7.2f} TFLOP/s"
        rates.append(dense)
        if hasattr(F, "grouped_mm") and (dtype != torch.float32 or device == "cpu"):
            try:
                grouped = flops / _time(lambda a=a, w=w, o=offs: F.grouped_mm(a, w, offs=o),
                                        device)
                grouped_rates.append(grouped)
                line += f", grouped_mm over {groups} experts {grouped / 1e12:7.2f} TFLOP/s"
            except RuntimeError as exc:
                line += f", grouped_mm unavailable ({str(exc).splitlines()[0][:60]})"
        print(line, flush=True)
    big = torch.empty(2 ** (20 if dry_run else 28), dtype=torch.uint8, device=device)
    other = torch.empty_like(big)
    copy_s = _time(lambda: other.copy_(big), device)
    return {"dense": statistics.median(rates),
            "grouped": statistics.median(grouped_rates) if grouped_rates else 0.0,
            "memory_gbps": 2 * big.numel() / copy_s / 1e9}


def preset(measured: dict[str, float], device: str) -> str:
    """A hardware TOML for ``mc2 simulate --hardware FILE``: compute from this device's
    measurements; the links cannot be measured on one device and come from dgx-h100."""
    from mc2.sim.presets import load_hardware

    name = torch.cuda.get_device_name() if device.startswith("cuda") else "this CPU"
    ref = load_hardware("dgx-h100")
    return "\n".join([
        f"# measured by benchmarks/device_check.py on {name}",
        'name = "measured"',
        f'description = "{name}: compute measured here; links from dgx-h100 (not measurable '
        'on one device)"',
        f"devices_per_node = {ref.devices_per_node}",
        "",
        "[compute]",
        "# median achieved TFLOP/s of the models' expert GEMMs (efficiency folded in)",
        # significant digits, not decimals: a loaded 2-core CPU measures under 0.05 TFLOP/s
        f"peak_tflops = {measured['dense'] / 1e12:.4g}",
        "gemm_efficiency = 1.0",
        f"memory_gbps = {measured['memory_gbps']:.4g}",
        "",
        "[intra_node]",
        f"bandwidth_gbps = {ref.intra_node.bandwidth_gbps}",
        f"latency_us = {ref.intra_node.latency_us}",
        "async = true",
        "",
        "[inter_node]",
        f"bandwidth_gbps = {ref.inter_node.bandwidth_gbps}",
        f"latency_us = {ref.inter_node.latency_us}",
        "async = true",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="run every part on CPU, in seconds (what CI runs)")
    parser.add_argument("--preset", type=str, default=None,
                        help="also write the measured hardware preset to this .toml file")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("device_check: no CUDA device here; run with --dry-run to check the script",
              file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    started = time.perf_counter()
    where = "CPU (dry run)" if args.dry_run else torch.cuda.get_device_name()
    print(f"mc2 device check on {where}, torch {torch.__version__}", flush=True)
    print("(a) Gloo ranks sharing the device vs a float64 dense reference:", flush=True)
    ok = check_correctness(args.dry_run, device)
    print("(b) host synchronisations of the distributed path:", flush=True)
    ok &= check_syncs(args.dry_run, device)
    print("(d) a capacity call (MC2Config(capacity=N)) in a CUDA graph:", flush=True)
    ok &= check_graph(args.dry_run, device)
    print("(e) mc2.forward_backward, each forward beside the previous backward:", flush=True)
    ok &= check_pairing(args.dry_run, device)
    print("(c) expert GEMMs at the simulator's shapes:", flush=True)
    measured = time_gemms(args.dry_run, device)
    text = preset(measured, device)
    print(text)
    if args.preset:
        with open(args.preset, "w") as f:
            f.write(text + "\n")
        print(f"wrote {args.preset}")
    print(f"{'all checks passed' if ok else 'SOME CHECKS FAILED'} in "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
