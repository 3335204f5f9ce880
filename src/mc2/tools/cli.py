"""The ``mc2`` command line: ``demo``, ``bench``, ``plan``, ``simulate``, ``train``, ``doctor``."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Callable

import torch

from mc2.tools.bench import BenchConfig, BenchReport, format_plan, format_report, run_bench
from mc2.engine.decide.config import MC2Config
from mc2.engine.transport.wire import WireFormat, parse_wire_dtype, wire_problem
from mc2.tools.config_args import add_config_arguments, config_from_arguments
from mc2.tools.demo import DEMO, add_demo_arguments, run_demo
from mc2.tools.netns import EmulatedCluster, NetnsError
from mc2.tools.traces import write_traces
from mc2.tools.train import add_train_parser

PLAN = BenchConfig(micro_batches=(1, 2, 4, 8, 16), repeats=3, auto=True)
_BENCH_FIELDS = {f.name for f in fields(BenchConfig)}


def parse_ints(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``: positive integers, for argparse ``type=``."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _add_problem_args(p: argparse.ArgumentParser, base: BenchConfig) -> None:
    p.add_argument("--world-size", type=int, default=2, help="local Gloo ranks (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--tokens-per-rank", type=int, default=base.tokens_per_rank,
                   help=f"tokens each rank routes (batch x seq; default {base.tokens_per_rank})")
    p.add_argument("--hidden", type=int, default=base.hidden, help="model width")
    p.add_argument("--ffn", type=int, default=base.ffn, help="expert FFN width")
    p.add_argument("--experts", type=int, default=base.experts, help="global experts")
    p.add_argument("--topk", type=int, default=base.topk, help="experts per token")
    p.add_argument("--dtype", default=base.dtype, choices=["float32", "float64", "bfloat16"])
    p.add_argument("--micro-batches", type=parse_ints, default=base.micro_batches,
                   help="comma-separated K values to try with overlap (default %(default)s)")
    p.add_argument("--repeats", "--rounds", type=int, default=base.repeats,
                   help="timed rounds; each runs every mode once, in a rotating order, so noise "
                        "hits all modes alike (default %(default)s)")
    p.add_argument("--warmup", type=int, default=base.warmup,
                   help="untimed rounds before them (default %(default)s)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="present the ranks as nodes of this many ranks; alone, every link "
                        "stays loopback (topology only)")
    p.add_argument("--nodes", type=int, default=None,
                   help="emulate this many nodes, each in its own network namespace, joined by "
                        "tc-shaped links (needs root and iproute2); world = nodes x "
                        "--ranks-per-node")
    p.add_argument("--inter-node-bandwidth", default="2gbit",
                   help="tc rate of each node's link, e.g. 2gbit, 500mbit (default %(default)s;"
                        " this kernel has no netem, so latency cannot be emulated)")
    p.add_argument("--hierarchy", type=lambda t: tuple(t.split(",")), default=base.hierarchies,
                   help="All-to-All layouts to time MC2 with: flat, 2d or flat,2d")
    p.add_argument("--wire-dtype", type=lambda t: tuple(t.split(",")), default=base.wire_dtypes,
                   help="formats MC2's rows travel in, comma-separated: none (the compute "
                        "dtype), bf16, fp16, fp8 (e4m3 + fp32 scale per 128 channels), int8; "
                        "each adds its own MC2 rows (default none)")
    p.add_argument("--dedup", type=_dedups, default=base.dedups,
                   help="MC2 rows once per destination rank: off, on, or off,on for both "
                        "(each adds its own MC2 rows; default off)")
    p.add_argument("--auto", action="store_true", default=base.auto,
                   help="also time micro_batches='auto' (the planner)")
    p.add_argument("--split-sync", action="store_true",
                   help="also time K micro-batches without overlap, to separate split overhead")
    p.add_argument("--malloc-tuned", action="store_true",
                   help="tell glibc to keep freed memory in every rank (mallopt); off by default, "
                        "so the numbers are those of a plain process; labelled in the report")
    p.add_argument("--device", default=base.device,
                   help="cpu (default) or an accelerator type such as cuda: each rank computes on "
                        "its local device (ranks share one when there are fewer devices; Gloo "
                        "stages device tensors through the host)")
    add_config_arguments(p, skip=("micro_batches", "overlap", "hierarchy", "wire_dtype",
                                  "dedup", "capacity", "overflow"))
    p.add_argument("--json", type=Path, help="also write the report as JSON to this file")
    p.add_argument("--trace", type=Path, metavar="DIR",
                   help="profile one step per mode; write DIR/trace.json (Chrome/Perfetto, all "
                        "ranks), DIR/gantt.png (serial vs best MC2) and DIR/metrics.json")


def _dedups(text: str) -> tuple[bool, ...]:
    """``off``, ``on`` or ``off,on`` -> the dedup settings to time."""
    values = {"off": False, "on": True}
    parts = text.split(",")
    if not parts or set(parts) - set(values):
        raise argparse.ArgumentTypeError(f"--dedup takes off, on or off,on; got {text!r}")
    return tuple(values[p] for p in parts)


def _config(args: argparse.Namespace, base: BenchConfig) -> BenchConfig:
    """The flags as a :class:`BenchConfig`: those named as its fields go straight in, the
    swept ones by their plural, the rest of each call's :class:`MC2Config` from config_args."""
    call = config_from_arguments(args, default=MC2Config(gemm=base.gemm,
                                                         wire_block=base.wire_block))
    same = {k: v for k, v in vars(args).items() if k in _BENCH_FIELDS and k != "trace"}
    return replace(base, **same, trace=args.trace is not None, hierarchies=args.hierarchy,
                   wire_dtypes=args.wire_dtype, dedups=args.dedup,
                   **{k: getattr(call, k) for k in ("gemm", "wire_block", "timeout",
                                                    "check_finite")})


