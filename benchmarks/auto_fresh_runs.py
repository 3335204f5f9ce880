#!/usr/bin/env python
"""Does every fresh run of ``micro_batches="auto"`` settle where the best fixed choice is?

``"auto"`` decides each shape from its trial calls, once per process: a run that locks a poor
plan keeps it for the whole job. So one run is not a measurement of ``"auto"``: this benchmark
starts ``--rounds`` fresh worlds (fresh ranks: a fresh planner each). In each one ``"auto"``
runs its trials until the planner has locked, then every fixed choice (K, and with ``--wire``
that format's rows and plain rows) makes one warm-up call, and then ``--steps`` steps in which
``"auto"`` and every fixed choice each run one call (forward + backward of ``fused_expert``,
timed as the group's slowest rank), in a rotating order. Each timed call follows an untimed
call of the same choice, so what is timed is the steady-state step a job of that plan runs:
without it each call paid for its predecessor (a call after a K = 8 call ran ~25% slower here
at 256 tokens, whichever plan it was), and in a fixed rotation ``"auto"`` always followed the
same choice. So each of ``"auto"``'s steps has the
best fixed choice's step of the same seconds beside it: this machine's slow spells (seconds
long, and ±20% from call to call) fall on both, and the comparison is of the plans, not of
the minutes they ran in. (Fixed choices in fresh worlds of their own spread by up to 54% here,
more than any margin the decision is about.)

Per fresh world it reports ``"auto"`` against the best fixed choice (the one with the lowest
median over all worlds): the median over the world's steps of auto's step / that choice's
step (the issue's measure, target within 5% in at least 9 of 10 runs, never more than 15%
slower); the same against the fixed choice of the plan ``"auto"`` locked (the noise floor: the
same plan twice, so what remains is noise or a cost of ``"auto"`` itself); and the decision:
the locked plan's median over the best's (1.0: it locked the best plan).

    python benchmarks/auto_fresh_runs.py                        # plain loopback, 5 worlds
    python benchmarks/auto_fresh_runs.py --tokens 256 --wire fp8
    sudo python benchmarks/auto_fresh_runs.py --rate 200mbit     # loopback shaped (removed after)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import mc2
from compare_peers import ShapedLoopback, can_shape
from layer_rounds import add_shape_arguments, slowest_rank_seconds, until_auto_locked


def world_run(rank: int, world: int, choices: dict[str, dict[str, Any]], shape: dict[str, int],
              steps: int) -> dict[str, Any]:
    """One fresh world: ``"auto"``'s trials until it locks, a warm-up call of every fixed
    choice, then ``steps`` rounds of one timed call per choice (each after an untimed call of
    the same choice: the steady state, not the predecessor's aftermath), rotating; the
    slowest rank's step times per choice, and what ``"auto"`` locked."""
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
    warnings.simplefilter("ignore", mc2.WireFormatWarning)  # what auto chose is reported below

    def step(choice: dict[str, Any]) -> float:
        xs = x.clone().requires_grad_(True)
        took = slowest_rank_seconds(lambda: mc2.fused_expert(
            xs, *ws, ids, rw, planner=planner, **choice).sum().backward())
        for w in ws:
            w.grad = None
        return took

    started = time.perf_counter()
    step(choices["auto"])  # the shape's first call: its trials begin
    trial_calls = 1 + until_auto_locked(lambda: step(choices["auto"]), planner)
    trials_s = time.perf_counter() - started
    names = list(choices)
    for name in names:
        step(choices[name])
    times: dict[str, list[float]] = {name: [] for name in names}
    for s in range(steps):
        for j in range(len(names)):
            name = names[(j + s) % len(names)]
            step(choices[name])  # settles: the timed call follows its own plan
            times[name].append(step(choices[name]))
    decision = next(iter(planner.decisions().values()))
    return {"times_s": times, "trial_calls": trial_calls, "trials_s": trials_s,
            "locked": decision["locked"], "plain_rows": decision["plain_rows"],
            "why": decision["why"]}


def locked_name(run: dict[str, Any], wire: str | None) -> str:
    """The fixed choice an ``"auto"`` run locked, named as the fixed choices are."""
    return f"K={run['locked']}{' plain' if wire and run['plain_rows'] else ''}"


def paired(a: list[float], b: list[float]) -> float:
    """The median of step-by-step ratios a / b (steps of the same seconds)."""
    return statistics.median(x / y for x, y in zip(a, b))


def summarize(worlds: list[dict[str, Any]], wire: str | None) -> dict[str, Any]:
    """The per-world ratios and the counts the target is stated in."""
    fixed = {n: statistics.median(statistics.median(w["times_s"][n]) for w in worlds)
             for n in worlds[0]["times_s"] if n != "auto"}
    best = min(fixed, key=fixed.get)
    vs_best = [paired(w["times_s"]["auto"], w["times_s"][best]) for w in worlds]
    nan = [float("nan")] * len(worlds[0]["times_s"]["auto"])  # a lock outside --ks
    vs_own = [paired(w["times_s"]["auto"], w["times_s"].get(locked_name(w, wire), nan))
              for w in worlds]
    decided = [fixed.get(locked_name(w, wire), float("nan")) / fixed[best] for w in worlds]
    return {"fixed_median_s": fixed, "best_fixed": best, "auto_vs_best": vs_best,
            "auto_vs_locked_plan": vs_own, "decided": decided,
            "within_5pct": sum(q <= 1.05 for q in vs_best), "worst": max(vs_best),
            "locked": [locked_name(w, wire) for w in worlds],
            "trial_calls": [w["trial_calls"] for w in worlds],
            "trials_s": [w["trials_s"] for w in worlds]}


def counted(ratios: list[float]) -> str:
    return (" ".join(f"{q:.3f}" for q in ratios)
            + f"; within 5% in {sum(q <= 1.05 for q in ratios)} of {len(ratios)}, worst "
            f"{max(ratios):.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(p, tokens=1024, hidden=512, ffn=1024)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--ks", default="1,2,4,8", help="fixed K to compare (default 1,2,4,8)")
    p.add_argument("--wire", default=None, help="a wire format for every choice (bf16, fp8)")
    p.add_argument("--rounds", type=int, default=5, help="fresh worlds (default 5)")
    p.add_argument("--steps", type=int, default=15,
                   help="timed calls per choice and world, interleaved (default 15)")
    p.add_argument("--rate", default=None,
                   help="shape loopback to this rate with tc tbf for the run (root; removed "
                        "after), e.g. 200mbit")
    p.add_argument("--no-plain", action="store_true",
                   help="with --wire, compare with the format's fixed K only (not plain rows)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    shape = {"tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn,
             "local": args.experts // args.world_size, "topk": args.topk}
    extra = {"wire_dtype": args.wire} if args.wire else {}
    choices = {"auto": {"micro_batches": "auto", **extra}}
    for k in (int(v) for v in args.ks.split(",")):
        choices[f"K={k}"] = {"micro_batches": k, **extra}
        if args.wire and not args.no_plain:
            choices[f"K={k} plain"] = {"micro_batches": k}
    if args.rate and (why := can_shape()) is not None:
        raise SystemExit(f"--rate {args.rate}: {why}")
    shaping = ShapedLoopback(args.rate, latency="400ms") if args.rate else \
        contextlib.nullcontext()
    worlds = []
    with shaping:
        for r in range(args.rounds):
            got = mc2.run_local(world_run, args.world_size,
                                args=(choices, shape, args.steps))[0]
            worlds.append(got)
            medians = {n: statistics.median(t) * 1e3 for n, t in got["times_s"].items()}
            print(f"world {r + 1}/{args.rounds}: locked {locked_name(got, args.wire)} after "
                  f"{got['trial_calls']} calls ({got['trials_s']:.1f} s); medians "
                  + ", ".join(f"{n} {m:.1f}" for n, m in medians.items()) + " ms",
                  file=sys.stderr, flush=True)
    s = summarize(worlds, args.wire)
    best = s["best_fixed"]
    print(f"\n{args.tokens} tokens/rank, H{args.hidden}/F{args.ffn}/E{args.experts}/top-"
          f"{args.topk}, {args.world_size} ranks, wire {args.wire or 'none'}, "
          f"{args.rate or 'plain loopback'}, {args.rounds} worlds x {args.steps} steps")
    for n, m in s["fixed_median_s"].items():
        print(f"  {n:>10}: median {m * 1e3:8.1f} ms")
    print(f"  auto / {best} (paired per step): {counted(s['auto_vs_best'])}")
    print(f"  auto / the plan it locked (noise floor): {counted(s['auto_vs_locked_plan'])}")
    print(f"  decided, locked plan's median / {best}'s: {counted(s['decided'])}")
    print("  auto locked: " + ", ".join(s["locked"]) + "; trial calls "
          + " ".join(map(str, s["trial_calls"])))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "worlds": worlds, **s}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
