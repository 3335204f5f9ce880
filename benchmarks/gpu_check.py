#!/usr/bin/env python
"""One-shot accelerator check: the device-agnostic path of ``fused_expert`` on a CUDA GPU.

1. correctness on the GPU (one rank: no collectives) against a float64 CPU dense reference,
   float32 and bfloat16, both GEMM strategies, forward and all gradients;
2. the expert GEMM strategies timed with CUDA events (``grouped_mm`` vs one GEMM per expert),
   the measurement behind ``gemm="auto"`` choosing ``grouped`` on accelerators.

    PYTHONPATH=src:. python benchmarks/gpu_check.py
"""

from __future__ import annotations

import statistics
import sys

import torch
from tests.problems import make_problem
from tests.reference import dense_moe

import mc2


def check_correctness(device: str) -> bool:
    ok = True
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        p = make_problem(1, "uneven", local_experts=8, tokens=300, hidden=128, ffn=256,
                         dtype=torch.float64, seed=3)
        x64, ids, rw64 = p.xs[0], p.ids[0], p.rws[0]
        ws64 = [w.requires_grad_(True) for w in p.local_weights(0)]
        xr, rwr = x64.clone().requires_grad_(True), rw64.clone().requires_grad_(True)
        ref = dense_moe(xr, *ws64, ids, rwr)
        ref.backward(p.grad_outs[0])
        want = [ref.detach(), xr.grad, rwr.grad] + [w.grad for w in ws64]
        for gemm in ("loop", "grouped"):
            for k in (1, 4):
                x = x64.to(device, dtype).requires_grad_(True)
                rw = rw64.to(device, dtype).requires_grad_(True)
                ws = [w.detach().to(device, dtype).requires_grad_(True) for w in ws64]
                out = mc2.fused_expert(x, *ws, ids.to(device), rw, micro_batches=k, gemm=gemm)
                out.backward(p.grad_outs[0].to(device, dtype))
                got = [out, x.grad, rw.grad] + [w.grad for w in ws]
                errs = [((g.double().cpu() - w).abs().max() / w.abs().max().clamp_min(1e-3)).item()
                        for g, w in zip(got, want)]
                good = max(errs) <= tol
                ok &= good
                print(f"  {str(dtype)[6:]:>8} gemm={gemm:<7} K={k}: max rel err {max(errs):.2e}"
                      f" {'ok' if good else 'FAIL'}", flush=True)
    return ok


def time_gemms(device: str) -> None:
    """Layout (packed gate_up vs split) x strategy (loop vs grouped_mm), bf16, CUDA events."""
    import argparse

    from benchmarks.gemm_strategies import make, step

    from mc2.engine.workspace import Workspace

    args = argparse.Namespace(rows=32768, hidden=4096, ffn=14336 // 4, experts=8)
    flops = 2 * args.rows * args.hidden * args.ffn * 9  # 3 forward GEMMs + 6 backward
    ws = Workspace()
    for layout in ("packed", "split"):
        problem = make(layout, torch.bfloat16, args, device)
        for strategy in ("loop", "grouped"):
            times = []
            for rep in range(6):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                step(*problem, strategy, ws)
                end.record()
                torch.cuda.synchronize()
                if rep:
                    times.append(start.elapsed_time(end) / 1e3)
            t = statistics.median(times)
            print(f"  {layout:<6} {strategy:<8} {args.rows} rows, hidden {args.hidden}, ffn "
                  f"{args.ffn}, {args.experts} experts, bf16 fwd+bwd: {t * 1e3:.2f} ms, "
                  f"{flops / t / 1e12:.0f} TFLOP/s", flush=True)


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("correctness (one rank, GPU vs float64 CPU dense reference):")
    ok = check_correctness("cuda")
    print("expert GEMM strategies:")
    time_gemms("cuda")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
