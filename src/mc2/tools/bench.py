"""Serial vs MC2 measurements in one local world: what ``mc2 demo``, ``mc2 bench`` and
``benchmarks/`` print.

Every repeat runs every mode once, in a rotating order, so that machine noise hits all modes
alike; each mode keeps its own :class:`~mc2.engine.transport.workspace.Workspace`, so each is
measured with its buffers warm, as a job running only that mode would be; each step is
forward + backward of :func:`mc2.fused_expert_packed`, timed from a barrier to the slowest
rank's end. Where the time
went comes from the :class:`~mc2.observation.timeline.Timeline` spans:
``compute`` (expert math and permutes), exposed communication (synchronous collectives plus
waits on asynchronous ones), and the rest (autograd, allocation, the weighted sum).
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist

from mc2.device.clock import clock_for
from mc2.device.streams import full_device
from mc2.engine.transport.backend import default_device_type
from mc2.engine.decide.config import MC2Config
from mc2.engine.compute.experts import ExpertWeights
from mc2.engine.autograd.ops import fused_expert_packed
from mc2.engine.decide.planner import choose, planner_for, predict
from mc2.engine.transport.wire import parse_wire_dtype, wire_problem
from mc2.engine.transport.workspace import Workspace
from mc2.observation import metrics
from mc2.observation.profiler import profile
from mc2.observation.timeline import Span, Timeline
from mc2.tools.launch import run_local

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark problem (per rank) and how to measure it."""

    tokens_per_rank: int = 4096
    hidden: int = 1024
    ffn: int = 2048
    experts: int = 8
    topk: int = 2
    dtype: str = "float32"
    micro_batches: tuple[int, ...] = (2, 4, 8)
    repeats: int = 5
    warmup: int = 1
    gemm: str = "auto"
    seed: int = 0
    split_sync: bool = False  # also time K micro-batches *without* overlap (split overhead)
    trace: bool = False  # profile one extra step per mode and return every rank's spans
    trace_overhead: bool = True  # with trace: also time steps with and without recording
    auto: bool = False  # also time micro_batches="auto" and return the planner's predictions
    hierarchies: tuple[str, ...] = ("flat",)  # All-to-All layouts to time MC2 with
    quiet: bool = False
    malloc_tuned: bool = False  # glibc told to keep freed memory (off: a plain process)
    wire_dtypes: tuple[str, ...] = ("none",)  # formats MC2 rows travel in (mc2.engine.transport.wire names)
    wire_block: int = 128  # channels per scale of the quantised formats
    device: str = "cpu"  # "cuda": each rank on its local device (shared when fewer than ranks)
    timeout: float | None = None  # MC2Config.timeout of every call
    check_finite: bool = False  # MC2Config.check_finite of every call
    dedups: tuple[bool, ...] = (False,)  # MC2 rows once per destination: off, on, or both

    def call_config(self, mode: Mode) -> MC2Config:
        """The :class:`MC2Config` of one mode's calls: the mode's K, overlap, layout and wire
        format, the rest from this configuration."""
        return MC2Config(micro_batches=mode.micro_batches, overlap=mode.overlap,
                         hierarchy=mode.hierarchy, wire_dtype=mode.wire,
                         wire_block=self.wire_block, gemm=self.gemm, timeout=self.timeout,
                         check_finite=self.check_finite, dedup=mode.dedup)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"need repeats >= 1 and warmup >= 0, got {self.repeats}, {self.warmup}")
        if self.tokens_per_rank < 0 or self.topk < 1 or self.topk > self.experts:
            raise ValueError("need tokens_per_rank >= 0 and 1 <= topk <= experts, got "
                             f"{self.tokens_per_rank}, {self.topk}, {self.experts}")
        if any(k < 1 for k in self.micro_batches):
            raise ValueError(f"micro_batches must be positive, got {self.micro_batches}")
        if not self.hierarchies or set(self.hierarchies) - {"flat", "2d", "auto"}:
            raise ValueError(f"hierarchies must be among flat, 2d, auto; got {self.hierarchies}")
        if not self.wire_dtypes:
            raise ValueError("wire_dtypes needs at least one format (none for plain rows)")
        for name in self.wire_dtypes:
            problem = wire_problem(parse_wire_dtype(name), self.wire_block, self.hidden)
            if problem is not None:
                raise ValueError(f"--wire-dtype {name}: {problem} (see --wire-block)")


