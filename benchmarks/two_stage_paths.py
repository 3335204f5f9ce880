#!/usr/bin/env python
"""The 2-D exchange on Gloo: chained on a communication thread (what mc2 does on host backends)
against chained in the caller's thread (what it does on stream backends, where waits do not
block the host).

On a host backend a wait blocks its thread, so chaining the two stages in the caller's thread
makes the caller wait for the first stage of every dispatch and combine before it can compute;
the communication thread lets both stages travel under compute. This measures what that is
worth here, so the choice is measured rather than assumed: 4 local Gloo ranks presented as 2
nodes x 2, ``hierarchy="2d"``, forward + backward, both paths interleaved, median of rounds.

    .venv/bin/python benchmarks/two_stage_paths.py --tokens 1024 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import mc2


def as_stream_backend() -> None:
    """Before the group exists: treat Gloo as a stream backend (its 2-D exchange then chains
    in the caller's thread; its waits are plain ``wait()`` calls, which block on Gloo)."""
    from mc2.engine.transport.backend import register_stream_backend

    register_stream_backend("gloo")


def worker(rank: int, world: int, tokens: int, k: int, steps: int) -> float:
    g = torch.Generator().manual_seed(rank)
    hidden, ffn, local = 512, 1024, 2
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.randint(0, world * local, (tokens, 2), generator=g)
    rw = torch.rand(tokens, 2, generator=g)
    gate_up = (torch.randn(local, 2 * ffn, hidden, generator=g) * 0.03).requires_grad_()
    down = (torch.randn(local, hidden, ffn, generator=g) * 0.03).requires_grad_()
    dy = torch.randn(tokens, hidden, generator=g)
    config = mc2.MC2Config(micro_batches=k, hierarchy="2d")

    def step() -> float:
        xg = x.clone().requires_grad_()
        dist.barrier()
        start = time.perf_counter()
        mc2.fused_expert_packed(xg, gate_up, down, ids, rw, config=config).backward(dy)
        return time.perf_counter() - start

    for _ in range(2):
        step()
    times = torch.tensor([step() for _ in range(steps)], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return statistics.median(times.tolist())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    p.add_argument("--micro-batches", type=int, default=4, help="K")
    p.add_argument("--steps", type=int, default=5, help="timed steps per world")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of both paths")
    a = p.parse_args()
    paths = {"thread": None, "caller": as_stream_backend}
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(a.rounds):
        for name in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
            t = mc2.run_local(worker, 4, args=(a.tokens, a.micro_batches, a.steps),
                              ranks_per_node=2, before_init=paths[name])[0]
            seconds[name].append(t)
            print(f"round {r + 1}/{a.rounds} {name:<6} {t * 1e3:8.1f} ms", flush=True)
    med = {name: statistics.median(v) for name, v in seconds.items()}
    print(f"median: thread {med['thread'] * 1e3:.1f} ms, caller {med['caller'] * 1e3:.1f} ms; "
          f"caller / thread = {med['caller'] / med['thread']:.3f}")


if __name__ == "__main__":
    main()
