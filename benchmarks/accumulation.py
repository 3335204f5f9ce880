#!/usr/bin/env python
"""A training step with gradient accumulation: the sequential loop against ``mc2.forward_backward``.

The Mixtral-shaped model of ``benchmarks/model_overlap.py`` (hidden 1024, ffn 2048, 8 experts,
top-2, 8 heads, ``--layers`` decoder layers), 2 ranks, plain processes; a step is
``--micro-batches`` micro-batches of ``--batch`` sequences of ``--seq`` tokens per rank, forward
and backward each (no optimizer step). The modes, interleaved step by step in one world per
regime (each after one untimed step at every switch), median of the slowest rank's steps:

- ``serial``: ``for mb: loss(mb).backward()``, every fused call synchronous, K = 1;
- ``mc2``: the same loop, MC2 inside each layer (``micro_batches="auto"``, settled first);
- ``batch``: the same loop, batch overlap (two halves of each micro-batch across the layers);
- ``paired``: ``mc2.forward_backward(overlap=True)``: micro-batch n+1's forward beside n's
  backward, layer by layer;
- ``paired-k2``, ``paired-k4`` (asked for by ``--modes``): the same, each layer's call split in
  two (four) micro-batches inside (MC2's in-layer pipeline under the pairing; ``paired``'s
  ``"auto"`` calls run two);
- ``auto`` (asked for by ``--modes``): ``mc2.forward_backward(overlap="auto")``, decided in
  its warm-up (both schedules measured, the faster kept), then timed as it runs;
- ``paired-inlayer`` (asked for by ``--modes``): ``forward_backward(overlap=True)`` on a copy
  built in-layer (``enable_mc2`` without batch overlap, same weights). Both paired modes now
  pair the eager calls (K = 2 inside each); until the staged pairing went, ``paired`` ran the
  batch-overlap model's layers in stages, and this mode was its comparison.

``--phases`` instead times each phase of the paired step (its first forward alone, each pair,
its last backward alone) against the serial loop's forward and backward of each micro-batch:
where the step's time over the bound goes (``docs/forward_backward.md``).

The bound of the issue: ``max(T_comp, T_comm)`` with ``T_comp`` the serial step on plain
loopback and ``T_comm`` the serial step shaped minus plain, so run ``plain`` with a shaped
regime. Shaped regimes use ``tc tbf`` (root; always removed)::

    sudo .venv/bin/python benchmarks/accumulation.py --regimes plain,200mbit,100mbit \\
        --json docs/accumulation.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Iterator

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import mc2  # noqa: E402
from compare_peers import ShapedLoopback, can_shape  # noqa: E402
from layer_rounds import until_auto_locked  # noqa: E402
from model_overlap import LATENCY, SHAPE, _model, _set_mode  # noqa: E402

MODES = ("serial", "mc2", "batch", "paired")
# paired, each call split in two micro-batches inside too; forward_backward's "auto"
OPTIONAL_MODES = ("paired-k2", "paired-k4", "auto", "paired-inlayer")


def _loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, labels=ids, use_cache=False).loss


def _step(model: Any, mode: str, batches: list[torch.Tensor]) -> None:
    if mode.startswith("paired") or mode == "auto":
        mc2.forward_backward(model, batches, _loss, overlap=True if mode != "auto" else "auto")
        return
    for ids in batches:
        _loss(model, ids).backward()


def _micro_batches(rank: int, count: int, batch: int, seq: int) -> list[torch.Tensor]:
    """This rank's token ids, ``count`` micro-batches of ``batch`` x ``seq`` (seeded by rank)."""
    g = torch.Generator().manual_seed(rank)
    return [torch.randint(0, SHAPE["vocab_size"], (batch, seq), generator=g)
            for _ in range(count)]


