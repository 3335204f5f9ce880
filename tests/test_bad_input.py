"""Bad input on one rank raises a clear ValueError on every rank, quickly, and hangs nobody."""

from __future__ import annotations

import pytest
import torch

import mc2
from tests.workers import bad_input_then_good, planners_disagree

BAD = {
    "expert_out_of_range": "out of range",
    "negative_expert": "out of range",
    "hidden_mismatch": "weights_up must be",
    "weight_dtype": "dtype",
    "ids_dtype": "integer",
    "ids_shape": "expert_ids must be",
    "num_experts": "does not match the group",
    "local_experts_differ": "disagree on local experts",
    "micro_batches_differ": "disagree on micro_batches",
    "micro_batches_zero": "micro_batches must be",
    "wire_dtype_differ": "disagree on wire_dtype (dispatch)",
    "wire_dtype_unsupported": "wire_dtype must be None, torch.bfloat16",
    "wire_block": "wire_block 5 must divide the hidden size 16",
    "gemm_unknown": "gemm must be 'auto', 'grouped' or 'loop'",
    "ids_device": "expert_ids must be on x's device",
    "weights_device": "routing_weights must be on x's device",
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_bad_input_on_rank1_raises_everywhere(bad: str) -> None:
    results = mc2.run_local(bad_input_then_good, 2, args=(1, bad), timeout_s=20, deadline_s=30)
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} did not raise for {bad}"
        assert BAD[bad] in r["error"], f"rank {rank}: unexpected message {r['error']!r}"
        assert r["elapsed"] < 30
        assert r["good_rows"] > 0, "the group must still work after the error"
    if not bad.endswith("differ"):  # the innocent rank names the culprit and its problem
        assert "rank 1" in results[0]["error"]


@pytest.mark.parametrize("case,message", [
    ("k", "ranks disagree on the number of micro-batches"),
    ("candidates", "ranks disagree on the largest K"),
    ("fresh", "ranks disagree on the planner's calls on this group"),
    ("fresh capacity", "ranks disagree on the planner's calls on this group"),
])
def test_planners_that_disagree_raise_everywhere(case: str, message: str) -> None:
    """The K "auto" runs is agreed: in the counts exchange (its header), or, when the planners'
    candidates differ, in the handshake. A fresh planner on one rank ("fresh") would run its
    calibration collectives while its peer runs the call: the handshake catches it first, in
    capacity mode too ("fresh capacity", where Gloo used to abort the process)."""
    results = mc2.run_local(planners_disagree, 2, args=(case,), timeout_s=20, deadline_s=60)
    for rank, r in enumerate(results):
        assert r["error"] is not None and message in r["error"], (rank, r["error"])
        assert r["good_rows"] > 0, "the group must still work after the error"
    if case == "k":
        assert "rank 1: K=4" in results[0]["error"] and "rank 0: K=2" in results[1]["error"]


def test_single_process_errors_are_plain_value_errors() -> None:
    x = torch.randn(4, 8)
    w = torch.randn(2, 8, 16)
    wd = torch.randn(2, 16, 8)
    with pytest.raises(ValueError, match="expert id 5 out of range"):
        mc2.fused_expert(x, w, w, wd, torch.tensor([[5], [0], [1], [0]]))
    with pytest.raises(ValueError, match="routing_weights must have"):
        mc2.fused_expert(x, w, w, wd, torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 1))
    with pytest.raises(ValueError, match="gemm must be"):
        mc2.fused_expert(x, w, w, wd, torch.zeros(4, 1, dtype=torch.long), gemm="fast")
    with pytest.raises(ValueError, match="x must be"):
        mc2.fused_expert(x.long(), w, w, wd, torch.zeros(4, 1, dtype=torch.long))
