#!/usr/bin/env python
"""Only the wire format changes: float32, bf16 and fp8 rows, MC2 ``"auto"`` in every row.

The work of ``benchmarks/compare_peers.py`` (the peers' own weights and inputs, 4096 tokens per
rank, hidden 1024, ffn 2048, 8 experts, top-2, 2 Gloo ranks with one thread each, plain
processes), run by ``benchmarks/peer_work_mc2.py --interleave`` with modes ``auto``,
``auto@bf16``, ``auto@fp8`` and the serial baseline (each settled first, then their steps take
turns, so a slow spell hits every format alike), in three regimes: plain loopback, and loopback shaped with
``tc tbf`` to 500 Mbit and 200 Mbit (root; the qdisc is always removed). Each regime runs
``--rounds`` times; the table takes each mode's median round. Reported per format: the step
time, the speedup over float32 rows, the K ``"auto"`` locked, and whether it fell back to plain
rows (the format measured slower than float32 rows there; it then warns). Each regime ends with
its physical limit: float32 ``"auto"`` over T_comp, the serial step's compute (its time less its
communication), since no format makes the compute shorter.

    sudo .venv/bin/python benchmarks/wire_formats.py --regimes plain,tbf-500mbit,tbf-200mbit
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare_peers import PEERS_DIR, ShapedLoopback, can_shape, measured  # noqa: E402

MODES = ("auto", "auto@bf16", "auto@fp8", "serial")


def run_regime(regime: str, steps: int, timeout: float) -> dict:
    cmd = [sys.executable, str(HERE / "peer_work_mc2.py"), "--tokens", "4096", "--steps",
           str(steps), "--modes", ",".join(MODES), "--peers-dir", str(PEERS_DIR), "--interleave"]
    if regime == "plain":
        result, tail, _ = measured(cmd, timeout)
    else:
        with ShapedLoopback(regime.split("-", 1)[1]):
            result, tail, _ = measured(cmd, timeout)
    if result is None:
        raise SystemExit(f"{regime}: the mc2 run failed:\n{tail}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regimes", default="plain,tbf-500mbit,tbf-200mbit")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=3000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    regimes = args.regimes.split(",")
    if any(r != "plain" for r in regimes) and (why := can_shape()):
        raise SystemExit(f"shaped regimes: {why}")
    table = {}
    for regime in regimes:
        rounds = []
        for i in range(args.rounds):
            print(f"== {regime} round {i + 1}/{args.rounds}", file=sys.stderr, flush=True)
            rounds.append(run_regime(regime, args.steps, args.timeout))
        table[regime] = rounds
    print(f"{'regime':12} {'mode':10} {'step s':>7} {'vs f32':>7} {'K':>3} {'rows sent':>11} "
          f"{'max diff':>9}")
    for regime, rounds in table.items():
        med = {m: statistics.median(r["modes"][m]["median_s"] for r in rounds) for m in MODES}
        for mode in MODES:
            last = rounds[-1]["modes"][mode]
            sent = "float32" if mode in ("auto", "serial") or last["plain_rows"] else \
                mode.split("@")[1]
            print(f"{regime:12} {mode:10} {med[mode]:7.2f} {med['auto'] / med[mode]:6.2f}x "
                  f"{last['k']:>3} {sent:>11} {last['max_abs_diff']:9.1e}")
        t_comp = statistics.median(r["t_comp_s"] for r in rounds)
        print(f"{regime:12} T_comp {t_comp:.2f} s (the serial step less its communication): no "
              f"format can beat float32 rows by more than {med['auto'] / t_comp:.2f}x here")
    if args.json:
        args.json.write_text(json.dumps(table, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
