"""A whole TorchTitan 0.3.0 Qwen3 MoE model: TorchTitan's own expert parallelism against mc2
inside each layer (``mc2_routed_experts``) and mc2's batch overlap across layers
(``mc2_batch_overlap``), the same weights.

2 local Gloo ranks, TorchTitan's own ``parallelize_qwen3`` (FSDP over the 2 with bfloat16
parameters, EP = 2), the model and shims of tests/workers_torchtitan_model.py (SDPA attention:
flex needs inductor). The shape is ``benchmarks/model_overlap.py``'s in TorchTitan's terms:
dim 1024, expert hidden 2048, 8 experts top-2, 8 heads (head dim 128), 2 layers, sequences of
512 (``--tokens`` per rank: ``tokens / 512`` sequences), optionally a shared expert of the
routed experts' width per block (``--shared``). One step is the model's forward, TorchTitan's
cross-entropy and the backward (FSDP's reduce-scatters included; no optimizer).
Implementations (``--impls``): ``torchtitan`` (its all-to-all dispatcher), ``mc2``
(``mc2_routed_experts``, ``"auto"``), ``batch`` (``mc2_batch_overlap``), ``batch_auto``
(``batch_overlap="auto"``, decided in its warm-up steps), ``unsplit`` (``mc2_batch_overlap``
with ``batch_overlap=False``: in-layer, the shared experts inside the call). Interleaved rounds
(:mod:`layer_rounds`), the slowest rank's step, median::

    .venv/bin/python benchmarks/torchtitan_model.py --regimes plain,200mbit --json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from layer_rounds import layer_benchmark, model_rounds  # noqa: E402

SEQ, LAYERS, HEADS = 512, 2, 8
OVERLAP = "mc2.integrations.torchtitan_overlap.mc2_batch_overlap"


def _override(impl: str) -> tuple[str, dict[str, Any] | None]:
    """The override and its keywords of an implementation (``None``: TorchTitan's own)."""
    from tests.workers_torchtitan_model import MC2

    choices = {"torchtitan": (MC2, None), "mc2": (MC2, {"micro_batches": "auto"}),
               "batch": (OVERLAP, {"batch_overlap": True}),
               "batch_auto": (OVERLAP, {"batch_overlap": "auto"}),
               "unsplit": (OVERLAP, {"batch_overlap": False})}
    if impl not in choices:
        raise ValueError(f"impls: unknown implementation {impl!r}")
    return choices[impl]


def _rank(rank: int, world: int, impls: list[str], shape: dict[str, int], steps: int,
          rounds: int, shared: bool = False) -> dict[str, Any]:

    from tests import workers_torchtitan_model as w
    from torchtitan.components.loss import CrossEntropyLoss

    dims = w.parallel_dims(world, "partial_dtensor")
    model_shape = dict(dim=shape["hidden"], layers=LAYERS, heads=HEADS, kv_heads=HEADS,
                       head_dim=shape["hidden"] // HEADS, experts=shape["experts"],
                       top_k=shape["topk"], moe_hidden=shape["ffn"], seq=SEQ, vocab=256)
    models = {}
    for impl in impls:
        override, options = _override(impl)
        model = w.build_model(world, "partial_dtensor", options, override, shared, model_shape)
        models[impl] = w.parallelize(model, dims, world, "partial_dtensor")
    batch = max(2, shape["tokens"] // SEQ)
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, 256, (batch, SEQ), generator=g)
    labels = (tokens * 7 + 3) % 256
    loss_fn = CrossEntropyLoss.Config().build()
    valid = torch.tensor(labels.numel() * world, dtype=torch.int64)

    def loss(model: torch.nn.Module) -> torch.Tensor:
        return loss_fn(model(tokens), labels, valid)[0]

    timed = model_rounds(models, loss, rounds=rounds, repeats=steps)
    # what batch overlap ran (True: split), per implementation: its first block decides
    timed["batch_overlap"] = {impl: getattr(next(iter(m.layers.values())), "decision", None)
                              and next(iter(m.layers.values())).decision.chosen
                              for impl, m in models.items()}
    return timed


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--shared", action="store_true",
                        help="a shared expert of the routed experts' width in every block")
    known, rest = parser.parse_known_args()
    rank_fn = _rank if not known.shared else _shared_rank
    layer_benchmark(rank_fn, doc=__doc__, baseline="torchtitan", tokens=2048, hidden=1024,
                    ffn=2048, describe=f"Qwen3 MoE {LAYERS} layers, seq {SEQ}, FSDP + EP 2, "
                    f"bf16{', shared expert' if known.shared else ''}", error_key="loss_err",
                    error_name="|loss err|", impls="torchtitan,mc2,batch", argv=rest)


def _shared_rank(*args: Any) -> dict[str, Any]:
    return _rank(*args, shared=True)


if __name__ == "__main__":
    main()
