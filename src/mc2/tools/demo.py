"""``mc2 demo``: what MC2 does, and what its default does, in about a minute.

Two measurements in one command, because one alone misleads:

1. **Plain loopback** (2 Gloo ranks on this machine). The All-to-All is a memory copy here, so
   the serial comm share is a few percent and no split can pay; the table shows the fixed K rows
   slower than serial *and* the default, ``micro_batches="auto"``, which measures that and keeps
   K = 1 (the line under the table says which K it locked and how it compares with serial round
   by round, so "no slower, within noise" is a measured claim, not a promise).
2. **The article's regime**: two emulated nodes, each in its own network namespace, joined by a
   tc-shaped link whose rate is chosen so that the serial comm share lands near the article's
   47% (the rate comes from this run's loopback compute time and the bytes each step sends
   across; the comm share printed is the one measured). Then the article's table: comm share
   and tokens/s, serial against MC2 (auto and the best fixed K), with speedup and hidden
   fraction. Nothing of the host's network is touched (:mod:`mc2.tools.netns`). Without root
   or iproute2 one line says why and what to run, and the simulator's prediction for the
   article's own setup (Atlas 800I A2, Mixtral 8x7B) stands in.

Where matplotlib is installed the Gantt picture (serial vs the best MC2 mode) of the run that
shows the overlap is written too. All numbers are measured in the run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from mc2.observation import metrics
from mc2.tools.bench import BenchConfig, BenchReport, ModeResult, format_modes, run_bench
from mc2.tools.netns import EmulatedCluster, NetnsError
from mc2.tools.netns import cluster_problem  # here too: tests replace demo.cluster_problem

# The demo's problem: a Mixtral-shaped layer (8 experts, top-2, SwiGLU) scaled so that one
# forward+backward step takes a few hundred ms on one CPU thread, and both parts fit a minute.
# K = 8 (64 tokens a micro-batch) is left to --micro-batches: it lost to K = 2 and 4 in both
# regimes here and costs a fifth of the minute.
DEMO = BenchConfig(tokens_per_rank=512, hidden=512, ffn=1024, experts=8, topk=2,
                   micro_batches=(2, 4), repeats=5, warmup=1, auto=True, trace_overhead=False)
ARTICLE_SHARE = 0.47  # the article's no-fusion comm share (Atlas 800I A2, Mixtral 8x7B)
ARTICLE_MC2_SHARE = 0.18  # ... and MC2's on one node
# Bytes on the wire per byte of payload: TCP/IP and Ethernet headers at MTU 1500 (66 of 1514).
WIRE_OVERHEAD = 1514 / 1448
GANTT_DIR = Path("out/demo")


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's own flags (the problem flags come from the shared bench arguments)."""
    p.add_argument("--no-cluster", action="store_true",
                   help="skip part 2 (the emulated two-node cluster); the simulator's "
                        "prediction for the article's setup is printed instead")
    p.add_argument("--comm-share", type=_share, default=ARTICLE_SHARE,
                   help="the serial comm share the emulated link is shaped for when "
                        "--inter-node-bandwidth is auto (default %(default)s, the article's)")
    p.add_argument("--no-gantt", action="store_true",
                   help=f"do not profile a step per mode or draw the Gantt picture (default: "
                        f"drawn into {GANTT_DIR}/ where matplotlib is installed; --trace DIR "
                        "chooses the folder)")
    p.set_defaults(inter_node_bandwidth="auto", auto=True)


def _share(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"a comm share is between 0 and 1, got {text!r}")
    return value


def link_bytes_per_step(cfg: BenchConfig, world: int, ranks_per_node: int) -> float:
    """Bytes one node sends over its link in one forward+backward step, on average.

    Each rank routes ``tokens x topk`` rows of ``hidden`` elements; with the bench's uniform
    random routing the share of them bound for experts on other nodes is
    ``(world - ranks_per_node) / world``. Four exchanges carry them: dispatch and combine
    forward, and their gradients backward."""
    elem = torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
    rows = cfg.tokens_per_rank * cfg.topk * (world - ranks_per_node) / world
    return 4 * ranks_per_node * rows * cfg.hidden * elem


