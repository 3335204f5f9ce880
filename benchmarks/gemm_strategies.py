#!/usr/bin/env python
"""Expert GEMMs: ``torch.nn.functional.grouped_mm`` vs one ``torch.mm`` per expert.

Times the SwiGLU expert forward+backward (the math ``fused_expert`` runs per micro-batch) on
this machine, single process, for both strategies, so ``gemm="auto"`` rests on a measurement.

    python benchmarks/gemm_strategies.py --rows 8192 --hidden 1024 --ffn 2048 --experts 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mc2.experts import swiglu_backward, swiglu_forward
from mc2.launch import steady_allocator


def time_strategy(strategy: str, dtype: torch.dtype, args: argparse.Namespace) -> float:
    g = torch.Generator().manual_seed(0)
    counts = torch.multinomial(torch.ones(args.experts), args.rows, replacement=True,
                               generator=g).bincount(minlength=args.experts).tolist()
    x = torch.randn(args.rows, args.hidden, generator=g).to(dtype)
    ws = [(torch.randn(args.experts, args.hidden, args.ffn, generator=g) * 0.03).to(dtype),
          (torch.randn(args.experts, args.hidden, args.ffn, generator=g) * 0.03).to(dtype),
          (torch.randn(args.experts, args.ffn, args.hidden, generator=g) * 0.02).to(dtype)]
    grads = tuple(torch.zeros_like(w) for w in ws)
    times = []
    for rep in range(args.repeats + 1):
        start = time.perf_counter()
        y, saved = swiglu_forward(x, counts, *ws, strategy=strategy, keep_activations=True)
        swiglu_backward(y, saved, counts, *ws, grads, strategy=strategy)
        if rep:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    steady_allocator()
    print(f"{args.rows} rows, hidden {args.hidden}, ffn {args.ffn}, {args.experts} experts, "
          f"{args.threads} thread(s): SwiGLU forward+backward, median of {args.repeats}")
    for dtype in (torch.float32, torch.bfloat16):
        loop = time_strategy("loop", dtype, args)
        grouped = time_strategy("grouped", dtype, args)
        print(f"{str(dtype)[6:]:>9}: loop {loop * 1e3:8.1f} ms   grouped_mm {grouped * 1e3:8.1f} ms"
              f"   grouped/loop {grouped / loop:.2f}")


if __name__ == "__main__":
    main()
