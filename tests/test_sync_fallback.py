"""MC2_FORCE_SYNC=1 runs synchronously, says so, marks the profile, and changes no number."""

from __future__ import annotations

import torch

import mc2
from tests.problems import make_problem
from tests.reference import dense_moe
from tests.workers import forced_sync


def test_forced_sync_falls_back_loudly() -> None:
    results = mc2.run_local(forced_sync, 2)
    p = make_problem(2, "uniform")
    want = dense_moe(torch.cat(p.xs), p.w_up, p.w_gate, p.w_down, torch.cat(p.ids),
                     torch.cat(p.rws)).split([t.shape[0] for t in p.xs])
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["out"], want[rank], rtol=0, atol=1e-10)
        assert r["warned"] and "MC2_FORCE_SYNC" in r["warned"][0]
        assert r["fallback"] == "MC2_FORCE_SYNC is set"
        assert "transfer" not in r["kinds"] and "wait" not in r["kinds"], "nothing async"
        assert "comm" in r["kinds"]
