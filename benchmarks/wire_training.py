#!/usr/bin/env python
"""Training with rows on the wire in float32, bf16 and fp8: do the loss curves agree?

``mc2 train``'s tiny Mixtral (4 layers, 8 experts, top-2, hidden 128) on 2 local Gloo ranks,
the same seed and batches, K = 2 fixed (so every step really sends the format; ``"auto"`` may
send plain rows where they are faster). Reports each run's final loss (mean of the last 10
steps, to look past one batch's noise) against the float32 run, and draws the three curves in
one picture.

    .venv/bin/python benchmarks/wire_training.py --steps 200 --plot docs/img/wire_loss_curves.png
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from mc2.train import TrainConfig, plot_losses, run_training

FORMATS = ("none", "bf16", "fp8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--plot", type=Path, default=Path("wire_loss_curves.png"))
    parser.add_argument("--json", type=Path, help="also write the curves as JSON")
    args = parser.parse_args()
    base = TrainConfig(steps=args.steps, micro_batches=2, progress=True)
    curves = {}
    for fmt in args.formats.split(","):
        print(f"== wire {fmt}", file=sys.stderr, flush=True)
        curves[fmt] = run_training(replace(base, wire_dtype=fmt), world_size=2)["losses"]
    tail = {fmt: sum(c[-10:]) / len(c[-10:]) for fmt, c in curves.items()}
    ref = tail[args.formats.split(",")[0]]
    print(f"{'wire':6} {'final loss':>10} {'vs first':>9}")
    for fmt, value in tail.items():
        print(f"{fmt:6} {value:10.4f} {100 * (value / ref - 1):+8.2f}%")
    labels = {"none": "float32 on the wire", "bf16": "bf16 on the wire",
              "fp8": "fp8 e4m3 + scales on the wire", "int8": "int8 + scales on the wire",
              "fp16": "fp16 on the wire"}
    path = plot_losses({labels.get(f, f): c for f, c in curves.items()}, args.plot,
                       title=f"tiny Mixtral, 2 ranks, K=2: wire formats over {args.steps} steps")
    print(f"wrote {path}")
    if args.json:
        args.json.write_text(json.dumps(curves))
    return 0


if __name__ == "__main__":
    sys.exit(main())
