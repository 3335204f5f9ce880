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
    "topk_zero": "topk == 0",
    "topk_zero_capacity": "topk == 0",  # its ids were reshaped before the handshake: a crash
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


def routing_grad_on_one_rank(rank: int, world: int, options: dict) -> dict:
    """Rank 0's routing weights need a gradient, rank 1's are detached: the error, or rank 0's
    routing-weight gradient against the dense reference's."""
    from tests.problems import make_problem
    from tests.reference import dense_moe

    p = make_problem(world, "uniform", seed=1)
    rw = p.rws[rank].clone().requires_grad_(rank == 0)
    x = p.xs[rank].clone().requires_grad_()
    try:
        out = mc2.fused_expert(x, *p.local_weights(rank), p.ids[rank], rw, **options)
    except ValueError as exc:
        return {"error": str(exc)}
    (out * p.grad_outs[rank]).sum().backward()
    want = p.rws[rank].clone().requires_grad_()
    (dense_moe(p.xs[rank], p.w_up, p.w_gate, p.w_down, p.ids[rank], want)
     * p.grad_outs[rank]).sum().backward()
    close = rank != 0 or torch.allclose(rw.grad, want.grad, atol=1e-10)
    return {"error": None, "close": close}


@pytest.mark.parametrize("options", [{"dedup": True, "micro_batches": 2}, {"capacity": 64}],
                         ids=["dedup", "capacity"])
def test_routing_weights_that_need_a_gradient_on_some_ranks_only(options: dict) -> None:
    """With rows once per destination or fixed slabs, whether the routing weights' gradient
    is sent back decides which tables the experts' side keeps and whether a collective runs:
    dedup hung, and capacity mode left most of rank 0's gradient zero, silently (found by a
    review). Now a ``ValueError`` on every rank; rows per pair (no such tables) stay exact."""
    for r in mc2.run_local(routing_grad_on_one_rank, 2, args=(options,), timeout_s=20):
        assert r["error"] is not None and "routing_weights need a gradient" in r["error"], r
    for r in mc2.run_local(routing_grad_on_one_rank, 2, args=({"micro_batches": 2},)):
        assert r == {"error": None, "close": True}, r