@dataclass(frozen=True)
class Mode:
    name: str
    micro_batches: int | str
    overlap: bool
    hierarchy: str = "flat"
    wire: str = "none"
    dedup: bool = False
    # the mode's own buffer pool, reused by its steps (modes do not share one: each keeps
    # the sizes it runs at)
    workspace: Workspace = field(default_factory=Workspace, compare=False, repr=False)


@dataclass
class ModeResult:
    """Medians over repeats of the slowest rank's numbers for one mode."""

    mode: str
    micro_batches: int | str
    overlap: bool
    step_s: float
    exposed_comm_s: float
    compute_s: float
    tokens_per_s_per_rank: float
    comm_share: float
    speedup: float = float("nan")
    hidden_fraction: float = float("nan")
    max_diff: float = 0.0


@dataclass
class BenchReport:
    config: BenchConfig
    world_size: int
    results: list[ModeResult] = field(default_factory=list)
    nodes: int = 1
    traces: dict[str, list[list[Span]]] = field(default_factory=dict)  # mode -> per-rank spans
    profiler_overhead: float = float("nan")  # (step with recording) / (step without) - 1
    sync_fallbacks: dict[str, str] = field(default_factory=dict)  # mode -> why it ran sync
    auto_k: int = 0  # the K "auto" chose (0: not run)
    explore_calls: int = 0  # calls "auto" ran before it locked K (its trials), untimed
    auto_trials: dict[int, float] = field(default_factory=dict)  # K -> its trials' median, s
    auto_why: str | None = None  # the planner's own line: what it measured, why it locked
    predicted_s: dict[int, float] = field(default_factory=dict)  # planner's step time per K
    predicted_serial_s: float = float("nan")
    # mode -> the slowest rank's step time in each timed round, in round order: every mode runs
    # once per round, so index i of two modes is a pair measured side by side (paired ratios)
    step_samples: dict[str, list[float]] = field(default_factory=dict)

    @property
    def serial(self) -> ModeResult:
        return self.results[0]

    @property
    def best(self) -> ModeResult:
        """The fastest overlapped mode, "auto" included."""
        return min((r for r in self.results if r.overlap), key=lambda r: r.step_s)

    @property
    def best_fixed(self) -> ModeResult:
        """The fastest overlapped mode with a fixed K (what a sweep finds)."""
        return min((r for r in self.results if r.overlap and isinstance(r.micro_batches, int)),
                   key=lambda r: r.step_s)

    def result(self, mode: str) -> ModeResult:
        return next(r for r in self.results if r.mode == mode)

    def to_dict(self) -> dict[str, Any]:
        return {"config": asdict(self.config), "world_size": self.world_size,
                "results": [asdict(r) for r in self.results],
                "profiler_overhead": self.profiler_overhead, "auto_k": self.auto_k,
                "sync_fallbacks": self.sync_fallbacks,
                "predicted_s": self.predicted_s}


def modes_of(cfg: BenchConfig) -> list[Mode]:
    modes = [Mode("serial", 1, False)]
    for wire, dedup in itertools.product(cfg.wire_dtypes, cfg.dedups):
        wtag = ("" if parse_wire_dtype(wire) is None else f" {wire}") + (" dedup" if dedup else "")
        for h in cfg.hierarchies:
            tag = ("" if h == "flat" else f" {h}") + wtag
            modes += [Mode(f"mc2 K={k}{tag}", k, True, h, wire, dedup)
                      for k in cfg.micro_batches]
        if cfg.auto:
            modes.append(Mode(f"mc2 auto{wtag}", "auto", True, wire=wire, dedup=dedup))
    if cfg.split_sync:
        modes += [Mode(f"split K={k} (sync)", k, False) for k in cfg.micro_batches if k > 1]
    return modes


def _problem(rank: int, cfg: BenchConfig):
    g = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    dtype = _DTYPES[cfg.dtype]
    world = dist.get_world_size() if dist.is_initialized() else 1
    local = cfg.experts // world
    x = torch.randn(cfg.tokens_per_rank, cfg.hidden, generator=g).to(dtype)
    logits = torch.randn(cfg.tokens_per_rank, cfg.experts, generator=g)
    top, ids = logits.softmax(-1).topk(cfg.topk, dim=-1)
    rw = (top / top.sum(-1, keepdim=True)).to(dtype)
    # packed nn.Linear layout, as MoELayer keeps it: gate_up [L, 2F, H], down [L, H, F]
    ws = [torch.randn(local, 2 * cfg.ffn, cfg.hidden, generator=g) * cfg.hidden ** -0.5,
          torch.randn(local, cfg.hidden, cfg.ffn, generator=g) * cfg.ffn ** -0.5]
    grad_out = torch.randn(cfg.tokens_per_rank, cfg.hidden, generator=g).to(dtype)
    device = _device()
    return (x.to(device), [w.to(device, dtype) for w in ws], ids.to(device), rw.to(device),
            grad_out.to(device))


