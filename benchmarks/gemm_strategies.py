#!/usr/bin/env python
"""Expert GEMMs: weight layout (packed ``gate_up [L, 2F, H]`` vs split ``[L, H, F]`` x2) and
strategy (one ``torch.mm`` per expert vs ``torch.nn.functional.grouped_mm``).

Times the SwiGLU expert forward+backward (the math ``fused_expert`` runs per micro-batch) on
this machine, single process, in a plain process (no malloc tuning), so the layout
``MoELayer`` keeps and ``gemm="auto"`` rest on a measurement. Each configuration runs
interleaved with the others, median of ``--repeats``.

    python benchmarks/gemm_strategies.py --rows 8192 --hidden 1024 --ffn 2048 --experts 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mc2.engine.compute.experts import ExpertWeights, forward_and_backward
from mc2.engine.transport.workspace import Workspace


def make(layout: str, dtype: torch.dtype, args: argparse.Namespace, device: str = "cpu"):
    g = torch.Generator().manual_seed(0)
    counts = torch.multinomial(torch.ones(args.experts), args.rows, replacement=True,
                               generator=g).bincount(minlength=args.experts).tolist()
    x = torch.randn(args.rows, args.hidden, generator=g).to(device, dtype)
    up, gate = (torch.randn(args.experts, args.hidden, args.ffn, generator=g) * 0.03
                for _ in range(2))
    down = torch.randn(args.experts, args.ffn, args.hidden, generator=g) * 0.02
    if layout == "packed":
        weights = ExpertWeights.packed_of(
            torch.cat([gate.transpose(1, 2), up.transpose(1, 2)], 1).to(device, dtype),
            down.transpose(1, 2).contiguous().to(device, dtype))
    else:
        weights = ExpertWeights.split_of(up.to(device, dtype), gate.to(device, dtype),
                                         down.to(device, dtype))
    return x, counts, weights


def step(x, counts, weights, strategy: str, ws: Workspace) -> None:
    forward_and_backward(x, counts, weights, strategy=strategy, workspace=ws)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="comma-separated: float32, bfloat16")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    flops = 2 * 9 * args.rows * args.hidden * args.ffn
    print(f"{args.rows} rows, hidden {args.hidden}, ffn {args.ffn}, {args.experts} experts, "
          f"{args.threads} thread(s): SwiGLU forward+backward, median of {args.repeats}")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        configs = [(layout, strategy) for layout in ("packed", "split")
                   for strategy in ("loop", "grouped")]
        problems = {layout: make(layout, dtype, args) for layout in ("packed", "split")}
        ws = Workspace()
        times: dict[tuple[str, str], list[float]] = {c: [] for c in configs}
        for rep in range(args.repeats + 1):
            for layout, strategy in configs:
                start = time.perf_counter()
                step(*problems[layout], strategy, ws)
                if rep:
                    times[(layout, strategy)].append(time.perf_counter() - start)
        base = statistics.median(times[("split", "loop")])
        for c in configs:
            t = statistics.median(times[c])
            print(f"{name:>9} {c[0]:>6} {c[1]:>7}: {t * 1e3:8.1f} ms  {flops / t / 1e9:6.1f} GFLOP/s"
                  f"  split-loop/this {base / t:.3f}")


if __name__ == "__main__":
    main()