def _in_layer_model(layers: int) -> Any:
    """``_model``'s weights with mc2 inside each layer and no layer loop (no batch overlap)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from mc2.integrations.transformers import enable_mc2

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**(SHAPE | {"num_hidden_layers": layers})))
    enable_mc2(model, micro_batches="auto")
    return model.train()


def _set(model: Any, mode: str) -> None:
    """``model_overlap``'s modes; paired runs each micro-batch whole (no split), its calls
    overlapped (the staged calls run K = 1: the other micro-batch gives the overlap)."""
    _set_mode(model, "mc2" if mode.startswith("paired") or mode == "auto" else mode)
    if mode in ("paired-k2", "paired-k4"):
        from mc2.integrations.transformers import MC2SparseMoeBlock

        for block in model.modules():
            if isinstance(block, MC2SparseMoeBlock):
                block.config = block.config.replace(micro_batches=int(mode[-1]))


def rank_steps(rank: int, world: int, micro_batches: int, batch: int, seq: int, steps: int,
               rounds: int, modes: tuple[str, ...], layers: int) -> dict[str, Any]:
    from mc2.device.clock import clock_for

    model = _model(layers)
    model.train()
    in_layer = _in_layer_model(layers) if "paired-inlayer" in modes else None

    def run(mode: str, parts: list[torch.Tensor]) -> None:
        if mode == "paired-inlayer":
            _step(in_layer, "paired", parts)
        else:
            _set(model, mode)
            _step(model, mode, parts)

    def zero(mode: str) -> None:
        (in_layer if mode == "paired-inlayer" else model).zero_grad(set_to_none=True)

    batches = _micro_batches(rank, micro_batches, batch, seq)
    clock = clock_for(torch.device("cpu"))
    times: dict[str, list[float]] = {m: [] for m in modes}
    for mode in modes:  # warm up every mode (and let the in-layer "auto" settle its K)
        run(mode, batches)
        until_auto_locked(lambda m=mode: run(m, batches[:1]))
    if "auto" in modes:  # forward_backward's "auto" decides on whole steps
        _set(model, "auto")
        decided = _decided(model, lambda: _step(model, "auto", batches))
    for _ in range(rounds):
        for mode in modes:
            run(mode, batches)  # untimed at every switch (the workspace's sizes)
            for _ in range(steps):
                zero(mode)
                torch.distributed.barrier()
                start = clock.stamp()
                run(mode, batches)
                times[mode].append(clock.elapsed(start, clock.stamp()))
    return {"times": times, **({"auto_chose_pairing": decided} if "auto" in modes else {})}


def _decided(model: Any, step: Any, most: int = 40) -> bool:
    """Steps until ``mc2.forward_backward``'s ``"auto"`` has chosen; what it chose."""
    from mc2.forward_backward import kept_decision

    for _ in range(most):
        step()
        chosen = kept_decision(model, "auto").chosen
        if chosen is not None:
            return chosen
    raise RuntimeError(f'forward_backward "auto" did not decide in {most} steps')


def rank_memory(rank: int, world: int, mode: str, micro_batches: int, batch: int, seq: int,
                layers: int) -> dict[str, float]:
    """This process's peak resident memory over a few steps of ``mode`` alone (a world of
    its own: the peak is a high-water mark), less what it held once the model was built."""
    model = _model(layers)
    model.train()
    batches = _micro_batches(rank, micro_batches, batch, seq)
    _set(model, mode)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        _step(model, mode, batches)

    return peak_above_built(step)


def peak_above_built(step: Any, steps: int = 3) -> dict[str, float]:
    """Resident memory now (what is built), then this process's peak over ``steps`` calls
    of ``step()`` and how far above the built it is, in MiB."""
    import resource

    with open("/proc/self/statm") as f:
        built = int(f.read().split()[1]) * resource.getpagesize() / 2**20
    for _ in range(steps):
        step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"built_mib": built, "peak_mib": peak, "above_mib": peak - built}


def rank_gantt(rank: int, world: int, modes: tuple[str, ...], micro_batches: int, batch: int,
               seq: int, layers: int) -> dict[str, list[Any]]:
    """One profiled step of each mode (after its warm-up): its spans, on this rank."""
    model = _model(layers)
    model.train()
    batches = _micro_batches(rank, micro_batches, batch, seq)
    spans = {}
    for mode in modes:
        _set(model, mode)
        _step(model, mode, batches)
        until_auto_locked(lambda m=mode: _step(model, m, batches[:1]))
        _step(model, mode, batches)
        model.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        with mc2.profile() as prof:
            _step(model, mode, batches)
        spans[mode] = list(prof.spans)
    return spans


