#!/usr/bin/env python
"""mc2 beside DeepSpeed-MoE and Megatron-Core on exactly the same work, in four regimes.

The peers run through their harness ``peers.py`` (in ``MC2_PEERS_DIR``; DeepSpeed 0.19.8,
Megatron-Core 0.16.1 in their own virtual environment, see its README); mc2 runs the same work
here: the same router, experts, tokens and output gradient (drawn by the peers' own
``make_weights``/``make_inputs``), softmax over the top-k logits, dropless SwiGLU experts,
``y.backward(dy)`` with ``x`` and every parameter requiring grad, 2 Gloo ranks with one thread
each, plain processes (no malloc tuning), 2 warm-ups, then the median over steps of the slowest
rank's time, a barrier before each step. Each regime runs ``--rounds`` rounds of (DeepSpeed,
Megatron, mc2) back to back and takes each library's median round, so that a slow spell of a
shared machine hits every library alike. mc2 uses ``micro_batches="auto"``; its exploration
calls (until it locks: ``Planner.most_trial_calls`` bounds them) run as extra warm-ups and are
reported. The peak resident memory
of each run's largest process is reported beside its time (for mc2, read right after its
``"auto"`` steps, before its serial baseline runs in the same process).

Regimes: plain loopback at 4096 and 64 tokens per rank, and loopback shaped with ``tc tbf`` to
1 Gbit and 500 Mbit (root only; the qdisc is always removed: on exit, on failure, on Ctrl-C).

    sudo .venv/bin/python benchmarks/compare_peers.py                 # all four regimes
    .venv/bin/python benchmarks/compare_peers.py --regimes plain-4096,plain-64 --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PEERS_DIR = Path(os.environ.get("MC2_PEERS_DIR", HERE.parent.parent / "shared" / "peers"))
PEERS_PY = Path(os.environ.get("MC2_PEERS_PYTHON",
                               Path(os.environ.get("TMPDIR", "/tmp")) / "mc2-peers-venv" / "bin"
                               / "python"))
LIBS = ("deepspeed", "megatron")


@dataclass(frozen=True)
class Regime:
    name: str
    tokens: int
    rate: str | None  # tc tbf rate on lo, None: plain loopback


REGIMES = {r.name: r for r in (Regime("plain-4096", 4096, None), Regime("plain-64", 64, None),
                                Regime("tbf-1gbit", 4096, "1gbit"),
                                Regime("tbf-500mbit", 4096, "500mbit"))}


# ------------------------------------------------------------------ the shaped loopback
class ShapedLoopback:
    """``tc qdisc add dev lo root tbf ...`` for the duration of a ``with`` block; removed on
    exit, on an exception and on SIGINT/SIGTERM (re-raised as KeyboardInterrupt/SystemExit)."""

    def __init__(self, rate: str, latency: str = "200ms") -> None:
        self.rate, self.latency = rate, latency
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "ShapedLoopback":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._on_signal)
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
        subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", self.rate,
                        "burst", "512kb", "latency", self.latency], check=True,
                       capture_output=True)
        return self

    @staticmethod
    def _on_signal(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def __exit__(self, *exc: Any) -> None:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def in_regime(regime: str, call: Any) -> Any:
    """``call()`` on plain loopback (``regime == "plain"``) or with loopback shaped to the
    regime's rate (:class:`ShapedLoopback`, removed after)."""
    if regime == "plain":
        return call()
    with ShapedLoopback(regime):
        return call()


def can_shape() -> str | None:
    """Why shaped regimes cannot run here, or ``None``."""
    if os.geteuid() != 0:
        return "needs root (tc qdisc on lo)"
    if subprocess.run(["which", "tc"], capture_output=True).returncode:
        return "needs tc (apt-get install iproute2)"
    return None


# ------------------------------------------------------------------ running one measurement
def measured(cmd: list[str], timeout: float) -> tuple[dict | None, str, float]:
    """Run ``cmd`` in a fresh wrapper process; (its JSON line, stderr tail, peak RSS MiB of the
    largest process of its tree)."""
    wrapper = ("import resource, subprocess, sys\n"
               "r = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE,"
               " text=True)\n"
               "sys.stderr.write(r.stderr[-3000:])\n"
               "print(r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip()"
               " else 'null')\n"
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
    try:
        r = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f}s", float("nan")
    lines = r.stdout.strip().splitlines()
    if len(lines) < 2:
        return None, r.stderr[-2000:], float("nan")
    result = json.loads(lines[-2])
    return result, r.stderr[-2000:], int(lines[-1]) / 1024


