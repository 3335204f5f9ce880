"""TorchTitan 0.3.0's MoE block with its All-to-All token dispatcher against the same block
with mc2's routed-experts node (``mc2.integrations.torchtitan``), the same weights.

2 local Gloo ranks, one thread each, EP = 2, ``partial_dtensor`` (the block as
tests/workers_torchtitan.py builds it, with the CPU shims named there), bfloat16 parameters and
tokens (TorchTitan's GroupedExperts computes in bfloat16 whatever the dtype). One step: ``y =
moe(x); y.backward(dy)``, gradients set to None outside the timed region, a barrier before every
step, a step's time the slowest rank's. Each round runs every implementation in turn (one
untimed step, then ``--steps`` timed ones); an implementation's figure is the median over
rounds of its per-round median. ``mc2`` is ``micro_batches="auto"`` (its exploration runs in
untimed steps before the first round), ``mc2_k<N>`` fixes K. Regimes (``--regimes``): ``plain``
loopback and ``<N>mbit``, loopback shaped with ``tc tbf ... latency 400ms`` (root, a machine of
your own)::

    .venv/bin/python benchmarks/torchtitan_layer.py --tokens 2048 --hidden 512 --ffn 1024
    sudo .venv/bin/python benchmarks/torchtitan_layer.py --regimes plain,200mbit
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from layer_rounds import interleaved_rounds, layer_benchmark, slowest_rank_seconds  # noqa: E402


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
    layer_benchmark(_rank, doc=__doc__, baseline="torchtitan", tokens=2048, hidden=512,
                    ffn=1024, describe="bf16, 2 ranks", error_key="rel_err_vs_first",
                    error_name="rel err", deadline_s=3600)

if __name__ == "__main__":
    main()