def _run(args: argparse.Namespace, base: BenchConfig, title: str,
         extra: Callable[[BenchReport], str] | None = None) -> int:
    cfg = _config(args, base)
    print(title, file=sys.stderr, flush=True)
    if args.nodes:
        per_node = args.ranks_per_node or 1
        with EmulatedCluster(args.nodes, per_node, args.inter_node_bandwidth) as cluster:
            print(f"emulated cluster: {args.nodes} nodes x {per_node} ranks, inter-node "
                  f"links shaped to {cluster.bandwidth}", file=sys.stderr, flush=True)
            report = run_bench(cfg, world_size=args.nodes * per_node, threads=args.threads,
                               ranks_per_node=per_node, rank_env=cluster.rank_environment)
    else:
        report = run_bench(cfg, world_size=args.world_size, threads=args.threads,
                           ranks_per_node=args.ranks_per_node)
    print(format_report(report))
    if extra is not None:
        print()
        print(extra(report))
    if args.json:
        args.json.write_text(json.dumps(report.to_dict(), indent=2))
        print(f"wrote {args.json}")
    if args.trace:
        for path in write_traces(report, args.trace):
            print(f"wrote {path}")
        print(f"profiler overhead: {report.profiler_overhead * 100:+.1f}% of a step")
    return 0


