"""Hugging Face's own expert parallelism, ``ep_implementation`` against ``ep_implementation``.

A Mixtral-shaped model (hidden 1024, ffn 2048, 8 experts, top-2, 2 layers, vocab 4096, 8 heads)
loaded on 2 local ranks with ``DistributedConfig(ep_size=2, fsdp_size=2, ep_implementation=...)``
(``--layout dp``: ranks hold different batches; ``tp``: the EP group shares one batch,
``tp_size=2``), one copy per implementation in the same world
and the same weights. ``enable_mc2`` beside them is mc2's own stack on the same weights: the
model loaded without a ``DistributedConfig``, ``enable_mc2(model, mesh=mesh)`` and
``mc2.fully_shard(model, mesh=mesh)`` on a ``("dp", "ep")`` mesh of 1 x 2 (``dp`` layout
only). Measured interleaved, implementation by implementation within each round
(each after one untimed step), the median round counting:

- ``train``: a training step's forward and backward, ``--tokens`` tokens per rank (sequences
  of 512);
- ``decode``: a no-grad forward of ``--decode-tokens`` tokens per rank (one token per
  sequence), as a serving step runs.

Regimes: plain loopback and loopback shaped with ``tc tbf`` (root; always removed)::

    sudo .venv/bin/python benchmarks/hf_native.py --regimes plain,500mbit,200mbit \\
        --impls all_to_all,auto,mc2,enable_mc2 --json docs/hf_native.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_peers import can_shape, in_regime  # noqa: E402

import mc2  # noqa: E402

SHAPE = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=8, num_local_experts=8,
             num_experts_per_tok=2, max_position_embeddings=1024)
SEQ = 512


def _save(path: str) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(**SHAPE)).save_pretrained(path)


def _rank(rank: int, world: int, path: str, impls: list[str], tokens: int, decode: int,
          steps: int, rounds: int, layout: str = "dp",
          what: tuple[str, ...] = ("train", "decode"), warmup: int = 0,
          warmup_impls: tuple[str, ...] | None = None) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from mc2.integrations.hf_expert_parallel import register

    for impl in impls:  # "mc2_k2": mc2 with K fixed at 2, for diagnosis
        if impl.startswith("mc2_k"):
            register(impl, mc2.MC2Config(micro_batches=int(impl.removeprefix("mc2_k"))))
        if impl == "mc2_dedup":  # rows once per destination
            register(impl, mc2.MC2Config(dedup=True))
        if impl.startswith("mc2_cap"):  # capacity mode: N rows per rank, no host read
            register(impl, mc2.MC2Config(micro_batches=1,
                                         capacity=int(impl.removeprefix("mc2_cap"))))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    torch.set_num_threads(1)
    sizes = dict(fsdp_size=world) if layout == "dp" else dict(tp_size=world)

    def load(impl: str) -> Any:
        if impl == "enable_mc2":  # mc2's own stack on the same weights
            if layout != "dp":
                raise ValueError("enable_mc2 is measured in the dp layout only")
            from mc2.integrations.transformers import enable_mc2

            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            mesh = mc2.expert_parallel_mesh(world)
            enable_mc2(model, mesh=mesh)
            return mc2.fully_shard(model, mesh=mesh).train()
        return AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, distributed_config=DistributedConfig(
                ep_size=world, ep_implementation=impl, **sizes)).train()

    models = {i: load(i) for i in impls}
    g = torch.Generator().manual_seed(1 + (rank if layout == "dp" else 0))  # tp: one batch
    train_ids = torch.randint(0, SHAPE["vocab_size"], (max(1, tokens // SEQ), min(SEQ, tokens)),
                              generator=g)
    decode_ids = torch.randint(0, SHAPE["vocab_size"], (decode, 1), generator=g)

    def train(model: Any) -> None:
        model(train_ids, labels=train_ids).loss.backward()
        model.zero_grad(set_to_none=True)

    def serve(model: Any) -> None:
        with torch.no_grad():
            model(decode_ids)

    times: dict[str, dict[str, list[float]]] = {i: {w: [] for w in what} for i in impls}
    for impl in impls:  # --warmup: untimed calls before the first round (a new shape's first)
        if warmup_impls is not None and impl not in warmup_impls:
            continue
        for part, fn in (("train", train), ("decode", serve)):
            for _ in range(warmup if part in what else 0):
                fn(models[impl])
    for n in range(rounds):
        order = impls if n % 2 == 0 else impls[::-1]
        for impl in order:
            for part, fn in (("train", train), ("decode", serve)):
                if part not in what:
                    continue
                fn(models[impl])  # untimed: this implementation's steady state
                torch.distributed.barrier()
                start = time.perf_counter()
                for _ in range(steps):
                    fn(models[impl])
                torch.distributed.barrier()
                times[impl][part].append((time.perf_counter() - start) / steps)
    return times


def run(regime: str, args: argparse.Namespace, path: str) -> dict[str, Any]:
    impls = args.impls.split(",")
    call = lambda: mc2.run_local(  # noqa: E731
        _rank, 2, args=(path, impls, args.tokens, args.decode_tokens, args.steps, args.rounds,
                        args.layout, tuple(args.what.split(",")), args.warmup,
                        tuple(args.warmup_impls.split(",")) if args.warmup_impls else None),
        deadline_s=7200, timeout_s=1800)
    results = in_regime(regime, call)
    row: dict[str, Any] = {"regime": regime}
    for impl in impls:
        for what in args.what.split(","):
            rounds = [max(r[impl][what][k] for r in results) for k in range(args.rounds)]
            row[f"{impl} {what}"] = {"median_s": statistics.median(rounds), "rounds_s": rounds}
    return row


def each_regime(args: argparse.Namespace, run: Any, saved: Any) -> Iterator[tuple[str, dict]]:
    """The saved model's rows, ``run(regime, args, path)`` for each of ``--regimes`` (the
    shaped ones skipped, said why, where the link cannot be shaped); after each row the rows so
    far, ``saved(rows)``, go to ``--json``."""
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as path:
        _save(path)
        for regime in args.regimes.split(","):
            if regime != "plain" and (why := can_shape()):
                print(f"{regime}: skipped ({why})", file=sys.stderr)
                continue
            print(f"== {regime}", file=sys.stderr, flush=True)
            rows.append(run(regime, args, path))
            yield regime, rows[-1]
            if args.json:
                args.json.write_text(json.dumps(saved(rows), indent=1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--regimes", default="plain", help="plain, or tc tbf rates such as 200mbit")
    p.add_argument("--impls", default="all_to_all,auto,mc2,enable_mc2",
                   help="registered implementations (the first is the reference of the ratios); "
                        "mc2_k<N> is mc2 with micro_batches=N, mc2_dedup with dedup=True, "
                        "mc2_cap<N> with capacity=N (no-grad decode only); "
                        "enable_mc2 is mc2's own stack")
    p.add_argument("--layout", default="dp", choices=("dp", "tp"),
                   help="dp: ranks hold different batches (fsdp_size=2); tp: the EP group "
                        "shares one batch (tp_size=2)")
    p.add_argument("--tokens", type=int, default=4096, help="training tokens per rank")
    p.add_argument("--decode-tokens", type=int, default=4, help="no-grad tokens per rank")
    p.add_argument("--steps", type=int, default=1, help="timed steps per round")
    p.add_argument("--what", default="train,decode", help="train, decode or both")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=0,
                   help="untimed calls per implementation before the first round (each round "
                        "adds one): --warmup 4 --steps 9 times a new shape's calls 6-14")
    p.add_argument("--warmup-impls", default=None,
                   help="the implementations --warmup applies to (default: all), e.g. mc2: "
                        "its trials lock before the rounds, as in a job's steady state")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    impls = args.impls.split(",")
    for regime, row in each_regime(args, run, lambda rows: rows):
        for what in args.what.split(","):
            ref = row[f"{impls[0]} {what}"]["median_s"]
            line = ", ".join(f"{i} {row[f'{i} {what}']['median_s']:.3f} s "
                             f"({ref / row[f'{i} {what}']['median_s']:.2f}x)" for i in impls)
            print(f"{regime} {what}: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
