#!/usr/bin/env python
"""One training job, three ways to place its experts on 4 ranks: EP 4, DP 2 x EP 2, DP 4.

The work is the same in every layout: ``mc2 train``'s tiny Mixtral (4 layers, 8 experts,
top-2, hidden 128), 4 ranks with one thread each, each rank its own batch of 8 x 128 bytes,
the same steps. What changes is where the experts live and so what crosses the network:

- ``ep4``: every rank holds 2 experts; tokens travel (All-to-All over all 4 ranks); only the
  replicated (non-expert) gradients are all-reduced.
- ``dp2xep2``: EP groups of 2 ranks (inside a node), DP across them: tokens travel inside a
  node only; each expert's gradient is summed over its 2 replicas.
- ``dp4``: every rank holds all 8 experts: no All-to-All, but every expert gradient is
  all-reduced over 4 ranks.

Each layout runs with the gradient sync after the backward (``average_gradients``) and during
it (``GradientSync``). Regimes: ``loopback`` (4 local ranks), and ``nodes`` (2 emulated nodes
of 2 ranks, a real ``torchrun --nnodes 2``, inter-node links shaped to ``--bandwidth``; root).
Reported: the median over steps (the first dropped) of tokens/s per rank, and of the time left
in the gradient sync after the backward.

    sudo .venv/bin/python benchmarks/mesh_layouts.py --regimes loopback,nodes --steps 12
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

LAYOUTS = {"ep4": 4, "dp2xep2": 2, "dp4": 1}


def run(regime: str, ep: int, sync: str, steps: int, bandwidth: str, out: Path) -> dict:
    from mc2.tools.cli import main

    args = ["train", "--ep-size", str(ep), "--grad-sync", sync, "--steps", str(steps),
            "--out", str(out)]
    if regime == "nodes":
        args += ["--nodes", "2", "--ranks-per-node", "2", "--inter-node-bandwidth", bandwidth]
    else:
        args += ["--world-size", "4"]
    if main(args) != 0:
        raise SystemExit(f"mc2 {' '.join(args)} failed")
    (result,) = json.loads((out / "losses.json").read_text())["runs"].values()
    rates, syncs = result["tokens_per_s_per_rank"][1:], result["sync_s"][1:]
    return {"tokens_per_s_per_rank": statistics.median(rates),
            "sync_ms": 1e3 * statistics.median(syncs), "final_loss": result["losses"][-1]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regimes", default="loopback", help="loopback, nodes or loopback,nodes")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--bandwidth", default="1gbit", help="inter-node rate for 'nodes'")
    parser.add_argument("--json", type=Path, help="also write the table as JSON")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for regime in args.regimes.split(","):
            for name, ep in LAYOUTS.items():
                for sync in ("after", "overlap"):
                    print(f"== {regime} {name} grad sync {sync}", file=sys.stderr, flush=True)
                    r = run(regime, ep, sync, args.steps, args.bandwidth,
                            Path(tmp) / f"{regime}-{name}-{sync}")
                    rows.append({"regime": regime, "layout": name, "grad_sync": sync, **r})
    print(f"\n{'regime':9} {'layout':8} {'grad sync':9} {'tokens/s/rank':>13} "
          f"{'sync left ms':>12} {'vs ep4 after':>12}")
    for row in rows:
        base = next(r for r in rows if r["regime"] == row["regime"] and r["layout"] == "ep4"
                    and r["grad_sync"] == "after")
        print(f"{row['regime']:9} {row['layout']:8} {row['grad_sync']:9} "
              f"{row['tokens_per_s_per_rank']:13,.0f} {row['sync_ms']:12.1f} "
              f"{row['tokens_per_s_per_rank'] / base['tokens_per_s_per_rank']:11.2f}x")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
