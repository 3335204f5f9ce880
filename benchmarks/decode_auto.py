#!/usr/bin/env python
"""Decode-sized calls under ``micro_batches="auto"``: which K they run, what they cost, and what
the first call pays.

Each fresh 2-rank Gloo world (one thread a rank, plain processes) runs ``--calls`` no-grad
calls, then ``--calls`` forward + backward calls, of ``--tokens`` tokens per rank through
:func:`mc2.fused_expert` (hidden 1024, ffn 2048, 2 experts per rank, top-2: the shape of issue
53), once with ``"auto"`` and once with a fixed K = 1, the two kinds of world alternating.
Per world it reports the K each call ran (read from the timeline: ``1 +`` the highest
micro-batch index of its spans), the total seconds of all calls, and the first call split
into the planner's calibration (the ``Planner._measure`` collective), the handshake (the
``handshake`` spans), and the rest::

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


def _world(rank: int, world: int, tokens: int, calls: int, k: Any) -> dict[str, Any]:
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
    used: list[int] = []
    seconds: list[float] = []
    handshake_first = 0.0
    for n in range(2 * calls):
        grad = n >= calls
        tl = mc2.Timeline()
        torch.distributed.barrier()
        start = time.perf_counter()
        with torch.set_grad_enabled(grad):
            out = mc2.fused_expert(x.clone().requires_grad_(grad), *ws, ids, rw,
                                   micro_batches=k, timeline=tl)
            if grad:
                out.sum().backward()
        seconds.append(time.perf_counter() - start)
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
            for mode in ("auto", 1) if world % 2 == 0 else (1, "auto"):
                ranks = mc2.run_local(_world, 2, args=(args.tokens, args.calls, mode),
                                      deadline_s=1800, timeout_s=600)
                slowest = [max(r["seconds"][i] for r in ranks)
                           for i in range(2 * args.calls)]
                row = {"world": world, "mode": str(mode), "used": ranks[0]["used"],
                       "split_calls": sum(k > 1 for k in ranks[0]["used"]),
                       "total_s": sum(slowest), "first_s": slowest[0],
                       "calibration_s": max(r["calibration_s"] for r in ranks),
                       "handshake_first_s": max(r["handshake_first_s"] for r in ranks),
                       "median_call_s": statistics.median(slowest[1:])}
                rows.append(row)
                print(f"world {world} {row['mode']:>4}: {row['split_calls']} calls at K > 1, "
                      f"total {row['total_s']:.2f} s, first call {row['first_s']:.2f} s "
                      f"(calibration {row['calibration_s']:.2f} s, handshake "
                      f"{row['handshake_first_s']:.2f} s), median call "
                      f"{1e3 * row['median_call_s']:.1f} ms", flush=True)
    finally:
        if shaped is not None:
            shaped.__exit__(None, None, None)
    for mode in ("auto", "1"):
        mine = [r for r in rows if r["mode"] == mode]
        print(f"{mode:>4}: split calls {sum(r['split_calls'] for r in mine)}, total "
              f"{statistics.median(r['total_s'] for r in mine):.2f} s (median world), first call "
              f"{statistics.median(r['first_s'] for r in mine):.2f} s")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
