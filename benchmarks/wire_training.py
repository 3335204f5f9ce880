#!/usr/bin/env python
"""Training with rows on the wire in float32, bf16 and fp8: do the losses agree?

``mc2 train``'s tiny Mixtral (4 layers, 8 experts, top-2, hidden 128) on 2 local Gloo ranks, the
same seed and batches in every run of a seed, K = 2 fixed (so every step really sends the
format; ``"auto"`` may send plain rows where they are faster). A run's end loss is the mean of
its last 10 steps, to look past one batch's noise.

Why seeds and a control: a perturbation of the rounding alone moves a 200-step run's end loss
by a few percent here (top-2 routing flips on tiny differences, and the runs part after some
50 steps). So one run per format cannot resolve 1%. Each format runs over ``--seeds`` (other
initialisations and batches); ``--control`` adds float32 rows at K = 1 per seed, which changes
nothing but the GEMMs' summation order. Reported: each run's end loss, each format's mean over
the seeds against float32's, and the control's spread, the noise floor of the comparison. The
picture draws each format's loss curve averaged over the seeds.

    .venv/bin/python benchmarks/wire_training.py --steps 200 --seeds 0,1,2 --control \\
        --runs docs/wire_training_runs --plot docs/img/wire_loss_curves.png

Finished runs are kept in ``--runs`` (one JSON per run) and not repeated.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from mc2.tools.training import TrainConfig, plot_losses, run_training

FORMATS = ("none", "bf16", "fp8")
LABELS = {"none": "float32", "bf16": "bf16", "fp8": "fp8 e4m3 + scales", "int8": "int8 + scales",
          "fp16": "fp16", "control": "float32, K=1"}


def end_loss(losses: list[float]) -> float:
    return statistics.fmean(losses[-10:])


def run(fmt: str, k: int, seed: int, steps: int, runs: Path) -> list[float]:
    """One training run's losses, from ``runs`` when it was done before."""
    path = runs / f"{fmt}-K{k}-seed{seed}-steps{steps}.json"
    if path.exists():
        return json.loads(path.read_text())
    print(f"== wire {fmt}, K={k}, seed {seed}", file=sys.stderr, flush=True)
    cfg = TrainConfig(steps=steps, micro_batches=k, progress=True, seed=seed)
    losses = run_training(replace(cfg, wire_dtype=fmt), world_size=2)["losses"]
    runs.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(losses))
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--formats", default=",".join(FORMATS),
                        help="wire formats, the first is the reference (default none,bf16,fp8)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    parser.add_argument("--control", action="store_true",
                        help="also run float32 rows at K=1: the rounding-only noise floor")
    parser.add_argument("--runs", type=Path, default=Path("wire_training_runs"),
                        help="folder keeping each finished run's losses")
    parser.add_argument("--plot", type=Path, default=Path("wire_loss_curves.png"))
    args = parser.parse_args()
    formats = args.formats.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = [(fmt, fmt, 2) for fmt in formats] + ([("control", formats[0], 1)]
                                                 if args.control else [])
    ends: dict[str, list[float]] = {}
    curves: dict[str, list[list[float]]] = {}
    for seed in seeds:
        for label, fmt, k in rows:
            losses = run(fmt, k, seed, args.steps, args.runs)
            ends.setdefault(label, []).append(end_loss(losses))
            curves.setdefault(label, []).append(losses)
    ref = statistics.fmean(ends[formats[0]])
    print(f"end loss (mean of the last 10 of {args.steps} steps), seeds {seeds}")
    print(f"{'wire':20} " + " ".join(f"{'seed ' + str(s):>9}" for s in seeds)
          + f" {'mean':>9} {'vs ' + LABELS.get(formats[0], formats[0]):>12}")
    for label, values in ends.items():
        mean = statistics.fmean(values)
        print(f"{LABELS.get(label, label):20} " + " ".join(f"{v:9.4f}" for v in values)
              + f" {mean:9.4f} {100 * (mean / ref - 1):+11.2f}%")
    if args.control:
        per_seed = [100 * (c / r - 1) for c, r in zip(ends["control"], ends[formats[0]])]
        print("rounding-only noise floor (float32 K=1 vs K=2, per seed): "
              + ", ".join(f"{d:+.2f}%" for d in per_seed))
    mean_curves = {LABELS.get(label, label): [statistics.fmean(step) for step in zip(*runs)]
                   for label, runs in curves.items()}
    path = plot_losses(mean_curves, args.plot,
                       title=f"tiny Mixtral, 2 ranks: wire formats, {args.steps} steps, "
                             f"mean of {len(seeds)} seed(s)")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
