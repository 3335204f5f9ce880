"""Timing one layer's step against others' in one local world, the same way every time.

Used by the framework benchmarks (``megatron_layer.py``, ``torchtitan_layer.py``) and by
``auto_fresh_runs.py``: a step is timed on every rank from a barrier and counts as the slowest
rank's; implementations are measured in interleaved rounds so the machine's drift falls on all
of them alike, and each one's figure is the median over rounds of its per-round median.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist


def slowest_rank_seconds(run: Callable[[], Any]) -> float:
    """Seconds ``run()`` took on the group's slowest rank (a barrier first, then one
    all-reduce of the time: a collective, every rank calls it)."""
    dist.barrier()
    start = time.perf_counter()
    run()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def interleaved_rounds(steps: dict[str, Callable[[], float]], *, rounds: int, repeats: int,
                       warmup: int, warm: Iterable[str] | None = None) -> dict[str, Any]:
    """``warmup`` untimed steps of each of ``warm`` (default: all; ``"auto"``'s trials among
    them), then ``rounds`` rounds in which every implementation runs one untimed step and
    ``repeats`` timed ones. ``{"rounds": name -> per-round medians, "median_s": name ->
    median of those}``."""
    for name in steps if warm is None else warm:
        for _ in range(warmup):
            steps[name]()
    per_round: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            step()  # untimed
            per_round[name].append(statistics.median(step() for _ in range(repeats)))
    return {"rounds": per_round,
            "median_s": {name: statistics.median(r) for name, r in per_round.items()}}


def add_shape_arguments(parser: argparse.ArgumentParser, *, tokens: int, hidden: int,
                        ffn: int) -> None:
    """The MoE shape's options (tokens per rank, hidden, ffn, experts, top-k)."""
    parser.add_argument("--tokens", type=int, default=tokens,
                        help=f"tokens per rank (default {tokens})")
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--ffn", type=int, default=ffn)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)


def add_layer_arguments(parser: argparse.ArgumentParser, *, tokens: int, hidden: int, ffn: int,
                        impls: str) -> None:
    """The options every layer benchmark takes: the MoE shape, steps, rounds, impls, json."""
    add_shape_arguments(parser, tokens=tokens, hidden=hidden, ffn=ffn)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--impls", default=impls)
    parser.add_argument("--json", help="write the results here")


def shape_of(args: argparse.Namespace) -> dict[str, int]:
    """The MoE shape :func:`add_shape_arguments` parsed."""
    return dict(tokens=args.tokens, hidden=args.hidden, ffn=args.ffn, experts=args.experts,
                topk=args.topk)
