#!/usr/bin/env python
"""Time one forward+backward of the article's split-layout ``mc2.fused_expert`` call.

Written against the call signature every mc2 version has, so the same script compares
versions: run it with ``PYTHONPATH`` pointing at another checkout's ``src`` (for example a
``git worktree`` of an older commit) and at this one, interleaved. Two local Gloo ranks, one
thread each, plain processes; prints the slowest rank's median step in seconds.

    PYTHONPATH=src python benchmarks/time_split_call.py --tokens 64 --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import mc2


def worker(rank: int, world: int, tokens: int, k: int, repeats: int) -> float:
    g = torch.Generator().manual_seed(rank)
    hidden, ffn, local = 1024, 2048, 4
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.randint(0, world * local, (tokens, 2), generator=g)
    rw = torch.rand(tokens, 2, generator=g)
    ws = [(torch.randn(local, hidden, ffn, generator=g) * 0.03).requires_grad_(),
          (torch.randn(local, hidden, ffn, generator=g) * 0.03).requires_grad_(),
          (torch.randn(local, ffn, hidden, generator=g) * 0.02).requires_grad_()]
    dy = torch.randn(tokens, hidden, generator=g)

    def step() -> float:
        for w in ws:
            w.grad = None
        xg = x.clone().requires_grad_()
        dist.barrier()
        start = time.perf_counter()
        mc2.fused_expert(xg, *ws, ids, rw, micro_batches=k).backward(dy)
        return time.perf_counter() - start

    for _ in range(2):
        step()
    times = torch.tensor([step() for _ in range(repeats)], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return statistics.median(times.tolist())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--micro-batches", type=int, default=1, help="K")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    # older versions tuned malloc by default; ask for a plain process where the knob exists
    kw = {"steady_memory": False} if "steady_memory" in mc2.run_local.__code__.co_varnames else {}
    print(mc2.run_local(worker, 2, args=(a.tokens, a.micro_batches, a.repeats), **kw)[0])


if __name__ == "__main__":
    main()
