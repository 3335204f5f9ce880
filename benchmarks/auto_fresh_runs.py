#!/usr/bin/env python
"""Does every fresh run of ``micro_batches="auto"`` settle where the best fixed choice is?

``"auto"`` decides each shape from its trial calls, once per process: a run that locks a poor
plan keeps it for the whole job. So one run is not a measurement of ``"auto"``: this benchmark
starts many fresh worlds (fresh ranks: a fresh planner each), and in each one runs the trial
calls and a warm-up, then times the steady-state step (forward + backward, the group's slowest
rank, median of ``--steps``). Fixed choices (K, and with ``--wire`` the wire format) run the
same way in their own fresh worlds, interleaved with the ``"auto"`` runs in a rotating order, so
the machine's own drift and noise fall on every choice alike and are measured too: the spread of
a fixed K's runs is what the machine does with no decision to make.

For every ``"auto"`` run it reports the ratio to the best fixed choice (the median of that
choice's runs), and the target: within 5% in at least 9 of 10 runs, never more than 15% slower.
Beside it, the same ratio for the best fixed choice's own runs (the noise floor: what a run
that made no decision at all scores on this machine), and each ``"auto"`` run against the
best fixed choice's run of its own round (paired: the machine's slow minutes fall on both),
and the decision itself: the median of the fixed choice each ``"auto"`` run locked against the
best's (1.0: it locked the best plan, whatever its own world's noise).

    python benchmarks/auto_fresh_runs.py                        # plain loopback, 5 rounds
    python benchmarks/auto_fresh_runs.py --tokens 4096 --hidden 1024 --ffn 2048 --wire fp8
    sudo python benchmarks/auto_fresh_runs.py --rate 200mbit     # loopback shaped (removed after)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

import mc2
from compare_peers import ShapedLoopback, can_shape
from layer_rounds import add_shape_arguments, slowest_rank_seconds


def world_run(rank: int, world: int, choice: dict[str, Any], shape: dict[str, int],
              warmup: int, steps: int) -> dict[str, Any]:
    """One fresh world: ``warmup`` calls (``"auto"``'s trials among them), then ``steps``
    timed calls; the slowest rank's step times and the K ``"auto"`` locked."""
    g = torch.Generator().manual_seed(1 + rank)
    tokens, hidden, ffn, local, topk = (shape[k] for k in ("tokens", "hidden", "ffn", "local",
                                                           "topk"))
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.rand(tokens, world * local, generator=g).topk(topk, -1).indices
    rw = torch.softmax(torch.randn(tokens, topk, generator=g), -1)
    ws = [(torch.randn(local, hidden, ffn, generator=g) / hidden ** 0.5).requires_grad_(True),
          (torch.randn(local, hidden, ffn, generator=g) / hidden ** 0.5).requires_grad_(True),
          (torch.randn(local, ffn, hidden, generator=g) / ffn ** 0.5).requires_grad_(True)]
    planner = mc2.Planner()
    times = []
    for step in range(warmup + steps):
        xs = x.clone().requires_grad_(True)
        elapsed = slowest_rank_seconds(lambda xs=xs: mc2.fused_expert(
            xs, *ws, ids, rw, planner=planner, **choice).sum().backward())
        for w in ws:
            w.grad = None
        if step >= warmup:
            times.append(elapsed)
    decisions = list(planner.decisions().values())
    return {"median_s": statistics.median(times),
            "locked": decisions[0]["locked"] if decisions else None,
            "plain_rows": decisions[0]["plain_rows"] if decisions else None,
            "why": decisions[0]["why"] if decisions else None}


def locked_name(run: dict[str, Any]) -> str:
    """The fixed choice an ``"auto"`` run locked, named as the fixed runs are."""
    return f"K={run['locked']}{' plain' if run['plain_rows'] else ''}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(p, tokens=1024, hidden=512, ffn=1024)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--ks", default="1,2,4,8", help="fixed K to compare (default 1,2,4,8)")
    p.add_argument("--wire", default=None, help="a wire format for every choice (bf16, fp8)")
    p.add_argument("--rounds", type=int, default=5, help="fresh worlds per choice (default 5)")
    p.add_argument("--warmup", type=int, default=16,
                   help="calls before timing: auto's trials (at most 15) and a warm-up")
    p.add_argument("--steps", type=int, default=5, help="timed calls per world (default 5)")
    p.add_argument("--rate", default=None,
                   help="shape loopback to this rate with tc tbf for the run (root; removed "
                        "after), e.g. 200mbit")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    shape = {"tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn,
             "local": args.experts // args.world_size, "topk": args.topk}
    extra = {"wire_dtype": args.wire} if args.wire else {}
    choices = {"auto": {"micro_batches": "auto", **extra}}
    for k in (int(v) for v in args.ks.split(",")):
        choices[f"K={k}"] = {"micro_batches": k, **extra}
        if args.wire:
            choices[f"K={k} plain"] = {"micro_batches": k}
    if args.rate and (why := can_shape()) is not None:
        raise SystemExit(f"--rate {args.rate}: {why}")
    shaping = ShapedLoopback(args.rate, latency="400ms") if args.rate else \
        contextlib.nullcontext()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in choices}
    with shaping:
        names = list(choices)
        for r in range(args.rounds):
            for j in range(len(names)):
                name = names[(j + r) % len(names)]
                got = mc2.run_local(world_run, args.world_size,
                                    args=(choices[name], shape, args.warmup, args.steps))[0]
                runs[name].append(got)
                print(f"round {r + 1}/{args.rounds} {name:>10}: {got['median_s'] * 1e3:8.1f} ms"
                      + (f"  locked K={got['locked']}{' plain' if got['plain_rows'] else ''}"
                         if name == "auto" else ""), file=sys.stderr, flush=True)
    fixed = {n: statistics.median(r["median_s"] for r in v) for n, v in runs.items()
             if n != "auto"}
    best_name = min(fixed, key=fixed.get)
    ratios = [r["median_s"] / fixed[best_name] for r in runs["auto"]]
    within = sum(q <= 1.05 for q in ratios)
    print(f"\n{args.tokens} tokens/rank, H{args.hidden}/F{args.ffn}/E{args.experts}/top-"
          f"{args.topk}, {args.world_size} ranks, wire {args.wire or 'none'}, "
          f"{args.rate or 'plain loopback'}")
    for n, v in runs.items():
        ms = [r["median_s"] * 1e3 for r in v]
        print(f"  {n:>10}: median {statistics.median(ms):8.1f} ms, runs "
              + " ".join(f"{m:.1f}" for m in ms))
    print(f"  auto / best fixed ({best_name}): " + " ".join(f"{q:.3f}" for q in ratios)
          + f"; within 5% in {within} of {len(ratios)}, worst {max(ratios):.3f}")
    own = [r["median_s"] / fixed[best_name] for r in runs[best_name]]
    print(f"  noise floor, {best_name}'s own runs / their median: "
          + " ".join(f"{q:.3f}" for q in own)
          + f"; within 5% in {sum(q <= 1.05 for q in own)} of {len(own)}, worst {max(own):.3f}")
    paired = [a["median_s"] / runs[best_name][r]["median_s"] for r, a in enumerate(runs["auto"])]
    print(f"  paired, auto / {best_name}'s run of the same round: "
          + " ".join(f"{q:.3f}" for q in paired)
          + f"; within 5% in {sum(q <= 1.05 for q in paired)} of {len(paired)}")
    decided = [fixed.get(locked_name(r), float("nan")) / fixed[best_name] for r in runs["auto"]]
    print("  decided, the median of the plan each auto run locked / the best's: "
          + " ".join(f"{q:.3f}" for q in decided)
          + f"; within 5% in {sum(q <= 1.05 for q in decided)} of {len(decided)}")
    print("  auto locked: " + ", ".join(locked_name(r) for r in runs["auto"]))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "runs": runs, "fixed_median_s": fixed,
                                         "best_fixed": best_name, "auto_ratios": ratios,
                                         "best_fixed_own_ratios": own,
                                         "auto_paired_ratios": paired,
                                         "auto_decided_ratios": decided},
                                        indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
