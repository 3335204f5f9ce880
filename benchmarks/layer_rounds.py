"""Timing one layer's step against others' in one local world, the same way every time.

Used by the framework benchmarks (``megatron_layer.py``, ``torchtitan_layer.py``) and by
``auto_fresh_runs.py``: a step is timed on every rank from a barrier and counts as the slowest
rank's; implementations are measured in interleaved rounds so the machine's drift falls on all
of them alike, and each one's figure is the median over rounds of its per-round median.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from mc2.engine.decide.planner import Planner, default_decisions


def until_auto_locked(step: Callable[[], Any], planner: Planner | None = None) -> int:
    """Run ``step`` until ``planner`` has locked every shape it has seen (default: the
    default planners, the framework layers' ``"auto"``), raising where that takes more calls
    than a planner's trials can; the calls run. So no trial call, and no settling call between
    them, lands in a timed round."""
    bound = (planner or Planner()).most_trial_calls()
    calls = 0
    while not (planner.settled() if planner is not None
               else all(d["locked"] is not None for d in default_decisions())):
        if calls > bound:
            raise RuntimeError(f'"auto" did not lock in {calls} calls')
        step()
        calls += 1
    return calls


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
    """``warmup`` untimed steps of each of ``warm`` (default: all), each then until
    ``"auto"`` has locked (:func:`until_auto_locked`), then ``rounds`` rounds in which every
    implementation runs one untimed step and ``repeats`` timed ones. ``{"rounds": name ->
    per-round medians, "median_s": name -> median of those}``."""
    for name in steps if warm is None else warm:
        for _ in range(warmup):
            steps[name]()
        until_auto_locked(steps[name])
    per_round: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            step()  # untimed
            per_round[name].append(statistics.median(step() for _ in range(repeats)))
    return {"rounds": per_round,
            "median_s": {name: statistics.median(r) for name, r in per_round.items()},
            "auto_decisions": [d["why"] for d in default_decisions()]}


def model_rounds(models: dict[str, torch.nn.Module], loss: Callable[[torch.nn.Module], Any],
                 *, rounds: int, repeats: int, warmup: int = 4) -> dict[str, Any]:
    """Whole-model steps (``loss(model).backward()``, gradients set to None outside the timed
    region) of each of ``models`` in :func:`interleaved_rounds`, and each one's loss against
    the first model's (``"loss_err"``: one no-grad forward each, after the rounds)."""
    first = next(iter(models))

    def step(model: torch.nn.Module) -> float:
        for p in model.parameters():
            p.grad = None
        return slowest_rank_seconds(lambda: loss(model).backward())

    timed = interleaved_rounds({name: (lambda m=m: step(m)) for name, m in models.items()},
                               rounds=rounds, repeats=repeats, warmup=warmup)
    # after the rounds (no optimizer: the weights are the same), so that "auto" has no
    # no-grad shape of its own to settle before them
    with torch.no_grad():
        want = float(loss(models[first]))
        errors = {name: abs(float(loss(m)) - want) for name, m in models.items()
                  if name != first}
    return {**timed, "loss_err": errors}


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
    """The options every layer benchmark takes: the MoE shape, steps, rounds, impls,
    regimes, json."""
    add_shape_arguments(parser, tokens=tokens, hidden=hidden, ffn=ffn)
    parser.add_argument("--regimes", default="plain",
                        help="plain, or shaped loopback (root) e.g. 500mbit,200mbit")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--impls", default=impls)
    parser.add_argument("--json", help="write the results here")


def shape_of(args: argparse.Namespace) -> dict[str, int]:
    """The MoE shape :func:`add_shape_arguments` parsed."""
    return dict(tokens=args.tokens, hidden=args.hidden, ffn=args.ffn, experts=args.experts,
                topk=args.topk)


def regime(name: str) -> contextlib.AbstractContextManager:
    """``plain``: loopback as it is; ``<rate>`` (``200mbit``): loopback shaped with ``tc tbf
    rate <rate> burst 512kb latency 400ms`` for the block, removed after (root; every process
    on the machine shares ``lo``, so only on a machine of your own)."""
    if name == "plain":
        return contextlib.nullcontext()
    from compare_peers import ShapedLoopback, can_shape

    if (why := can_shape()) is not None:
        raise SystemExit(f"regime {name}: {why}")
    return ShapedLoopback(name, latency="400ms")


def print_regime(title: str, found: dict[str, Any], baseline: str, errors: dict[str, float],
                 error_name: str) -> None:
    """One regime's figures: each implementation's median, its speed against ``baseline``
    (> 1: faster), its per-round medians and its error against the baseline's output."""
    print(title)
    base = found["median_s"][baseline]
    for impl, median in found["median_s"].items():
        rounds = " / ".join(f"{r * 1e3:.0f}" for r in found["rounds"][impl])
        print(f"  {impl:12s} {median * 1e3:9.1f} ms  {base / median:5.2f}x  rounds {rounds} ms"
              + (f"  {error_name} {errors[impl]:.1e}" if impl in errors else ""), flush=True)
    for why in found.get("auto_decisions", []):
        print(f"  auto {why}", flush=True)


def run_regimes(rank_fn: Callable[..., dict[str, Any]], args: argparse.Namespace,
                impls: list[str], describe: str, baseline: str, error_key: str,
                error_name: str, deadline_s: float = 7200) -> dict[str, Any]:
    """``rank_fn(rank, world, impls, shape, steps, rounds)`` on 2 local ranks in each of
    ``--regimes``, printed as it ends and written to ``--json`` after each (a run cut short
    keeps what it measured)."""
    import json
    from pathlib import Path

    import mc2

    shape = shape_of(args)
    out: dict[str, Any] = {"shape": shape, "steps": args.steps, "rounds": args.rounds}
    for name in args.regimes.split(","):
        with regime(name):
            results = mc2.run_local(rank_fn, 2, args=(impls, shape, args.steps, args.rounds),
                                    timeout_s=600, deadline_s=deadline_s)
        found = out[name] = results[0]
        print_regime(f"[{name}] tokens/rank {args.tokens} H{args.hidden} F{args.ffn} "
                     f"E{args.experts} top-{args.topk}, {describe}, {args.rounds} rounds x "
                     f"{args.steps} steps", found, baseline, found[error_key], error_name)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    return out


def layer_benchmark(rank_fn: Callable[..., dict[str, Any]], *, doc: str, baseline: str,
                    tokens: int, hidden: int, ffn: int, describe: str, error_key: str,
                    error_name: str, deadline_s: float = 7200,
                    argv: list[str] | None = None, impls: str | None = None) -> dict[str, Any]:
    """A framework layer benchmark's command line: the options, ``baseline`` first among
    ``--impls`` (default ``impls``, or the baseline and mc2 at K = auto, 1, 2), then
    :func:`run_regimes`."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add_layer_arguments(parser, tokens=tokens, hidden=hidden, ffn=ffn,
                        impls=impls or f"{baseline},mc2,mc2_k1,mc2_k2")
    args = parser.parse_args(argv)
    impls = [i for i in args.impls.split(",") if i]
    if impls[0] != baseline:
        raise SystemExit(f"impls: {baseline} first (the baseline)")
    return run_regimes(rank_fn, args, impls, describe, baseline, error_key, error_name,
                       deadline_s=deadline_s)