def rate_for_share(loop: BenchReport, cfg: BenchConfig, share: float, world: int,
                   ranks_per_node: int) -> tuple[str, str]:
    """The tc rate at which the serial step's comm share should come out near ``share``, and
    how it was derived (printed, so the choice is visible).

    ``share = T_comm / (T_comp + T_comm)`` gives ``T_comm = share / (1 - share) * T_comp``;
    ``T_comp`` and the loopback part of ``T_comm`` are the loopback serial row's, the rest must
    be the link's: ``bytes x 8 x header overhead / rate``."""
    serial = loop.serial
    comp = serial.step_s - serial.exposed_comm_s
    want = share / (1 - share) * comp
    link_s = max(want - serial.exposed_comm_s, 0.1 * comp)
    nbytes = link_bytes_per_step(cfg, world, ranks_per_node)
    mbit = max(1, round(nbytes * 8 * WIRE_OVERHEAD / link_s / 1e6))
    why = (f"chosen for a serial comm share near {share:.0%}: the loopback serial step computes "
           f"{comp * 1e3:.0f} ms, so the link should take ~{link_s * 1e3:.0f} ms for the "
           f"{nbytes / 2**20:.1f} MiB each node sends per step")
    return f"{mbit}mbit", why


NOISE_FLOOR = 0.01  # ratios within 1% of 1 count as equal whatever the spread says


def paired_ratio(report: BenchReport, mode: str) -> tuple[float, float]:
    """``mode``'s step time over serial's, round by round (both ran in every round, side by
    side, so machine noise that hits a round hits both): the median ratio and the median
    absolute deviation of the ratios (their spread, robust to one disturbed round)."""
    pairs = [m / s for m, s in zip(report.step_samples[mode], report.step_samples["serial"])]
    mid = metrics.median(pairs)
    return mid, metrics.median(abs(r - mid) for r in pairs)


def auto_line(report: BenchReport) -> str:
    """What K ``"auto"`` locked and how it compares with serial, in this run's own noise: equal
    when the median paired ratio is within twice the ratios' spread (or 1%) of 1."""
    auto = report.result("mc2 auto")
    ratio, spread = paired_ratio(report, auto.mode)
    noise = max(2 * spread, NOISE_FLOOR)
    if ratio > 1 + noise:
        verdict = "SLOWER than serial, beyond this run's noise"
    elif ratio < 1 - noise:
        verdict = "faster than serial, beyond this run's noise"
    else:
        verdict = "no slower than serial, within this run's noise"
    best = report.best_fixed
    split = ("keeps K = 1 (no split)" if report.auto_k == 1
             else f"splits into K = {report.auto_k}")
    trials = ", ".join(f"K={k} {t * 1e3:.0f} ms" for k, t in sorted(report.auto_trials.items()))
    return (f"mc2's default, micro_batches='auto', {split} here: its model ranked the K, "
            f"{report.explore_calls} untimed calls tried the best few (median trial, slowest rank: "
            f"{trials or 'none recorded'}) and it locked K={report.auto_k}; auto/serial step "
            f"time {ratio:.3f} (median of the rounds' ratios, spread +-{spread:.3f}): "
            f"{verdict}. Best fixed K: {best.mode} at {best.speedup:.3f}x serial's speed.")


