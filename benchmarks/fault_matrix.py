#!/usr/bin/env python
"""The fault matrix as a table: each fault, what every survivor raised, and how fast.

3 local Gloo ranks; after a good step the last rank stalls (SIGSTOP: alive but silent) or
dies (exits) in the forward, in the backward, or while ``"auto"`` calibrates; the deadline is
3 s (``timeout=3``). The same cases run as assertions in ``tests/test_faults.py``.

    .venv/bin/python benchmarks/fault_matrix.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.workers_faults import TIMEOUT_S, faulty_peer  # noqa: E402

import mc2  # noqa: E402
from mc2.tools.launch import LocalWorldError  # noqa: E402


def main() -> int:
    print(f"3 ranks, deadline {TIMEOUT_S:.0f} s; the last rank is the faulty one")
    print(f"{'fault':8} {'where':12} {'rank':>4}  {'raised':14} {'after s':>7}  message")
    for kind in ("stalled", "dead"):
        for where in ("forward", "backward", "calibration"):
            try:
                survivors = dict(enumerate(mc2.run_local(faulty_peer, 3, args=(kind, where),
                                                         timeout_s=60, deadline_s=60)))
            except LocalWorldError as exc:
                survivors = exc.values
            for rank, r in sorted(survivors.items()):
                message = r.get("message", "")[:90]
                print(f"{kind:8} {where:12} {rank:4}  {str(r['raised']):14} "
                      f"{r['after_s']:7.2f}  {message}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