def _breakdown(args: argparse.Namespace, cfg: BenchConfig) -> int:
    from mc2.tools.breakdown import BreakdownConfig, format_breakdown, run_breakdown

    plain = BenchConfig()
    ignored = [flag for flag, mine, default in (
        ("--dtype", cfg.dtype, plain.dtype), ("--device", cfg.device, plain.device),
        ("--wire-dtype", cfg.wire_dtypes, plain.wire_dtypes), ("--dedup", cfg.dedups,
                                                                plain.dedups))
        if mine != default]
    if ignored:  # the breakdown's model runs float32 on the CPU, plain wire, no dedup
        print(f"mc2 bench --breakdown: {', '.join(ignored)} not supported with --breakdown "
              "(its model runs float32 on the CPU, rows in their dtype, once per expert); "
              "leave them out", file=sys.stderr)
        return 2

    seq = min(128, max(cfg.tokens_per_rank, 1))
    bcfg = BreakdownConfig(batch=max(1, cfg.tokens_per_rank // seq), seq=seq, hidden=cfg.hidden,
                           ffn=cfg.ffn, experts=cfg.experts, topk=cfg.topk,
                           micro_batches=cfg.micro_batches[0], repeats=cfg.repeats,
                           warmup=cfg.warmup)
    result = run_breakdown(bcfg, world_size=args.world_size, threads=args.threads)
    print(format_breakdown(result, bcfg))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mc2",
        description="Hide MoE All-to-All behind expert computation. demo, plan, bench and "
                    "train run a local multi-process Gloo world on this machine (loopback, or "
                    "emulated nodes with --nodes) and compare the serial path with the MC2 "
                    "pipeline, forward and backward; simulate predicts clusters you do not "
                    "have; doctor says what this machine offers.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    timed = {  # the commands that time a local world: (defaults, what runs, help, description)
        "demo": (DEMO, lambda a: run_demo(a, _config(a, DEMO), prediction=lambda: _simulate(
            build_parser().parse_args(["simulate"]))),
            "a Mixtral-shaped MoE layer scaled to CPU: serial vs MC2 on loopback and across two "
            "emulated nodes (about a minute)",
            "8 experts, top-2, SwiGLU, 512 tokens per rank, hidden 512, ffn 1024, forward+backward."
            " Part 1, plain loopback: serial vs MC2 with K = 2 and 4 and mc2's default "
            "micro_batches='auto' (which K it locked, and how it compares with serial round by "
            "round). Part 2, the article's regime: two nodes in their own network namespaces joined"
            " by a tc-shaped link (rate 'auto': chosen from part 1's compute time for a serial comm"
            " share near --comm-share, the article's 47%%), and the article's table: comm share and"
            " tokens/s, serial vs MC2 (auto and the best fixed K), speedup and hidden fraction. "
            "Part 2 needs root and iproute2 (ip, tc); without them, or with --no-cluster, it prints"
            " why and the simulator's prediction for the article's Atlas 800I A2 / Mixtral 8x7B. "
            "Where matplotlib is installed, the Gantt picture goes to out/demo/gantt.png. Prints "
            "its wall time."),
        "plan": (PLAN, lambda a: _run(a, PLAN, "mc2 plan", extra=format_plan),
                 "the planner's predicted step time for every K beside the measured one",
                 "Calibrates the cost model on a local Gloo world (link latency and "
                 "bandwidth, expert compute, interference), predicts forward+backward time "
                 "for each K, measures each K and micro_batches='auto', and prints them side "
                 "by side."),
        "bench": (BenchConfig(), lambda a: _breakdown(a, _config(a, BenchConfig()))
                  if a.breakdown else _run(a, BenchConfig(), "mc2 bench"),
                  "measure serial vs MC2 on a chosen problem (default: 4096 tokens/rank, "
                  "hidden 1024, ffn 2048)",
                  "Median step times of the serial path and MC2 for each K, in the same run."),
    }
    for name, (base, run, summary, description) in timed.items():
        timing = sub.add_parser(name, help=summary, description=description)
        _add_problem_args(timing, base)
        timing.set_defaults(run=run)
    add_demo_arguments(sub.choices["demo"])
    sub.choices["bench"].add_argument(
        "--breakdown", action="store_true",
        help="instead: split a Mixtral-like block's training step into the article's five "
             "parts (embedding + gate, dispatch, experts, combine, attention + residual + "
             "norm), serial vs MC2 with the first --micro-batches value")
    _add_simulate_parser(sub)
    add_train_parser(sub)
    sub.add_parser("doctor", help="what this machine offers MC2 and what to fix",
                   description="Backends and their async support, accelerators, the launcher's "
                               "environment, network interfaces and RDMA devices, then advice."
                   ).set_defaults(run=lambda a: _doctor())
    return parser


def _add_simulate_parser(sub: Any) -> None:
    sim = sub.add_parser(
        "simulate", help="predict comm share and throughput for clusters we do not have",
        description="Predicts a training step of an MoE model on a hardware preset: no fusion vs "
                    "MC2 on one node and across nodes (flat and hierarchical All-to-All), beside "
                    "the article's figures; --nodes with many values sweeps the cluster size; "
                    "--calibrate checks the model against this machine's measured runs.")
    sim.add_argument("--hardware", default="atlas-800i-a2",
                     help="preset name or a .toml file (shipped: %(default)s, atlas-800t-a2, "
                          "dgx-h100)")
    sim.add_argument("--model", default="mixtral-8x7b",
                     help="preset name or a .toml file (shipped: mixtral-8x7b, mixtral-8x22b, "
                          "deepseek-v3, qwen3-30b-a3b)")
    sim.add_argument("--nodes", type=parse_ints, default=(1, 2),
                     help="node counts, comma-separated (default 1,2); more than three values "
                          "prints the scale sweep")
    sim.add_argument("--tokens", type=int, default=4096, help="tokens per device per step")
    sim.add_argument("--seq", type=int, default=4096, help="sequence length (attention cost)")
    sim.add_argument("--skew", type=float, default=1.0,
                     help="busiest device's routed traffic / average (1 = uniform)")
    sim.add_argument("--plot", type=Path, help="write the scale sweep as a PNG")
    sim.add_argument("--wire-dtype", default="none",
                     help="format MC2's rows travel in: none (the model's dtype), bf16, fp16, "
                          "fp8 or int8 (1 byte + a 4-byte scale per --wire-block channels); "
                          "the no-fusion rows keep the model's dtype")
    sim.add_argument("--wire-block", type=int, default=128, help="channels per scale")
    sim.add_argument("--dedup", action="store_true",
                     help="MC2 sends a token once per destination rank (once per node across "
                          "nodes with 2d) and reduces there; prints the rows saved")
    sim.add_argument("--calibrate", action="store_true",
                     help="instead: measure this machine's Gloo world and compare the model's "
                          "predictions with mc2 bench's measured step times")
    sim.add_argument("--repeats", type=int, default=5, help="with --calibrate: timed repeats")
    sim.set_defaults(run=_simulate)