def _device() -> torch.device:
    """The rank's device: the accelerator :func:`~mc2.tools.launch.use_device` set, else CPU."""
    return full_device(default_device_type())


def _step(x, ws, ids, rw, grad_out, mode: Mode, cfg: BenchConfig, timeline: Timeline | None):
    xg = x.detach().requires_grad_(True)
    wg = [w.detach().requires_grad_(True) for w in ws]
    out = fused_expert_packed(xg, *wg, ids, rw, config=cfg.call_config(mode), timeline=timeline,
                              workspace=mode.workspace)
    out.backward(grad_out)
    return [out.detach(), xg.grad] + [w.grad for w in wg]


def _slowest(values: list[float]) -> list[float]:
    """The row of the rank whose step (``values[0]``) was slowest, whole: a maximum taken
    field by field paired the slow rank's step with the waiting rank's exposed communication
    (measured under uneven routing: comm share 0.45 where the slowest rank's own was 0.09)."""
    if not dist.is_initialized():
        return list(values)
    rows = torch.zeros(dist.get_world_size(), len(values), dtype=torch.float64,
                       device=_device())
    rows[dist.get_rank()] = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(rows)  # each rank's row, everywhere
    return slowest_row(rows.tolist())


def slowest_row(rows: list[list[float]]) -> list[float]:
    """Of the ranks' rows, the one whose first field (the step) is largest."""
    return max(rows, key=lambda row: row[0])


def bench_rank(rank: int, world: int, cfg: BenchConfig) -> dict[str, Any]:
    """Runs inside each rank; returns per-mode, per-repeat (step, exposed comm, compute, diff)."""
    if cfg.experts % world:
        raise ValueError(f"experts ({cfg.experts}) must be divisible by world size ({world})")
    problem = _problem(rank, cfg)
    modes = modes_of(cfg)
    plan = _explore_auto(problem, modes, cfg) if cfg.auto else {}
    raw = {**_timed_rounds(rank, problem, modes, cfg), **plan}
    if cfg.trace:
        raw["traces"] = {}
        for mode in modes:
            with profile() as prof:
                dist.barrier()
                with prof.step():
                    _step(*problem, mode, cfg, None)
            raw["traces"][mode.name] = prof.gather()
        if cfg.trace_overhead:
            raw["profiler_overhead"] = _recording_overhead(*problem, modes[-1], cfg)
    return raw


def _explore_auto(problem: tuple, modes: list[Mode], cfg: BenchConfig) -> dict[str, Any]:
    """Measure the planner's model before timing anything, report what it predicts, and let
    ``"auto"`` explore its few K (bounded) and lock before the timed rounds."""
    ws = problem[1]
    planner = planner_for(None)
    weights = ExpertWeights.packed_of(*ws)
    cal = planner.calibration(weights, None)
    work = planner.workload(cfg.tokens_per_rank, cfg.topk, weights, None)
    plan: dict[str, Any] = {"auto_k": choose(cal, work, planner.candidates, planner.min_gain,
                                             cfg.tokens_per_rank)}
    plan["predicted_s"] = {k: predict(cal, work, k).step_s
                           for k in sorted(set(cfg.micro_batches) | {1})}
    plan["predicted_serial_s"] = predict(cal, work, 1, overlap=False).step_s
    autos = [m for m in modes if m.micro_batches == "auto"]
    calls = 0
    while calls == 0 or (calls <= planner.most_trial_calls() and not planner.settled()):
        for auto in autos:
            _step(*problem, auto, cfg, None)
        calls += 1
    decisions = list(planner.decisions().values())
    if decisions:  # what the lock was decided on: the group's slowest rank, median per K
        plan["auto_k"] = decisions[0]["locked"]
        plan["auto_trials"] = {k: st["median_s"] for k, st in decisions[0]["stats"].items()}
        plan["auto_why"] = decisions[0]["why"]
    plan["explore_calls"] = calls
    return plan


