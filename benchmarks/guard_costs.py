#!/usr/bin/env python
"""What the guards cost when nothing goes wrong: deadlines on every wait, ``check_finite``.

2 local Gloo ranks, one thread each, forward + backward of ``fused_expert_packed`` (``--tokens``
per rank, hidden 1024, ffn 2048, 8 experts, top-2, K = 4 overlapped, and the serial K = 1).
Variants run interleaved, call after call, so machine noise hits them alike: no deadline of
mc2's own (``timeout=0``: plain waits), the default deadline (``timeout=300``: every wait is
``Work.wait(timeout)``), and the deadline plus ``check_finite=True``. Reported: the median step
of the slowest rank and its ratio to the plain one.

    .venv/bin/python benchmarks/guard_costs.py --tokens 1024 --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

import mc2

VARIANTS = {"no deadline": {"timeout": 0}, "deadline": {"timeout": 300},
            "deadline + check_finite": {"timeout": 300, "check_finite": True}}


def rank_fn(rank: int, world: int, tokens: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    hidden, ffn, local = 1024, 2048, 8 // world
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.randint(0, 8, (tokens, 2), generator=g)
    rw = torch.rand(tokens, 2, generator=g)
    gate_up = (torch.randn(local, 2 * ffn, hidden, generator=g) * hidden ** -0.5).requires_grad_()
    down = (torch.randn(local, hidden, ffn, generator=g) * ffn ** -0.5).requires_grad_()
    dy = torch.randn(tokens, hidden, generator=g)
    times: dict[str, list[float]] = {}
    for k, overlap in ((4, True), (1, False)):
        for rep in range(repeats + 1):
            for name, options in VARIANTS.items():
                xx = x.clone().requires_grad_(True)
                dist.barrier()
                start = time.perf_counter()
                out = mc2.fused_expert_packed(xx, gate_up, down, ids, rw, micro_batches=k,
                                              overlap=overlap, **options)
                out.backward(dy)
                t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                gate_up.grad = down.grad = None
                if rep:  # the first round warms up
                    times.setdefault(f"K={k} {name}", []).append(t.item())
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    medians = mc2.run_local(rank_fn, 2, args=(args.tokens, args.repeats), deadline_s=3600)[0]
    print(f"2 ranks x {args.tokens} tokens, hidden 1024, ffn 2048, 8 experts, top-2; "
          f"median of {args.repeats}")
    for k in ("K=4", "K=1"):
        base = medians[f"{k} no deadline"]
        for name in VARIANTS:
            m = medians[f"{k} {name}"]
            print(f"{k} {name:24} {1e3 * m:8.1f} ms  {m / base:6.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
