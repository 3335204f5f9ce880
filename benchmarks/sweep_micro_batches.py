#!/usr/bin/env python
"""Sweep the micro-batch count K against the batch size: where does splitting pay?

For each batch size (sequences of ``--seq`` tokens per rank) one local Gloo world times the
serial path and MC2 with every K, in the same run (median of ``--repeats``), and prints the full
table plus a summary: the article's warning that a small batch split into many pieces loses,
and that gains appear from larger batches.

    python benchmarks/sweep_micro_batches.py                 # K 1,2,4,8,16 x batch 4,16,64
    python benchmarks/sweep_micro_batches.py --batches 16 --micro-batches 2,4 --repeats 3
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from mc2.tools.bench import BenchConfig, format_report, run_bench
from mc2.tools.cli import parse_ints


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", type=parse_ints, default=(4, 16, 64), help="batch sizes (sequences)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--micro-batches", type=parse_ints, default=(1, 2, 4, 8, 16), help="K values")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--split-sync", action="store_true", help="also time K splits without overlap")
    p.add_argument("--json", type=Path, help="write all reports to this JSON file")
    args = p.parse_args()

    base = BenchConfig(hidden=args.hidden, ffn=args.ffn, experts=args.experts, topk=args.topk,
                       micro_batches=args.micro_batches, repeats=args.repeats,
                       split_sync=args.split_sync)
    reports = []
    for batch in args.batches:
        cfg = replace(base, tokens_per_rank=batch * args.seq)
        print(f"\n== batch {batch} x seq {args.seq} = {cfg.tokens_per_rank} tokens per rank ==",
              flush=True)
        report = run_bench(cfg, world_size=args.world_size)
        print(format_report(report), flush=True)
        reports.append((batch, report))

    print("\nsummary: speedup over serial (same run, median step time)")
    ks = [f"K={k}" for k in args.micro_batches]
    print("batch  tokens/rank  serial ms  " + "  ".join(f"{k:>6}" for k in ks) + "  best")
    for batch, report in reports:
        by_k = {r.micro_batches: r for r in report.results if r.overlap}
        cells = "  ".join(f"{by_k[k].speedup:6.3f}" for k in args.micro_batches)
        print(f"{batch:5d}  {report.config.tokens_per_rank:11d}  {report.serial.step_s * 1e3:9.1f}"
              f"  {cells}  {report.best.mode}")
    if args.json:
        args.json.write_text(json.dumps([r.to_dict() for _, r in reports], indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
