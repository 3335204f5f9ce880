#!/usr/bin/env python
"""How much of the shared experts' time a fused call hides, at plain loopback and 200 Mbit.

Shared experts need no communication, so mc2 runs them where its pipeline has nothing else to
compute: under the first dispatch (the fill) and the last combine (the drain). This measures
what that hides: one world of 2 ranks per regime, forward + backward of one fused call per
step (the peers' expert shape: hidden 1024, ffn 2048, 8 experts, top-2; ``--tokens`` per
rank; one shared expert of ``--shared-ffn``), three modes interleaved step by step:

- ``routed``: the call without shared experts;
- ``shared``: the same call with them;
- ``alone``: the shared experts' forward and backward by themselves (plain torch, no call).

Hidden share: ``1 - (shared - routed) / alone`` (1: the shared experts cost the step nothing;
0: they add all their own time). Medians of the slowest rank per step::

    sudo .venv/bin/python benchmarks/shared_fill_drain.py --regimes plain,200mbit \\
        --json docs/shared_fill_drain.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import mc2  # noqa: E402
from compare_peers import ShapedLoopback, can_shape  # noqa: E402

HIDDEN, FFN, EXPERTS, TOPK = 1024, 2048, 8, 2
MODES = ("routed", "shared", "alone")


def rank_steps(rank: int, world: int, tokens: int, shared_ffn: int, micro_batches: int,
               rounds: int) -> dict[str, list[float]]:
    """Each mode's step seconds on this rank, interleaved round by round."""
    import time

    torch.manual_seed(0)  # the same weights on every rank, for the shared experts
    local = EXPERTS // world
    up, gate = (torch.randn(local, HIDDEN, FFN) * 0.02 for _ in range(2))
    down = torch.randn(local, FFN, HIDDEN) * 0.02
    s_up, s_gate = (torch.randn(1, HIDDEN, shared_ffn) * 0.02 for _ in range(2))
    s_down = torch.randn(1, shared_ffn, HIDDEN) * 0.02
    params = [t.requires_grad_(True) for t in (up, gate, down, s_up, s_gate, s_down)]
    g = torch.Generator().manual_seed(rank + 1)
    x = torch.randn(tokens, HIDDEN, generator=g).requires_grad_(True)
    ids = torch.randint(0, EXPERTS, (tokens, TOPK), generator=g)
    weights = torch.rand(tokens, TOPK, generator=g).softmax(-1)
    grad = torch.randn(tokens, HIDDEN, generator=g)

    def step(mode: str) -> None:
        if mode == "alone":
            out = (F.silu(x @ s_gate[0]) * (x @ s_up[0])) @ s_down[0]
        else:
            extra = ({"shared_up": s_up, "shared_gate": s_gate, "shared_down": s_down}
                     if mode == "shared" else {})
            out = mc2.fused_expert(x, up, gate, down, ids, weights,
                                   micro_batches=micro_batches, **extra)
        out.backward(grad)
        for p in (*params, x):
            p.grad = None

    times: dict[str, list[float]] = {m: [] for m in MODES}
    for mode in MODES:  # warm up
        step(mode)
    for _ in range(rounds):
        for mode in MODES:
            torch.distributed.barrier()
            start = time.perf_counter()
            step(mode)
            times[mode].append(time.perf_counter() - start)
    return times


def summarize(ranks: list[dict[str, list[float]]]) -> dict[str, Any]:
    """Medians of the slowest rank per step, and the hidden share."""
    med = {m: statistics.median(max(r[m][i] for r in ranks) for i in range(len(ranks[0][m])))
           for m in MODES}
    added = med["shared"] - med["routed"]
    return {**{f"{m}_s": v for m, v in med.items()}, "added_s": added,
            "hidden_share": 1 - added / med["alone"]}


def run_regimes(regimes: str, rank_fn: Any, rank_args: tuple) -> dict[str, Any]:
    """``rank_fn`` on 2 ranks in one world per regime (shaped where not ``plain``), summarized
    and printed; shared with ``benchmarks/shared_model.py``."""
    results: dict[str, Any] = {}
    for regime in regimes.split(","):
        if regime != "plain" and (why := can_shape()) is not None:
            print(f"{regime}: skipped, {why}", file=sys.stderr)
            continue
        print(f"{regime}: modes {', '.join(MODES)} interleaved ...", file=sys.stderr)
        shaping = ShapedLoopback(regime, "400ms") if regime != "plain" else None
        if shaping is not None:
            shaping.__enter__()
        try:
            ranks = mc2.run_local(rank_fn, 2, args=rank_args, timeout_s=3600)
        finally:
            if shaping is not None:
                shaping.__exit__(None, None, None)
        results[regime] = summary = summarize(ranks) | {"ranks": ranks}
        print(f"{regime}: routed {summary['routed_s']:.3f} s, shared {summary['shared_s']:.3f} s "
              f"(+{summary['added_s']:.3f}), alone {summary['alone_s']:.3f} s: hidden "
              f"{summary['hidden_share']:.0%}")
    return results


def write_json(args: argparse.Namespace, results: dict[str, Any]) -> None:
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "results": results}, indent=1))


def parser_for(doc: str, *, regimes: str, rounds: int) -> argparse.ArgumentParser:
    """The options this benchmark and ``benchmarks/shared_model.py`` share."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=doc.split("\n\n", 1)[1])
    parser.add_argument("--regimes", default=regimes)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank per step")
    parser.add_argument("--shared-ffn", type=int, default=FFN)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--json", type=Path, default=None)
    return parser


def main_with(doc: str, rank_fn: Any, *, regimes: str, rounds: int, option: str,
              default: int, help: str) -> int:
    """A shared-expert benchmark's command line: the common options, one integer
    ``option`` of its own, then ``rank_fn(rank, world, tokens, shared_ffn, option, rounds)``
    in each regime, written to ``--json``."""
    parser = parser_for(doc, regimes=regimes, rounds=rounds)
    parser.add_argument(f"--{option}", type=int, default=default, help=help)
    args = parser.parse_args()
    write_json(args, run_regimes(args.regimes, rank_fn, (
        args.tokens, args.shared_ffn, getattr(args, option.replace("-", "_")), args.rounds)))
    return 0


def main() -> int:
    return main_with(__doc__, rank_steps, regimes="plain,200mbit", rounds=7,
                     option="micro-batches", default=2, help="K of the fused call")


if __name__ == "__main__":
    sys.exit(main())
