#!/usr/bin/env python
"""Does ``micro_batches="auto"`` pick well?  Batch x hidden sweep, auto vs every fixed K.

For each (batch, hidden) one local Gloo world measures serial, MC2 with K in {1,2,4,8,16} and
MC2 with ``"auto"`` in the same run (median of ``--repeats``), then checks the acceptance:
auto within 5% of the best fixed K, and never more than 3% slower than K = 1. ``"auto"`` first
runs its bounded trials (at most 6 calls) and locks a K before anything is timed.

"auto" runs exactly the K it picks, so its time is judged as that K's time in the same sweep;
the separately timed "auto" row is printed too, and its difference from its own K's row shows
the machine's noise (a few percent on a shared 2-core host).

    python benchmarks/planner_acceptance.py        # 256..16384 tokens/rank x hidden 512,1024
    python benchmarks/planner_acceptance.py --batches 4,16 --hiddens 512 --repeats 3
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mc2.tools.bench import BenchConfig, format_plan, run_bench
from mc2.tools.cli import parse_ints


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", type=parse_ints, default=(16, 64, 256, 1024))
    p.add_argument("--hiddens", type=parse_ints, default=(512, 1024))
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence (default 16)")
    p.add_argument("--repeats", type=int, default=5,
                   help="repeats at 4096 tokens/rank; smaller problems get proportionally more "
                        "(up to 25), since their millisecond steps are noisier")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    rows, ok = [], True
    for hidden in args.hiddens:
        for batch in args.batches:
            tokens = batch * args.seq
            ks = tuple(k for k in (1, 2, 4, 8, 16) if k <= tokens)
            repeats = min(25, args.repeats * max(1, 4096 // tokens))
            cfg = BenchConfig(tokens_per_rank=tokens, hidden=hidden, ffn=2 * hidden,
                              micro_batches=ks, repeats=repeats, auto=True, quiet=True)
            print(f"\n== batch {batch} x seq {args.seq} = {tokens} tokens/rank, hidden {hidden} ==",
                  flush=True)
            report = run_bench(cfg, world_size=args.world_size)
            print(format_plan(report), flush=True)
            separate = report.result("mc2 auto").step_s
            auto = report.result(f"mc2 K={report.auto_k}").step_s
            best = report.best_fixed
            k1 = report.result("mc2 K=1").step_s
            passed = auto <= 1.05 * best.step_s and auto <= 1.03 * k1
            ok &= passed
            rows.append({"batch": batch, "hidden": hidden, "tokens": tokens,
                         "auto_k": report.auto_k, "auto_ms": auto * 1e3,
                         "auto_separate_ms": separate * 1e3,
                         "best": best.mode, "best_ms": best.step_s * 1e3, "k1_ms": k1 * 1e3,
                         "auto_over_best": auto / best.step_s, "auto_over_k1": auto / k1,
                         "pass": passed})

    print("\nbatch  hidden  tokens  auto K  auto ms  (separate run)  best (measured)    best ms  "
          "auto/best  auto/K=1  pass")
    for r in rows:
        print(f"{r['batch']:5d}  {r['hidden']:6d}  {r['tokens']:6d}  {r['auto_k']:6d}  "
              f"{r['auto_ms']:7.1f}  {r['auto_separate_ms']:14.1f}  {r['best']:<16}  "
              f"{r['best_ms']:7.1f}  "
              f"{r['auto_over_best']:9.3f}  {r['auto_over_k1']:8.3f}  {'yes' if r['pass'] else 'NO'}")
    print("all pass" if ok else "some configurations fail the acceptance")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