def article_table(report: BenchReport) -> str:
    """The article's table, measured: serial vs MC2 (auto and the best fixed K)."""
    auto, best = report.result("mc2 auto"), report.best_fixed
    rows: list[tuple[str, ModeResult, str]] = [
        ("no fusion (serial)", report.serial, f"{ARTICLE_SHARE:.0%}"),
        (f"MC2, default (auto, locked K={report.auto_k})", auto, f"{ARTICLE_MC2_SHARE:.0%}"),
        (f"MC2, best fixed K (K={best.micro_batches})", best, f"{ARTICLE_MC2_SHARE:.0%}"),
    ]
    cols = ("config", "comm share", "tokens/s/rank", "step ms", "speedup", "hidden",
            "article comm share")
    table = [cols] + [(name, f"{r.comm_share * 100:.1f}%", f"{r.tokens_per_s_per_rank:,.0f}",
                       f"{r.step_s * 1e3:.1f}", f"{r.speedup:.3f}x",
                       "-" if r is report.serial else f"{r.hidden_fraction:.2f}", art)
                      for name, r, art in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    lines = [" | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths))) for row in table]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    share = report.serial.comm_share
    lines.append(f"serial comm share {share * 100:.1f}%: overlap alone can give at most "
                 f"1/(1-{share:.3f}) = {metrics.overlap_bound(share):.2f}x; MC2 reached "
                 f"{auto.speedup:.2f}x (auto) and {best.speedup:.2f}x ({best.mode}). hidden = "
                 "(T_serial - T_mc2) / (T_serial - max(T_comp, T_comm)); 1 = all hideable "
                 "communication hidden.")
    return "\n".join(lines)


def _predict(prediction: Callable[[], object] | None) -> None:
    """The simulator's prediction for the article's setup (``mc2 simulate``'s defaults: Atlas
    800I A2, Mixtral 8x7B), which the command line hands in (``prediction``)."""
    print("the simulator's prediction for the article's setup instead (`mc2 simulate`: "
          "Atlas 800I A2, Mixtral 8x7B):")
    if prediction is not None:
        prediction()


_stage = partial(print, file=sys.stderr, flush=True)  # what the demo is doing now


def _gantt_folder(args: argparse.Namespace) -> tuple[Path | None, str]:
    """Where to draw the Gantt picture, or ``None`` and why not."""
    if args.trace is not None:
        return args.trace, ""
    if args.no_gantt:
        return None, "no Gantt picture (--no-gantt)"
    if importlib.util.find_spec("matplotlib") is None:
        return None, "no Gantt picture: matplotlib is not installed (pip install 'mc2[plot]')"
    return GANTT_DIR, ""


def run_demo(args: argparse.Namespace, cfg: BenchConfig,
             prediction: Callable[[], object] | None = None) -> int:
    """Part 1 (loopback, fixed K and auto), part 2 (the emulated cluster, or why not and the
    simulator's prediction), the Gantt picture and the wall time; 0 on success."""
    from mc2.tools.traces import write_traces

    start = time.monotonic()
    cfg = replace(cfg, auto=True, quiet=True)
    nodes, per_node = args.nodes or 2, args.ranks_per_node or 1
    why_not = "--no-cluster" if args.no_cluster else cluster_problem()
    folder, no_gantt = _gantt_folder(args)
    ks = ", ".join(f"K={k}" for k in cfg.micro_batches)
    rounds = f"{cfg.warmup} warm-up + {cfg.repeats} timed rounds, every mode once per round"
    _stage(f"mc2 demo: Mixtral-shaped MoE layer scaled to CPU; serial, MC2 {ks} and auto; "
           f"{rounds}")

    _stage(f"part 1: {args.world_size} Gloo ranks on plain loopback ...")
    loop = run_bench(replace(cfg, trace=folder is not None and why_not is not None),
                     world_size=args.world_size, threads=args.threads)
    loop_s = time.monotonic() - start
    print(f"1. plain loopback, {args.world_size} ranks on this machine: the All-to-All is a "
          "memory copy")
    print(format_modes(loop))
    print(auto_line(loop))
    print()

    cluster: BenchReport | None = None
    rate = why = ""
    cluster_start = time.monotonic()
    if why_not is not None:
        print(f"2. the article's regime: not measured here: {why_not}")
        _predict(prediction)
    else:
        world = nodes * per_node
        if args.inter_node_bandwidth == "auto":
            rate, why = rate_for_share(loop, cfg, args.comm_share, world, per_node)
        else:
            rate, why = args.inter_node_bandwidth, "as given (--inter-node-bandwidth)"
        _stage(f"part 2: {nodes} emulated nodes x {per_node} rank(s), link shaped to {rate} ...")
        try:
            with EmulatedCluster(nodes, per_node, rate) as built:
                cluster = run_bench(replace(cfg, trace=folder is not None), world_size=world,
                                    threads=args.threads, ranks_per_node=per_node,
                                    rank_env=built.rank_environment)
        except (NetnsError, ValueError) as exc:
            print(f"2. the article's regime: the emulated cluster failed: {exc}")
            _predict(prediction)
        else:
            print(f"2. the article's regime: {nodes} emulated nodes x {per_node} rank(s), each "
                  f"node in its own network namespace, the link between them shaped to {rate} "
                  f"({why})")
            print(format_modes(cluster))
            print(auto_line(cluster))
            print()
            print("the article's table, measured here (the article: Atlas 800I A2, Mixtral "
                  "8x7B; its tokens/s are not comparable with a CPU's):")
            print(article_table(cluster))
    cluster_s = time.monotonic() - cluster_start

    shown = cluster if cluster is not None else loop
    print()
    if folder is not None and shown.traces:
        paths = write_traces(shown, folder)
        where = "the emulated cluster" if shown is cluster else "loopback"
        print(f"Gantt picture (serial vs {shown.best.mode}, {where}, one profiled step each, "
              f"rank by rank): {paths[1]}; Chrome trace {paths[0]}, metrics {paths[2]}")
    elif no_gantt:
        print(no_gantt)
    if args.json:  # both parts
        data: dict[str, Any] = {"loopback": loop.to_dict()}
        if cluster is not None:
            data["cluster"] = {**cluster.to_dict(), "link_rate": rate}
        args.json.write_text(json.dumps(data, indent=2))
        print(f"wrote {args.json}")
    total = time.monotonic() - start
    part2 = "emulated cluster" if cluster is not None else "part 2"
    print(f"demo wall time {total:.0f} s (loopback {loop_s:.0f} s, {part2} {cluster_s:.0f} s)")
    return 0