def peer_cmd(lib: str, regime: Regime, steps: int) -> list[str]:
    return [str(PEERS_PY), str(PEERS_DIR / "peers.py"), "--lib", lib, "--world", "2",
            "--hidden", "1024", "--ffn", "2048", "--experts", "8", "--topk", "2",
            "--tokens", str(regime.tokens), "--steps", str(steps)]


def mc2_cmd(regime: Regime, steps: int, modes: str, checkout: Path | None = None) -> list[str]:
    """mc2's run; ``checkout``: another mc2 tree (its ``src`` first on the path, its own
    ``peer_work_mc2.py``), for comparing versions in the same rounds."""
    script = (checkout / "benchmarks" if checkout else HERE) / "peer_work_mc2.py"
    cmd = [sys.executable, str(script), "--tokens", str(regime.tokens),
           "--steps", str(steps), "--modes", modes, "--peers-dir", str(PEERS_DIR)]
    if checkout is not None:
        code = ("import runpy, sys; sys.path.insert(0, sys.argv[1]); sys.argv = sys.argv[2:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")
        cmd = [sys.executable, "-c", code, str(checkout / "src"), *cmd[1:]]
    return cmd


def peers_missing() -> str | None:
    if not (PEERS_DIR / "peers.py").exists():
        return f"no peers.py in {PEERS_DIR}"
    if not PEERS_PY.exists():
        return (f"no peer environment at {PEERS_PY}: run 'bash {PEERS_DIR / 'setup.sh'}' "
                "(or set MC2_PEERS_PYTHON)")
    return None


def _median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median time (its other numbers travel with it)."""
    return sorted(runs, key=lambda r: r["median_s"])[(len(runs) - 1) // 2]


def run_regime(regime: Regime, args: argparse.Namespace) -> dict[str, Any]:
    """``--rounds`` rounds of (each peer, then mc2), so that a slow spell of this shared machine
    hits every library alike; each library's figure is its median round."""
    row: dict[str, Any] = {"regime": regime.name, "tokens": regime.tokens, "rate": regime.rate}
    missing = peers_missing()
    runs: dict[str, list[dict[str, Any]]] = {lib: [] for lib in (*LIBS, "mc2", "baseline")}
    for lib in LIBS:
        if lib not in args.libs.split(","):
            row[lib] = {"missing": "not asked for (--libs)"}
        elif missing:
            row[lib] = {"missing": missing}
    for n in range(args.rounds):
        for lib in LIBS:
            if lib in row:
                continue
            log(f"  round {n + 1}/{args.rounds}: {lib} ...")
            result, err, rss = measured(peer_cmd(lib, regime, args.steps), args.timeout)
            if result is None:
                row[lib] = {"missing": "failed: " + (err.strip().splitlines() or ["?"])[-1]}
                continue
            runs[lib].append({"median_s": result["median_s"], "rss_mib": rss})
        versions = [("mc2", None)] + ([("baseline", args.baseline)] if args.baseline else [])
        for name, checkout in versions[::1 if n % 2 == 0 else -1]:  # alternate who goes first
            log(f"  round {n + 1}/{args.rounds}: {name} ...")
            result, err, rss = measured(mc2_cmd(regime, args.steps, args.mc2_modes, checkout),
                                        args.timeout)
            if result is None:
                raise RuntimeError(f"{name} failed in {regime.name}:\n{err}")
            runs.setdefault(name, []).append({
                **result, "median_s": result["modes"]["auto"]["median_s"],
                "rss_mib": result.get("rss_auto_mib", rss)})
    for lib, done in runs.items():
        if done and lib not in row:
            row[lib] = {**_median_of(done), "rounds_s": [r["median_s"] for r in done],
                        "rss_mib": max(r["rss_mib"] for r in done)}
    return row


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the table
def best_peer(row: dict[str, Any]) -> tuple[str, float] | None:
    times = [(lib, row[lib]["median_s"]) for lib in LIBS if "median_s" in row[lib]]
    return min(times, key=lambda t: t[1]) if times else None