def rank_phases(rank: int, world: int, micro_batches: int, batch: int, seq: int, steps: int,
                rounds: int, modes: tuple[str, ...], layers: int) -> dict[str, Any]:
    """Where a step's time goes, phase by phase, in wall-clock seconds on this rank: the
    paired step's first forward (alone), each pair (micro-batch n+1's forward beside n's
    backward) and last backward (alone), timed around ``PairedLoop``'s own calls; and the
    serial loop's forward and backward of each micro-batch. Against the serial loop's
    phases on plain loopback (nothing exposed) each paired phase's excess is what it leaves
    of the link uncovered, or what it costs more to compute. ``modes`` is ignored."""
    import time

    from mc2.engine.autograd import pairing

    model = _model(layers)
    model.train()
    batches = _micro_batches(rank, micro_batches, batch, seq)
    adds: list[tuple[float, float, float]] = []  # each add's start, last backward's, end
    add = pairing.PairedLoop._add

    def timed_add(self: Any, forward: Any, last: bool) -> Any:
        backward, begun = self._backward, [0.0]

        def timed_backward(out: Any) -> None:  # the last one an add runs: alone if `last`
            begun[0] = time.perf_counter()
            backward(out)

        self._backward = timed_backward
        start = time.perf_counter()
        try:
            return add(self, forward, last)
        finally:
            adds.append((start, begun[0], time.perf_counter()))
            self._backward = backward

    pairing.PairedLoop._add = timed_add

    def paired() -> list[float]:
        """[first forward, pair 1, ..., pair N-1, last backward]."""
        adds.clear()
        _step(model, "paired", batches)
        *whole, (start, alone, end) = adds
        return [e - s for s, _, e in whole] + [alone - start, end - alone]

    def serial() -> list[float]:
        """[forward 1, backward 1, ..., forward N, backward N]."""
        phases = []
        for ids in batches:
            start = time.perf_counter()
            loss = _loss(model, ids)
            mid = time.perf_counter()
            loss.backward()
            phases += [mid - start, time.perf_counter() - mid]
        return phases

    runs = {"paired": paired, "serial": serial}
    for mode in runs:
        _set(model, mode)
        runs[mode]()
        until_auto_locked(lambda m=mode: _step(model, m, batches[:1]))
    out: dict[str, list[list[float]]] = {m: [] for m in runs}
    for _ in range(rounds):
        for mode, run in runs.items():
            _set(model, mode)
            run()  # untimed at every switch
            for _ in range(steps):
                model.zero_grad(set_to_none=True)
                torch.distributed.barrier()
                out[mode].append(run())
    return {"phases": out}


def print_phases(regime: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Each phase's median over the steps, the slower rank's; printed, and returned."""
    result = {}
    for mode in ranks[0]["phases"]:
        per_rank = [[statistics.median(p) for p in zip(*r["phases"][mode])] for r in ranks]
        result[mode] = [max(v) for v in zip(*per_rank)]
        print(f"{regime:>8} {mode:>7}: " + " ".join(f"{t:.2f}" for t in result[mode])
              + f"  (sum {sum(result[mode]):.2f} s)", flush=True)
    return result


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    steps = {}
    for mode in ranks[0]["times"]:
        slowest = [max(v) for v in zip(*(r["times"][mode] for r in ranks))]
        steps[mode] = {"median_s": statistics.median(slowest), "steps_s": slowest}
    return {"steps": steps, **{k: v for k, v in ranks[0].items() if k != "times"}}


def bounds(results: dict[str, Any]) -> dict[str, Any]:
    """Per shaped regime: ``T_comp`` (serial, plain), ``T_comm`` (serial shaped minus plain),
    the bound and each mode against it and against the in-layer loop."""
    if "plain" not in results or "serial" not in results["plain"]["steps"]:
        return {}
    t_comp = results["plain"]["steps"]["serial"]["median_s"]
    out = {}
    for regime, result in results.items():
        steps = {m: s["median_s"] for m, s in result["steps"].items()}
        t_comm = max(steps["serial"] - t_comp, 0.0) if regime != "plain" else 0.0
        bound = max(t_comp, t_comm)
        out[regime] = {"T_comp": t_comp, "T_comm": t_comm, "bound": bound,
                       "vs_bound": {m: s / bound for m, s in steps.items()},
                       "vs_mc2": {m: s / steps["mc2"] for m, s in steps.items()
                                  if "mc2" in steps}}
    return out


def step_parser(doc: str, regimes: str, modes: tuple[str, ...], *,
                memory: bool = False) -> argparse.ArgumentParser:
    """The options of an accumulation benchmark's step (what :func:`measure_regimes` reads);
    with ``memory``, ``--memory`` too (what :func:`measure_memory` runs instead)."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regimes", default=regimes)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1, help="timed steps per mode and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=",".join(modes))
    parser.add_argument("--json", type=Path, default=None)
    if memory:
        parser.add_argument("--memory", action="store_true",
                            help="instead: each mode's peak resident memory above the built "
                                 "model, a world per mode (plain loopback)")
    return parser


def measure_memory(rank_fn: Any, args: argparse.Namespace) -> dict[str, Any]:
    """``rank_fn(rank, world, mode, micro_batches, batch, seq, layers)`` (a mode's peak
    resident memory) in a 2-rank world of its own per mode of ``--modes``, the larger rank's,
    printed and written to ``--json``."""
    memory = {}
    for mode in args.modes.split(","):
        ranks = mc2.run_local(rank_fn, 2, args=(
            mode, args.micro_batches, args.batch, args.seq, args.layers), timeout_s=3600)
        memory[mode] = {k: max(r[k] for r in ranks) for k in ranks[0]}
        print(f"{mode:>10}: peak {memory[mode]['peak_mib']:.0f} MiB, "
              f"{memory[mode]['above_mib']:.0f} MiB above the built model "
              f"({memory[mode]['built_mib']:.0f} MiB; the larger rank)", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "memory_mib": memory}, indent=1))
    return memory


