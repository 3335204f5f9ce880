"""TorchTitan 0.3.0's MoE block with its All-to-All token dispatcher against the same block
with mc2's routed-experts node (``mc2.integrations.torchtitan``), the same weights.

2 local Gloo ranks, one thread each, EP = 2, ``partial_dtensor`` (the block as
tests/workers_torchtitan.py builds it, with the CPU shims named there), bfloat16 parameters and
tokens (TorchTitan's GroupedExperts computes in bfloat16 whatever the dtype). One step: ``y =
moe(x); y.backward(dy)``, gradients set to None outside the timed region, a barrier before every
step, a step's time the slowest rank's. Each round runs every implementation in turn (one
untimed step, then ``--steps`` timed ones); an implementation's figure is the median over
rounds of its per-round median. ``mc2`` is ``micro_batches="auto"`` (its exploration runs in
untimed steps before the first round), ``mc2_k<N>`` fixes K. Plain loopback only::

    .venv/bin/python benchmarks/torchtitan_layer.py --tokens 2048 --hidden 512 --ffn 1024
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import mc2  # noqa: E402
from layer_rounds import add_layer_arguments, interleaved_rounds, shape_of, slowest_rank_seconds  # noqa: E402


def _options(variant: str) -> dict[str, Any] | None:
    """The override's keywords of an implementation (``None``: TorchTitan's dispatcher)."""
    if variant == "torchtitan":
        return None
    if variant == "mc2":
        return {"micro_batches": "auto"}
    if variant.startswith("mc2_k"):
        return {"micro_batches": int(variant.removeprefix("mc2_k"))}
    raise ValueError(f"impls: unknown implementation {variant!r}")


def _rank(rank: int, world: int, impls: list[str], shape: dict[str, int], steps: int,
          rounds: int) -> dict[str, Any]:
    from tests import workers_torchtitan as w

    dims = (shape["hidden"], shape["ffn"], shape["experts"], shape["topk"])
    layers = {impl: w.build(world, mc2=_options(impl), dtype=torch.bfloat16, shape=dims)
              for impl in impls}
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(1, shape["tokens"], shape["hidden"], generator=g).bfloat16()
    dy = torch.randn(1, shape["tokens"], shape["hidden"], generator=g).bfloat16()

    def step(layer: torch.nn.Module) -> float:
        for p in layer.parameters():
            p.grad = None
        xi = x.clone().requires_grad_(True)
        return slowest_rank_seconds(lambda: layer(xi).backward(dy))

    with torch.no_grad():  # outputs agree (one no-grad forward each)
        want = layers[impls[0]](x).float()
        errors = {impl: float((layers[impl](x).float() - want).abs().max() / want.abs().max())
                  for impl in impls[1:]}
    # "auto"'s exploration and a warm-up of every implementation, before timing
    timed = interleaved_rounds({impl: (lambda layer=layers[impl]: step(layer)) for impl in impls},
                               rounds=rounds, repeats=steps, warmup=6)
    return {**timed, "rel_err_vs_first": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_layer_arguments(parser, tokens=2048, hidden=512, ffn=1024,
                        impls="torchtitan,mc2,mc2_k1,mc2_k2")
    args = parser.parse_args()
    impls = [i for i in args.impls.split(",") if i]
    if impls[0] != "torchtitan":
        raise SystemExit("impls: torchtitan first (the baseline)")
    shape = shape_of(args)
    results = mc2.run_local(_rank, 2, args=(impls, shape, args.steps, args.rounds),
                            timeout_s=600, deadline_s=3600)
    found = results[0]
    base = found["median_s"]["torchtitan"]
    print(f"[plain] tokens/rank {args.tokens} H{args.hidden} F{args.ffn} E{args.experts} "
          f"top-{args.topk}, bf16, 2 ranks, {args.rounds} rounds x {args.steps} steps")
    for impl in impls:
        t = found["median_s"][impl]
        err = found["rel_err_vs_first"].get(impl)
        print(f"  {impl:12s} {t * 1e3:8.1f} ms  {base / t:5.2f}x"
              + ("" if err is None else f"  rel err {err:.1e}"))
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": shape, **found}, indent=1))


if __name__ == "__main__":
    main()