def format_table(rows: list[dict[str, Any]]) -> str:
    head = ("| regime | DeepSpeed-MoE | Megatron-Core | mc2 auto (K) | mc2 serial | mc2 / best peer"
            " | hidden | peak RSS MiB (DS / MC / mc2) |")
    lines = [head, "|" + "---|" * 8]
    def cell(row: dict[str, Any], lib: str) -> str:
        r = row[lib]
        return f"{r['median_s'] * 1e3:,.0f} ms" if "median_s" in r else "missing"

    for row in rows:
        m = row["mc2"]
        auto = m["modes"]["auto"]
        serial = m["modes"].get("serial")
        best = best_peer(row)
        ratio = f"{best[1] / auto['median_s']:.2f}x" if best else "-"
        hidden = "-"
        if serial and m.get("t_comp_s"):
            ideal = max(m["t_comp_s"], serial["median_s"] - m["t_comp_s"])
            if serial["median_s"] > ideal:
                hidden = f"{(serial['median_s'] - auto['median_s']) / (serial['median_s'] - ideal):.2f}"
        rss = " / ".join(f"{row[lib]['rss_mib']:.0f}" if "rss_mib" in row[lib] else "-"
                         for lib in (*LIBS, "mc2"))
        serial_cell = f"{serial['median_s'] * 1e3:,.0f} ms" if serial else "-"
        lines.append(f"| {row['regime']} | {cell(row, 'deepspeed')} | {cell(row, 'megatron')} | "
                     f"{auto['median_s'] * 1e3:,.0f} ms (K={auto['k']}) | {serial_cell} | "
                     f"{ratio} | {hidden} | {rss} |")
    if any("baseline" in row for row in rows):
        lines += ["", "| regime | mc2 auto | baseline auto | mc2 / baseline (time) | rounds mc2 |"
                  " rounds baseline |", "|" + "---|" * 6]
        for row in rows:
            new, old = row["mc2"], row.get("baseline")
            if old is None:
                continue
            lines.append(
                f"| {row['regime']} | {new['median_s'] * 1e3:,.0f} ms | "
                f"{old['median_s'] * 1e3:,.0f} ms | {new['median_s'] / old['median_s']:.3f} | "
                f"{', '.join(f'{t * 1e3:,.0f}' for t in new['rounds_s'])} | "
                f"{', '.join(f'{t * 1e3:,.0f}' for t in old['rounds_s'])} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--regimes", default=",".join(REGIMES),
                   help=f"comma-separated, from {', '.join(REGIMES)} (default: all)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run (default 5)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of (peers, mc2) per regime; the median round counts (default 3)")
    p.add_argument("--mc2-modes", default="auto,serial",
                   help="mc2 modes to time in the same process: auto, serial, K=<n> "
                        "(default auto,serial)")
    p.add_argument("--libs", default=",".join(LIBS),
                   help="peers to run beside mc2 (default: deepspeed,megatron)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run (default 900)")
    p.add_argument("--json", type=Path, help="also write every number as JSON")
    p.add_argument("--baseline", type=Path, default=None,
                   help="another mc2 checkout (e.g. a git worktree of an older commit) to run in "
                        "the same rounds, interleaved; adds a 'mc2 / baseline' table")
    args = p.parse_args()
    names = [n for n in args.regimes.split(",") if n]
    unknown = set(names) - set(REGIMES)
    if unknown:
        p.error(f"unknown regime(s) {sorted(unknown)}; choose from {sorted(REGIMES)}")
    if missing := peers_missing():
        log(f"peers missing ({missing}); their columns will say so")
    rows = []
    started = time.monotonic()
    for name in names:
        regime = REGIMES[name]
        log(f"[{len(rows) + 1}/{len(names)}] {name} ({time.monotonic() - started:.0f}s so far)")
        if regime.rate is None:
            rows.append(run_regime(regime, args))
        elif why := can_shape():
            log(f"  skipped: {why}")
            continue
        else:
            with ShapedLoopback(regime.rate):
                rows.append(run_regime(regime, args))
        log(format_table(rows[-1:]))  # each regime as it is done: a later one may not finish
        if args.json:  # after every regime, for the same reason
            args.json.write_text(json.dumps(rows, indent=2))
    print(format_table(rows))
    if args.json:
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
