#!/usr/bin/env python
"""Batch overlap across decoder layers against MC2 inside each layer, on a whole model.

A Mixtral-shaped Hugging Face model scaled to this machine (hidden 1024, ffn 2048, 8 experts,
top-2, 8 attention heads, 2 decoder layers, sequences of 512, ``--tokens`` per rank), 2 ranks,
plain processes, forward + backward (no optimizer step), one world per regime with the three
modes interleaved over ``--rounds`` (each mode's block of ``--steps`` after one untimed step:
its steady state, as a job that runs one mode has it):

- ``serial``: every fused call synchronous, K = 1 (the step ``T_serial``; its All-to-All time,
  measured from the calls' spans, is ``T_comm``, and ``T_comp = T_serial - T_comm``);
- ``mc2``: MC2 inside each layer (``micro_batches="auto"``);
- ``batch``: batch overlap (``enable_mc2(..., batch_overlap=True)``): two micro-batches
  interleaved across the layers, forward and backward;
- ``auto`` (with ``--auto``): ``batch_overlap="auto"``, which times its first forwards both
  ways (warm-up here) and keeps the faster schedule.

Columns (ratios measured in one run, interleaved): step time (median), exposed communication
``step - T_comp``, the comm share ``exposed / step``, ``T_comp``, ``T_comm``, the bound
``max(T_comp, T_comm)``, step / bound, tokens/s per rank; and the bound pass by pass,
``max(fwd comp, fwd comm) + max(bwd comp, bwd comm)`` (a backward cannot start before its
forward ends: a forward with more communication than compute cannot hide the excess under the
backward's compute), with step / that bound; and the bound of any schedule of two
micro-batches, ``T_comm`` plus the head and tail of one micro-batch, where the link has nothing
to carry (:func:`_split_bound`), with step / that bound (and, for a batch mode, step / the
bound of as many micro-batches as it runs). Regimes: plain loopback and loopback
shaped with ``tc tbf`` (root; always removed; 800 ms of tbf latency at 100 Mbit)::

    sudo .venv/bin/python benchmarks/model_overlap.py --regimes plain,500mbit,200mbit,100mbit \\
        --json docs/model_overlap.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import mc2  # noqa: E402
from compare_peers import ShapedLoopback, can_shape  # noqa: E402
from layer_rounds import until_auto_locked  # noqa: E402
from step_breakdown import print_breakdown, step_breakdown  # noqa: E402

MODES = ("serial", "mc2", "batch")
OPTIONAL_MODES = ("auto",)  # batch_overlap="auto": decides in its first forwards


def _splits(mode: str) -> int | None:
    """Micro-batches of a batch mode (2), ``None`` for the others."""
    return 2 if mode == "batch" else None

SHAPE = dict(vocab_size=256, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=8, num_local_experts=8,
             num_experts_per_tok=2, max_position_embeddings=1024, tie_word_embeddings=False)
SEQ = 512
LATENCY = {"100mbit": "800ms"}


def _model(layers: int = SHAPE["num_hidden_layers"]) -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    from mc2.integrations.transformers import enable_mc2

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**(SHAPE | {"num_hidden_layers": layers})))
    enable_mc2(model, micro_batches="auto", batch_overlap=True, min_tokens=1)
    return model


_AUTO: dict[str, Any] = {}


def _set_mode(model: Any, mode: str) -> None:
    from mc2.engine.decide.batch_split import BatchOverlapDecision as Decision
    from mc2.integrations.transformers import MC2SparseMoeBlock

    blocks = [b for b in model.modules() if isinstance(b, MC2SparseMoeBlock)]
    for block in blocks:
        block.config = block.config.replace(
            overlap=mode != "serial", micro_batches=1 if mode == "serial" else "auto")
    layers = model.model.layers
    if mode == "auto":  # one decision for the whole run, as a job would have
        if "decision" not in _AUTO:
            _AUTO["decision"] = Decision("auto", min_tokens=1, group=blocks[0].group)
        layers.decision = _AUTO["decision"]
        return
    splits = _splits(mode)
    layers.decision = Decision(splits is not None, min_tokens=1, group=blocks[0].group)


def _step(model: Any, mode: str, ids: torch.Tensor, clock: Any = None) -> Any:
    """One training step's forward and backward in ``mode``; the clock's stamp between the
    two."""
    loss = model(ids, labels=ids, use_cache=False).loss
    middle = clock.stamp() if clock is not None else None
    loss.backward()
    return middle


def rank_steps(rank: int, world: int, tokens: int, steps: int, rounds: int,
               modes: tuple[str, ...] = MODES, layers: int = SHAPE["num_hidden_layers"],
               seq: int = SEQ) -> dict[str, Any]:
    """Every mode's step times, the serial mode's communication time, and every timed step's
    breakdown (:mod:`step_breakdown`) and the last one's spans, on this rank."""
    from mc2.device.clock import clock_for

    model = _model(layers)
    model.train()
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, SHAPE["vocab_size"], (tokens // seq, seq), generator=g)
    clock = clock_for(torch.device("cpu"))
    times: dict[str, list[float]] = {m: [] for m in modes}
    forward: dict[str, list[float]] = {m: [] for m in modes}
    comm: list[float] = []
    comm_forward: list[float] = []
    head: list[float] = []  # serial steps: start to the first collective
    tail: list[float] = []  # serial steps: the last collective's end to the end
    breakdowns: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    last_spans: dict[str, list[Any]] = {}
    for mode in modes:  # warm up every mode (and let "auto" settle its K, or decide)
        _set_mode(model, mode)
        for _ in range(2 if mode == "mc2" else 1):
            _step(model, mode, ids)
        until_auto_locked(lambda m=mode: _step(model, m, ids))  # the layers' micro_batches="auto"
        while mode == "auto" and _AUTO["decision"].chosen is None:
            _step(model, mode, ids)
    for _ in range(rounds):
        for mode in modes:
            _set_mode(model, mode)
            # one step untimed at every switch: batch overlap's calls use buffers of half the
            # size, so the first step after a switch reallocates the workspace (page-faulted
            # anew, mc2.engine.transport.workspace); measured without it, "auto" having chosen MC2 (the
            # same code as mc2) ran 1.5-8% slower than mc2, right after batch overlap's steps.
            # A job runs one mode: its steady state is the one to compare
            _step(model, mode, ids)
            for _ in range(steps):
                model.zero_grad(set_to_none=True)
                torch.distributed.barrier()
                with mc2.profile() as prof:
                    start = clock.stamp()
                    middle = _step(model, mode, ids, clock)
                    end = clock.stamp()
                times[mode].append(clock.elapsed(start, end))
                breakdowns[mode].append(step_breakdown(
                    prof.spans, clock.seconds(start), clock.seconds(middle), clock.seconds(end)))
                last_spans[mode] = list(prof.spans)
                if middle is not None:
                    forward[mode].append(clock.elapsed(start, middle))
                if mode == "serial":
                    spans = [s for s in prof.spans if s.kind == "comm"]
                    comm.append(prof.timeline.total("comm"))
                    comm_forward.append(sum(s.duration for s in spans if s.phase == "forward"))
                    last = max(s.end for s in spans)
                    # the weight gradients the serial schedule runs after the last transfer
                    # need nothing from it: an overlapped schedule runs them before
                    movable = sum(s.duration for s in prof.spans
                                  if s.name == "deferred" and s.start >= last)
                    head.append(min(s.start for s in spans) - clock.seconds(start))
                    tail.append(clock.seconds(end) - last - movable)
    chosen = _AUTO["decision"].chosen if "decision" in _AUTO else None
    return {"times": times, "forward": forward, "comm": comm, "comm_forward": comm_forward,
            "head": head, "tail": tail, "auto_chose_batch": chosen, "breakdowns": breakdowns,
            "last_spans": last_spans}


def _agreed(ranks: list[dict[str, Any]], key: str, mode: str | None = None) -> list[float]:
    """Per step, the slowest rank (a step ends when every rank is done)."""
    series = [r[key][mode] if mode else r[key] for r in ranks]
    return [max(values) for values in zip(*series)]


def _pass_bound(ranks: list[dict[str, Any]]) -> dict[str, float]:
    """The bound pass by pass: a backward cannot start before its forward ends, so
    communication the forward has too much of cannot hide under the backward's compute.
    ``max(fwd comp, fwd comm) + max(bwd comp, bwd comm)``, from the serial steps."""
    serial_fwd = statistics.median(_agreed(ranks, "forward", "serial"))
    serial = statistics.median(_agreed(ranks, "times", "serial"))
    comm_fwd = statistics.median(_agreed(ranks, "comm_forward"))
    comm = statistics.median(_agreed(ranks, "comm"))
    comp_fwd, comp_bwd = serial_fwd - comm_fwd, serial - serial_fwd - (comm - comm_fwd)
    comm_bwd = comm - comm_fwd
    return {"comp_forward": comp_fwd, "comm_forward": comm_fwd, "comp_backward": comp_bwd,
            "comm_backward": comm_bwd,
            "bound": max(comp_fwd, comm_fwd) + max(comp_bwd, comm_bwd)}


def _split_bound(ranks: list[dict[str, Any]], t_comp: float, t_comm: float, splits: int = 2
                 ) -> dict[str, float]:
    """What no schedule of ``splits`` micro-batches can beat, whatever it overlaps (1F1B,
    DualPipe); two unless said.

    The link carries ``T_comm``, and it is idle before the first micro-batch has computed what
    it sends first (its embedding, layer 0's attention and router: the *head*) and after the
    last transfer, which leaves its micro-batch's layer-0 attention backward (and the
    embedding's) still to compute (the *tail*):
    ``max(T_comp, T_comm + (head + tail) / splits)``. Head and tail come from the serial steps
    (the whole batch: from the step's start to its first collective, and from its last
    collective's end to the step's end, less the expert weight gradients the serial schedule
    runs there), divided among the micro-batches' sequences."""
    head = statistics.median(_agreed(ranks, "head"))
    tail = statistics.median(_agreed(ranks, "tail"))
    return {"head": head, "tail": tail,
            "bound": max(t_comp, t_comm + (head + tail) / splits)}


def summarize(ranks: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    t_comm = statistics.median(_agreed(ranks, "comm"))
    steps = {m: statistics.median(_agreed(ranks, "times", m)) for m in ranks[0]["times"]}
    forwards = {m: statistics.median(_agreed(ranks, "forward", m)) for m in ranks[0]["times"]}
    t_comp = steps["serial"] - t_comm
    bound = max(t_comp, t_comm)
    by_pass = _pass_bound(ranks)
    two = _split_bound(ranks, t_comp, t_comm)
    rows = {}
    for mode in steps:
        exposed = max(steps[mode] - t_comp, 0.0)
        splits = _splits(mode)
        own = _split_bound(ranks, t_comp, t_comm, splits)["bound"] if splits else None
        rows[mode] = {"step_s": steps[mode], "forward_s": forwards[mode], "exposed_s": exposed,
                      "comm_share": exposed / steps[mode], "vs_bound": steps[mode] / bound,
                      "vs_pass_bound": steps[mode] / by_pass["bound"],
                      "vs_two_batch_bound": steps[mode] / two["bound"],
                      "vs_split_bound": None if own is None else steps[mode] / own,
                      "tokens_per_s_per_rank": tokens / steps[mode]}
    return {"T_comp": t_comp, "T_comm": t_comm, "bound": bound, "pass_bound": by_pass,
            "two_batch_bound": two,
            "rows": rows,
            "batch_vs_mc2": (steps["batch"] / steps["mc2"]
                             if "batch" in steps and "mc2" in steps else None),
            "auto_chose_batch": ranks[0]["auto_chose_batch"]}


def print_regime(name: str, result: dict[str, Any]) -> None:
    auto = result.get("auto_chose_batch")
    chose = "" if auto is None else f"; auto chose {'batch overlap' if auto else 'mc2'}"
    p = result["pass_bound"]
    ratio = result["batch_vs_mc2"]
    versus = "" if ratio is None else f"; batch / mc2 = {ratio:.3f}"
    print(f"\n{name}: T_comp {result['T_comp']:.3f} s, T_comm {result['T_comm']:.3f} s, "
          f"bound {result['bound']:.3f} s{versus}{chose}")
    print(f"  by pass: forward comp {p['comp_forward']:.3f} comm {p['comm_forward']:.3f}, "
          f"backward comp {p['comp_backward']:.3f} comm {p['comm_backward']:.3f}: "
          f"pass bound {p['bound']:.3f} s")
    two = result["two_batch_bound"]
    print(f"  two micro-batches: head {two['head']:.3f} s, tail {two['tail']:.3f} s (whole "
          f"batch): bound {two['bound']:.3f} s = {two['bound'] / result['bound']:.3f} of the bound")
    print(f"{'mode':<8}{'step s':>9}{'fwd s':>8}{'exposed s':>11}{'comm share':>12}"
          f"{'/ bound':>9}{'/ pass':>8}{'/ two':>7}{'/ own':>7}{'tok/s/rank':>12}")
    for mode, row in result["rows"].items():
        fwd = "-" if row["forward_s"] is None else f"{row['forward_s']:.3f}"
        print(f"{mode:<8}{row['step_s']:>9.3f}{fwd:>8}{row['exposed_s']:>11.3f}"
              f"{row['comm_share']:>12.0%}{row['vs_bound']:>9.2f}{row['vs_pass_bound']:>8.2f}"
              f"{row['vs_two_batch_bound']:>7.2f}"
              f"{'' if row['vs_split_bound'] is None else format(row['vs_split_bound'], '.2f'):>7}"
              f"{row['tokens_per_s_per_rank']:>12.0f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regimes", default="plain,500mbit,200mbit,100mbit",
                        help="plain, or tc tbf rates such as 500mbit (comma-separated)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank per step")
    parser.add_argument("--steps", type=int, default=2, help="steps per mode and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--auto", action="store_true",
                        help="also run batch_overlap='auto' (its trial forwards are warm-up)")
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"],
                        help="decoder layers (the fill and drain of batch overlap's passes are "
                             "paid once per pass, so their share falls with depth)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"modes to run, from {MODES}; serial is needed for the bound")
    parser.add_argument("--seq", type=int, default=SEQ, help="tokens per sequence")
    parser.add_argument("--breakdown", action="store_true",
                        help="print where each mode's step time goes, pass by pass "
                             "(benchmarks/step_breakdown.py; also in the JSON)")
    parser.add_argument("--trace", type=Path, default=None,
                        help="a folder: each regime's last step of every mode as a Chrome "
                             "trace (Perfetto), both ranks")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    regimes = args.regimes.split(",")
    if any(r != "plain" for r in regimes) and (why := can_shape()):
        raise SystemExit(f"shaped regimes: {why}")
    results = {}
    modes = tuple(args.modes.split(",")) + (OPTIONAL_MODES if args.auto else ())
    if "serial" not in modes or any(m not in MODES + OPTIONAL_MODES and _splits(m) is None
                                    for m in modes):
        raise SystemExit(f"--modes: from {MODES}, serial included (got {args.modes})")
    for regime in regimes:
        print(f"== {regime}", file=sys.stderr, flush=True)
        run = lambda: mc2.run_local(rank_steps, 2, args=(  # noqa: E731
            args.tokens, args.steps, args.rounds, modes, args.layers, args.seq), timeout_s=3600,
            deadline_s=6 * 3600)
        if regime == "plain":
            ranks = run()
        else:
            with ShapedLoopback(regime, latency=LATENCY.get(regime, "200ms")):
                ranks = run()
        results[regime] = summarize(ranks, args.tokens)
        results[regime]["breakdowns"] = {m: [r["breakdowns"][m] for r in ranks] for m in modes}
        print_regime(regime, results[regime])
        if args.breakdown:
            for mode in modes:
                print_breakdown(mode, results[regime]["breakdowns"][mode])
        if args.trace:
            from mc2.observation.profiler import write_chrome_trace

            args.trace.mkdir(parents=True, exist_ok=True)
            write_chrome_trace(args.trace / f"{regime}.json",
                               {m: [r["last_spans"][m] for r in ranks] for m in modes})
        sys.stdout.flush()
        if args.json:  # after every regime: a later one failing keeps the earlier ones
            _write(args, results)
    return 0


def _write(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """The run's arguments and every regime measured so far, as JSON."""
    shape = SHAPE | {"num_hidden_layers": args.layers}
    arguments = vars(args) | {"json": str(args.json), "trace": str(args.trace)}
    args.json.write_text(json.dumps({"shape": shape, "seq": args.seq, "args": arguments,
                                     "results": results}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