def main() -> int:
    parser = step_parser(__doc__, "plain,200mbit,100mbit", MODES, memory=True)
    parser.add_argument("--gantt", type=Path, default=None,
                        help="instead: a Gantt picture of one step of each mode, in the first "
                             "regime given (PNG)")
    parser.add_argument("--phases", action="store_true",
                        help="instead: where the paired step's time goes, phase by phase "
                             "(its first forward, each pair, its last backward) against the "
                             "serial loop's forward and backward of each micro-batch")
    args = parser.parse_args()
    if args.phases:
        measure_phases(args)
        return 0
    if args.gantt:
        from mc2.observation.plot import plot_gantt

        regime = args.regimes.split(",")[0]
        modes = tuple(args.modes.split(","))
        run = lambda: mc2.run_local(rank_gantt, 2, args=(  # noqa: E731
            modes, args.micro_batches, args.batch, args.seq, args.layers), timeout_s=3600)
        if regime == "plain":
            ranks = run()
        else:
            with ShapedLoopback(regime, latency=LATENCY.get(regime, "200ms")):
                ranks = run()
        plot_gantt({m: [r[m] for r in ranks] for m in modes}, args.gantt,
                   title=f"one step of {args.micro_batches} micro-batches, {regime}: forward "
                         "(solid) and backward (light), per micro-batch")
        print(f"wrote {args.gantt}")
        return 0
    if args.memory:
        measure_memory(rank_memory, args)
        return 0
    measure_regimes(rank_steps, args, tuple(args.modes.split(",")), serial="serial")
    return 0


def measure_phases(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`rank_phases` in each of ``--regimes``, printed and written to ``--json``."""
    results = {}
    for regime, ranks in in_regimes(rank_phases, args, ()):
        results[regime] = print_phases(regime, ranks)
        if args.json:
            args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                             "phases_s": results}, indent=1))
    return results


def in_regimes(rank_fn: Any, args: argparse.Namespace,
               modes: tuple[str, ...]) -> Iterator[tuple[str, list[Any]]]:
    """``(regime, ranks)``: ``rank_fn(rank, world, micro_batches, batch, seq, steps, rounds,
    modes, layers)`` on 2 ranks in each of ``--regimes`` in turn (shaped ones with ``tc``,
    always removed), each rank's result."""
    regimes = args.regimes.split(",")
    if any(r != "plain" for r in regimes) and (why := can_shape()):
        raise SystemExit(f"shaped regimes: {why}")
    for regime in regimes:
        print(f"== {regime}", file=sys.stderr, flush=True)
        run = lambda: mc2.run_local(rank_fn, 2, args=(  # noqa: E731
            args.micro_batches, args.batch, args.seq, args.steps, args.rounds, modes,
            args.layers), timeout_s=3600, deadline_s=6 * 3600)
        if regime == "plain":
            yield regime, run()
        else:
            with ShapedLoopback(regime, latency=LATENCY.get(regime, "200ms")):
                ranks = run()
            yield regime, ranks


def measure_regimes(rank_fn: Any, args: argparse.Namespace, modes: tuple[str, ...],
                    serial: str) -> dict[str, Any]:
    """``rank_fn(rank, world, micro_batches, batch, seq, steps, rounds, modes, layers)`` on 2
    ranks in each of ``--regimes`` (shaped ones with ``tc``, always removed), printed, with
    the bounds taken from mode ``serial`` (the synchronous loop), and written to ``--json``
    after each regime."""
    results: dict[str, Any] = {}

    def bounds_now() -> dict[str, Any]:
        return bounds({r: {"steps": {("serial" if m == serial else m): s
                                     for m, s in res["steps"].items()}}
                       for r, res in results.items()})

    for regime, ranks in in_regimes(rank_fn, args, modes):
        results[regime] = summarize(ranks)
        for mode, s in results[regime]["steps"].items():
            print(f"{regime:>8} {mode:>8}: {s['median_s']:.2f} s  "
                  f"({', '.join(f'{t:.2f}' for t in s['steps_s'])})", flush=True)
        if args.json:
            args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                             "results": results, "bounds": bounds_now()},
                                            indent=1))
    for regime, b in bounds_now().items():
        print(f"{regime}: T_comp {b['T_comp']:.2f} s, T_comm {b['T_comm']:.2f} s, bound "
              f"{b['bound']:.2f} s; step / bound "
              + ", ".join(f"{m} {v:.3f}" for m, v in b["vs_bound"].items())
              + "; / mc2 " + ", ".join(f"{m} {v:.3f}" for m, v in b["vs_mc2"].items()))
    return results


if __name__ == "__main__":
    sys.exit(main())
