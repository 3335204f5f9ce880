#!/usr/bin/env python
"""mc2 on exactly the peers' work (``peers.py`` in ``MC2_PEERS_DIR``); one JSON line on stdout.

Weights, inputs and output gradient come from the peers' own ``make_weights`` and
``make_inputs``; the router is ``x @ router.T``, top-k, softmax over the k logits (like theirs,
differentiable); the experts are packed like theirs (``[W_gate; W_up]`` as ``[2F, H]``,
``W_down [H, F]``) and run by :func:`mc2.fused_expert_packed`. Two local Gloo ranks, one
thread each, plain processes. Protocol as ``peers.py``: a barrier before each step, the slowest
rank's time per step, median over ``--steps`` after 2 warm-ups. Several mc2 modes are timed in
one process, one block after the other, each with its own workspace. ``auto`` goes first: it
runs until its trials have locked a K (those calls are counted and reported), then 2 warm-ups
and its steps; the peak resident memory is read right after its block (``rss_auto_mib``), so it
is that of ``auto`` alone.

    python benchmarks/peer_work_mc2.py --tokens 4096 --steps 5 --modes auto,serial,K=4
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

import mc2
from mc2.engine.transport.wire import parse_wire_dtype

E, TOPK, H, FFN, WARMUP = 8, 2, 1024, 2048, 2


def _options(mode: str) -> dict:
    """``auto``, ``serial``, ``K=<n>``, each optionally ``@<wire format>`` (``auto@fp8``)."""
    if "@" in mode:
        base, wire = mode.split("@", 1)
        return {**_options(base), "wire_dtype": parse_wire_dtype(wire)}
    if mode == "auto":
        return {"micro_batches": "auto", "overlap": True}
    if mode == "serial":
        return {"micro_batches": 1, "overlap": False}
    if mode.startswith("K="):
        return {"micro_batches": int(mode[2:]), "overlap": True}
    raise ValueError(f"unknown mode {mode!r}: auto, serial or K=<n>, optionally @bf16/@fp8/...")


def worker(rank: int, world: int, a: argparse.Namespace) -> dict:
    sys.path.insert(0, a.peers_dir)
    from peers import make_inputs, make_weights

    local = E // world
    mine = range(rank * local, (rank + 1) * local)
    router_w, experts = make_weights(E, H, FFN, a.seed, mine)
    router = torch.nn.Parameter(router_w)
    gate_up = torch.nn.Parameter(torch.stack([torch.cat([experts[e][0], experts[e][1]])
                                              for e in mine]))
    down = torch.nn.Parameter(torch.stack([experts[e][2] for e in mine]))
    params = [router, gate_up, down]
    x, dy = make_inputs(a.tokens, H, rank, a.seed)
    x.requires_grad_(True)
    planner = mc2.Planner()

    def step(mode: str, timeline: mc2.Timeline | None = None, *,
             workspace: mc2.Workspace) -> tuple[float, torch.Tensor]:
        for p in params:
            p.grad = None
        x.grad = None
        dist.barrier()
        start = time.perf_counter()
        vals, idx = (x @ router.t()).topk(TOPK, dim=-1)
        y = mc2.fused_expert_packed(x, gate_up, down, idx, vals.softmax(dim=-1), planner=planner,
                                    timeline=timeline, workspace=workspace, **_options(mode))
        y.backward(dy)
        return time.perf_counter() - start, y.detach()

    modes = a.modes.split(",")
    modes = [m for m in modes if m.startswith("auto")] + \
        [m for m in modes if not m.startswith("auto")]
    explore_calls = 0
    locked: dict[str, dict] = {}
    times: dict[str, list[float]] = {m: [] for m in modes}
    compute: list[float] = []
    outputs: dict[str, torch.Tensor] = {}
    rss_auto = 0.0
    workspaces: dict[str, mc2.Workspace] = {}

    def settle(mode: str) -> None:
        """Let "auto" lock its K for this mode (its trials), then warm up."""
        nonlocal explore_calls
        workspace = workspaces.setdefault(mode, mc2.Workspace())
        if mode.startswith("auto"):
            known = set(planner.decisions())
            calls = 0
            while calls == 0 or (calls <= planner.most_trial_calls() and not planner.settled()):
                step(mode, workspace=workspace)
                calls += 1
            explore_calls += calls
            mine = [d for key, d in planner.decisions().items() if key not in known]
            if mine:
                locked[mode] = mine[0]
        for _ in range(WARMUP):
            step(mode, workspace=workspace)

    def timed(mode: str) -> None:
        tl = mc2.Timeline() if mode == "serial" else None
        seconds, outputs[mode] = step(mode, tl, workspace=workspaces[mode])
        times[mode].append(seconds)
        if tl is not None:
            compute.append(seconds - tl.exposed_comm)

    if a.interleave:  # every mode settled first, then the steps take turns
        for mode in modes:
            settle(mode)
        for _ in range(a.steps):
            for mode in modes:
                timed(mode)
    else:  # one block per mode; auto's peak memory is read right after its block
        for mode in modes:
            settle(mode)
            for _ in range(a.steps):
                timed(mode)
            if mode == "auto":
                rss_auto = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            del workspaces[mode]
    flat = torch.tensor([t for m in modes for t in times[m]] + compute + [rss_auto],
                        dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)  # the slowest rank, step by step
    slowest = flat.tolist()
    ref = outputs.get("serial", outputs[modes[0]])
    diff = max((o - ref).abs().max().item() for o in outputs.values())
    decisions = list(planner.decisions().values())
    result = {"modes": {}, "explore_calls": explore_calls, "max_abs_diff": diff,
              "rss_auto_mib": slowest[-1],
              "tried": decisions[0]["tried"] if decisions else None}
    for i, mode in enumerate(modes):
        mine_t = slowest[i * a.steps:(i + 1) * a.steps]
        decision = locked.get(mode)
        k = decision["locked"] if decision else _options(mode)["micro_batches"]
        result["modes"][mode] = {"median_s": statistics.median(mine_t), "min_s": min(mine_t),
                                 "k": k, "plain_rows": bool(decision and decision["plain_rows"]),
                                 "max_abs_diff": (outputs[mode] - ref).abs().max().item()}
    if compute:
        result["t_comp_s"] = statistics.median(slowest[len(modes) * a.steps:-1])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode (after warm-ups)")
    p.add_argument("--modes", default="auto,serial", help="auto, serial, K=<n>, comma-separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--interleave", action="store_true",
                   help="settle every mode first, then let their steps take turns (so slow "
                        "spells of a shared machine hit every mode alike); no peak-memory figure")
    p.add_argument("--peers-dir", required=True, help="the folder holding peers.py")
    a = p.parse_args()
    for mode in a.modes.split(","):
        _options(mode)
    results = mc2.run_local(worker, 2, args=(a,), timeout_s=900, deadline_s=3600)
    print(json.dumps(results[0]), flush=True)


if __name__ == "__main__":
    main()
