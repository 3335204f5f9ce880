#!/usr/bin/env python
"""Decode-sized calls under ``micro_batches="auto"``: which K they run, what they cost, and what
the first call pays.

Each fresh 2-rank Gloo world (one thread a rank, plain processes) runs ``--calls`` no-grad
calls, then ``--calls`` forward + backward calls, of ``--tokens`` tokens per rank through
:func:`mc2.fused_expert` (hidden 1024, ffn 2048, 2 experts per rank, top-2: a decode step's
shape), each call once with ``"auto"`` and once with a fixed K = 1, interleaved call by call (which
of the two goes first alternates from world to world, so the world's own first collectives fall
on both alike). So both totals come from the same minutes of the same world: fresh worlds of
one mode each differed by up to 10% here, more than what is measured. Per world it reports
the K each ``"auto"`` call ran (read from the timeline: ``1 +`` the highest micro-batch index of
its spans), both totals, and each mode's first call with ``"auto"``'s split into the planner's
calibration (the ``Planner._measure`` collective), the handshake (the ``handshake`` spans), and
the rest::

    .venv/bin/python benchmarks/decode_auto.py --worlds 3 --json docs/decode_auto.json

``--rate 200mbit`` shapes loopback with ``tc tbf`` for the whole run (root; always removed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import mc2
from mc2.engine.decide import planner as planner_module

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_peers import ShapedLoopback  # noqa: E402

HIDDEN, FFN, LOCAL, TOPK = 1024, 2048, 2, 2


def _world(rank: int, world: int, tokens: int, calls: int, auto_first: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, HIDDEN, generator=g)
    ids = torch.randint(0, world * LOCAL, (tokens, TOPK), generator=g)
    rw = torch.rand(tokens, TOPK, generator=g)
    ws = [(torch.randn(LOCAL, HIDDEN, FFN, generator=g) * 0.03).requires_grad_(),
          (torch.randn(LOCAL, HIDDEN, FFN, generator=g) * 0.03).requires_grad_(),
          (torch.randn(LOCAL, FFN, HIDDEN, generator=g) * 0.03).requires_grad_()]
    calibration_s: list[float] = []
    measure = planner_module.Planner._measure

    def timed_measure(self: Any, *a: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return measure(self, *a, **kw)
        finally:
            calibration_s.append(time.perf_counter() - start)

    planner_module.Planner._measure = timed_measure  # type: ignore[method-assign]
    modes: tuple[Any, ...] = ("auto", 1) if auto_first else (1, "auto")
    used: list[int] = []
    seconds: dict[str, list[float]] = {"auto": [], "1": []}
    handshake_first = 0.0
    for n in range(2 * calls):
        grad = n >= calls
        for mode in modes:
            tl = mc2.Timeline()
            torch.distributed.barrier()
            start = time.perf_counter()
            with torch.set_grad_enabled(grad):
                out = mc2.fused_expert(x.clone().requires_grad_(grad), *ws, ids, rw,
                                       micro_batches=mode, timeline=tl)
                if grad:
                    out.sum().backward()
            seconds[str(mode)].append(time.perf_counter() - start)
            if mode == "auto":
                used.append(1 + max((s.micro_batch for s in tl.spans), default=0))
                if n == 0:
                    handshake_first = sum(s.duration for s in tl.spans if s.name == "handshake")
    planner_module.Planner._measure = measure  # type: ignore[method-assign]
    return {"used": used, "seconds": seconds, "calibration_s": sum(calibration_s),
            "handshake_first_s": handshake_first}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=4, help="tokens per rank")
    p.add_argument("--calls", type=int, default=40, help="calls without grad, then with grad")
    p.add_argument("--worlds", type=int, default=3, help="fresh worlds per mode")
    p.add_argument("--rate", default=None, help="shape loopback, e.g. 200mbit (root)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    shaped = ShapedLoopback(args.rate) if args.rate else None
    if shaped is not None:
        shaped.__enter__()
    try:
        for world in range(args.worlds):
            auto_first = world % 2 == 0
            ranks = mc2.run_local(_world, 2, args=(args.tokens, args.calls, auto_first),
                                  deadline_s=1800, timeout_s=600)
            row: dict[str, Any] = {"world": world, "auto_first": auto_first,
                                   "used": ranks[0]["used"],
                                   "split_calls": sum(k > 1 for k in ranks[0]["used"]),
                                   "calibration_s": max(r["calibration_s"] for r in ranks),
                                   "handshake_first_s": max(r["handshake_first_s"]
                                                            for r in ranks)}
            for mode in ("auto", "1"):
                slowest = [max(r["seconds"][mode][i] for r in ranks)
                           for i in range(2 * args.calls)]
                row[mode] = {"total_s": sum(slowest), "first_s": slowest[0],
                             "median_call_s": statistics.median(slowest[1:])}
            rows.append(row)
            a, k1 = row["auto"], row["1"]
            print(f"world {world} ({'auto' if auto_first else 'K=1'} first): auto ran "
                  f"{row['split_calls']} calls at K > 1; total auto {a['total_s']:.2f} s, "
                  f"K=1 {k1['total_s']:.2f} s ({a['total_s'] / k1['total_s']:.3f}x); first "
                  f"call auto {a['first_s']:.3f} s (calibration {row['calibration_s']:.3f} s, "
                  f"handshake {row['handshake_first_s']:.3f} s), K=1 {k1['first_s']:.3f} s",
                  flush=True)
    finally:
        if shaped is not None:
            shaped.__exit__(None, None, None)
    ratios = [r["auto"]["total_s"] / r["1"]["total_s"] for r in rows]
    firsts = [r["auto"]["first_s"] - r["1"]["first_s"] for r in rows]
    print(f"auto over K=1, total of {2 * args.calls} calls: "
          + ", ".join(f"{x:.3f}x" for x in ratios)
          + f"; calls at K > 1: {sum(r['split_calls'] for r in rows)}; first call auto - K=1: "
          + ", ".join(f"{x:+.3f} s" for x in firsts))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