def _timed_rounds(rank: int, problem: tuple, modes: list[Mode], cfg: BenchConfig
                  ) -> dict[str, Any]:
    """Warm-ups and repeats, every mode once per round in a rotating order; the slowest rank's
    step, exposed communication and compute, and each mode's largest difference from the
    first mode's results."""
    reference = _step(*problem, modes[0], cfg, None)
    samples: dict[str, list[list[float]]] = {m.name: [] for m in modes}
    diffs = {m.name: 0.0 for m in modes}
    clock = clock_for(problem[0].device)  # device events on an accelerator: the host only queues
    fallbacks: dict[str, str] = {}
    for rep in range(cfg.warmup + cfg.repeats):
        for j in range(len(modes)):
            mode = modes[(j + rep) % len(modes)]
            tl = Timeline()
            dist.barrier()
            start = clock.stamp()
            got = _step(*problem, mode, cfg, tl)
            step = clock.elapsed(start, clock.stamp())
            if tl.sync_fallback:
                fallbacks[mode.name] = tl.sync_fallback
            diffs[mode.name] = max(diffs[mode.name], max(
                (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
                for a, b in zip(got, reference)))
            row = _slowest([step, tl.exposed_comm, tl.total("compute")])
            if rep >= cfg.warmup:
                samples[mode.name].append(row)
            if rank == 0 and not cfg.quiet:
                tag = "warmup" if rep < cfg.warmup else f"repeat {rep - cfg.warmup + 1}/{cfg.repeats}"
                print(f"  [{tag}] {mode.name:<18} {row[0] * 1e3:9.1f} ms", file=sys.stderr,
                      flush=True)
    slowest_diff = _slowest([diffs[m.name] for m in modes])
    return {"samples": samples, "diffs": dict(zip([m.name for m in modes], slowest_diff)),
            "sync_fallbacks": fallbacks}


def _recording_overhead(x, ws, ids, rw, grad_out, mode: Mode, cfg: BenchConfig) -> float:
    """Median step with a Timeline over median step without, minus 1 (alternating runs)."""
    timed: dict[bool, list[float]] = {True: [], False: []}
    clock = clock_for(x.device)
    for rep in range(2 * max(cfg.repeats, 3)):
        record = rep % 2 == 0
        dist.barrier()
        start = clock.stamp()
        _step(x, ws, ids, rw, grad_out, mode, cfg, Timeline() if record else None)
        timed[record].append(_slowest([clock.elapsed(start, clock.stamp())])[0])
    return metrics.median(timed[True]) / metrics.median(timed[False]) - 1


def summarize(cfg: BenchConfig, world: int, raw: dict[str, Any]) -> BenchReport:
    """Medians and the ratios of :mod:`mc2.observation.metrics` from :func:`bench_rank`'s
    samples; what else it returned (traces, the planner's view) under the report's own names."""
    results = []
    for mode in modes_of(cfg):
        step, comm, compute = (metrics.median(r[i] for r in raw["samples"][mode.name])
                               for i in range(3))
        results.append(ModeResult(
            mode=mode.name, micro_batches=mode.micro_batches, overlap=mode.overlap, step_s=step,
            exposed_comm_s=comm, compute_s=compute, tokens_per_s_per_rank=cfg.tokens_per_rank / step,
            comm_share=metrics.comm_share(comm, step), max_diff=raw["diffs"][mode.name]))
    names = {f.name for f in fields(BenchReport)}
    report = BenchReport(cfg, world, results, **{k: v for k, v in raw.items() if k in names},
                         step_samples={m: [r[0] for r in rows] for m, rows in raw["samples"].items()})
    serial = report.serial
    for r in report.results:
        r.speedup = metrics.speedup(serial.step_s, r.step_s)
        r.hidden_fraction = metrics.hidden_fraction(serial.step_s, serial.exposed_comm_s, r.step_s)
    return report


def run_bench(cfg: BenchConfig, world_size: int = 2, threads: int = 1,
              ranks_per_node: int | None = None, rank_env: Any = None) -> BenchReport:
    """Start a local Gloo world, measure every mode, return the report (rank 0's view)."""
    raw = run_local(bench_rank, world_size, args=(cfg,), threads=threads, timeout_s=300,
                    deadline_s=3600, ranks_per_node=ranks_per_node, rank_env=rank_env,
                    steady_memory=cfg.malloc_tuned, device=cfg.device)
    report = summarize(cfg, world_size, raw[0])
    report.nodes = world_size // ranks_per_node if ranks_per_node else 1
    return report


def format_report(report: BenchReport) -> str:
    """Every mode's row (:func:`format_modes`), then the article's table: configuration, comm
    share, tokens/s per rank (:func:`article_rows`)."""
    rows = article_rows(report)
    width = max(len(r["config"]) for r in rows)
    lines = [format_modes(report), "", f"{'config':<{width}} | comm share | tokens/s per rank"]
    lines += [f"{r['config']:<{width}} | {r['comm_share'] * 100:9.1f}% | "
              f"{r['tokens_per_s_per_rank']:,.0f}" for r in rows]
    return "\n".join(lines)


def format_modes(report: BenchReport) -> str:
    """Every mode's row (step, comm share, compute, tokens/s, speedup, hidden, max diff) and the
    overlap bound line, without the article's summary table (``mc2 demo`` prints its own)."""
    cfg = report.config
    head = (f"{report.world_size} ranks x {cfg.tokens_per_rank} tokens, hidden {cfg.hidden}, "
            f"ffn {cfg.ffn}, {cfg.experts} experts, top-{cfg.topk}, {cfg.dtype}, forward+backward,"
            f" median of {cfg.repeats}" + (", MALLOC-TUNED processes (not a plain process)"
                                           if cfg.malloc_tuned else ", plain processes"))
    cols = ("mode", "step ms", "comm share", "compute ms", "tokens/s/rank", "speedup", "hidden",
            "max diff")
    rows = [cols]
    for r in report.results:
        name = f"{r.mode} [SYNC FALLBACK]" if r.mode in report.sync_fallbacks else r.mode
        rows.append((name, f"{r.step_s * 1e3:.1f}", f"{r.comm_share * 100:.1f}%",
                     f"{r.compute_s * 1e3:.1f}", f"{r.tokens_per_s_per_rank:,.0f}",
                     f"{r.speedup:.3f}x", "-" if r.mode == "serial" else f"{r.hidden_fraction:.2f}",
                     f"{r.max_diff:.1e}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = [head] + ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                                enumerate(zip(row, widths))) for row in rows]
    serial = report.serial
    bound = metrics.overlap_bound(serial.comm_share)
    lines.append(f"serial comm share {serial.comm_share * 100:.1f}% -> overlap can at best give "
                 f"{bound:.3f}x; best MC2: {report.best.mode} at {report.best.speedup:.3f}x")
    for reason in sorted(set(report.sync_fallbacks.values())):
        lines.append(f"WARNING: MC2 modes ran synchronously ({reason}): nothing was overlapped")
    return "\n".join(lines)


def article_rows(report: BenchReport) -> list[dict[str, Any]]:
    """The article's table: configuration, comm share, tokens/s per rank (no fusion vs MC2;
    across emulated nodes, flat and hierarchical)."""
    rows = [{"config": "no fusion (serial)", "comm_share": report.serial.comm_share,
             "tokens_per_s_per_rank": report.serial.tokens_per_s_per_rank}]
    where = "one node" if report.nodes == 1 else f"across {report.nodes} nodes"
    for hierarchy in report.config.hierarchies:
        timed = [r for r in report.results if r.overlap and isinstance(r.micro_batches, int)
                 and (r.mode.endswith(f" {hierarchy}") or (hierarchy == "flat" and
                                                           r.mode.count(" ") == 1))]
        if not timed:
            continue
        best = min(timed, key=lambda r: r.step_s)
        label = f"MC2, {where}" + (f", {hierarchy}" if report.nodes > 1 else "")
        rows.append({"config": f"{label} ({best.mode})", "comm_share": best.comm_share,
                     "tokens_per_s_per_rank": best.tokens_per_s_per_rank})
    return rows


def format_plan(report: BenchReport) -> str:
    """The planner's predicted step time for every K beside the measured one, and its pick."""
    measured = {r.mode: r.step_s for r in report.results}
    lines = ["K    predicted ms  measured ms  error"]
    for k, predicted in sorted(report.predicted_s.items()):
        step = measured.get(f"mc2 K={k}", float("nan"))
        lines.append(f"{k:<4} {predicted * 1e3:12.1f} {step * 1e3:12.1f} "
                     f"{(predicted / step - 1) * 100:+6.1f}%")
    auto, best, k1 = measured["mc2 auto"], report.best_fixed, measured.get("mc2 K=1")
    lines.append(f"auto tried K on {report.explore_calls} calls, then locked K={report.auto_k}: "
                 f"{auto * 1e3:.1f} ms; best measured "
                 f"{best.mode}: {best.step_s * 1e3:.1f} ms; auto/best {auto / best.step_s:.3f}"
                 + (f"; auto/K=1 {auto / k1:.3f}" if k1 else ""))
    if report.auto_why:
        lines.append(f"auto {report.auto_why}")
    return "\n".join(lines)