def _doctor() -> int:
    from mc2.tools.doctor import report

    facts, advice = report()
    print("\n".join(facts))
    print("\nadvice:")
    print("\n".join(f"- {a}" for a in advice))
    return 0


def _wire_bytes(name: str, block: int, hidden: int) -> float | None:
    """Bytes per element of a wire format for the simulator (``None``: the model's dtype)."""
    kind = parse_wire_dtype(name)
    if kind is None:
        return None
    problem = wire_problem(kind, block, hidden)
    if problem is not None:
        raise ValueError(problem)
    return WireFormat(kind, block).bytes_per_row(hidden, torch.float32) / hidden


def _simulate(args: argparse.Namespace) -> int:
    from mc2.sim import report
    from mc2.sim.model import Scenario
    from mc2.sim.presets import load_hardware, load_model

    if args.calibrate:
        from mc2.tools.simulate_check import format_checks, validate

        print("mc2 simulate --calibrate: measuring this machine's Gloo worlds "
              "(2 and 4 ranks; a few minutes)", file=sys.stderr, flush=True)
        print(format_checks(*validate(repeats=args.repeats)))
        return 0
    hw, model = load_hardware(args.hardware), load_model(args.model)
    wire_bytes = _wire_bytes(args.wire_dtype, args.wire_block, model.hidden)
    if wire_bytes is not None:
        print(f"MC2 rows on the wire: {args.wire_dtype}, {wire_bytes:.3f} bytes per element",
              file=sys.stderr)
    base = Scenario(hw, model, tokens_per_device=args.tokens, seq_len=args.seq,
                    wire_bytes=wire_bytes, dedup=args.dedup)
    if len(args.nodes) <= 3:
        rows = report.article_rows(replace(base, skew=args.skew), args.nodes)
        print(report.format_rows(rows, base))
        if args.dedup:
            print(report.format_saved(rows))
        print(report.format_best(base, args.nodes))
        print()
        print(report.article_check())
        if model.name == "mixtral-8x7b":
            need = report.implied_bandwidth(base, 0.47)
            print(f"  on {hw.name} the model gives the article's 47% only if the intra-node "
                  f"All-to-All ran at {need:.1f} GB/s per device, against "
                  f"{hw.intra_node.bandwidth_gbps:.0f} GB/s in the preset.")
    scale = report.scale_rows(base, args.nodes) if len(args.nodes) > 3 or args.plot else []
    if scale:
        print(f"\n{model.name} on {hw.name}, {args.tokens} tokens/device: no fusion vs MC2 (best K),"
              " flat vs hierarchical All-to-All, EP as large as the experts allow (packed)")
        print(report.format_scale(scale))
    if args.plot:
        print(f"wrote {report.plot_scale(scale, args.plot, f'{model.name} on {hw.name}')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one command; a bad value or an emulated cluster that cannot be built is one line
    on stderr and exit status 2, not a traceback."""
    args = build_parser().parse_args(argv)
    from mc2.tools.requirements import missing_for

    if (problem := missing_for(args)) is not None:
        print(f"mc2 {args.command}: {problem}", file=sys.stderr)
        return 2
    try:
        return args.run(args)
    except (NetnsError, ValueError) as exc:  # PresetError is a ValueError
        print(f"mc2: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
