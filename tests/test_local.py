"""Single-process behaviour: shapes, inference mode, routing bookkeeping, GEMM strategies."""

from __future__ import annotations

import pytest
import torch

import mc2
from mc2.engine.decide.routing import expert_grouping_index, micro_batch_bounds
from tests.problems import make_problem
from tests.reference import dense_moe


def test_micro_batch_bounds_taper_the_ends() -> None:
    # first and last half the others: the fill and the drain are the exposed transfers
    assert micro_batch_bounds(10, 3) == [(0, 2), (2, 7), (7, 10)]
    assert micro_batch_bounds(4096, 4) == [(0, 682), (682, 2048), (2048, 3413), (3413, 4096)]
    assert micro_batch_bounds(9, 2) == [(0, 4), (4, 9)]
    for tokens in range(0, 40):
        for k in range(1, 9):
            bounds = micro_batch_bounds(tokens, k)
            assert len(bounds) == k and bounds[0][0] == 0 and bounds[-1][1] == tokens
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_micro_batch_bounds_near_equal_when_tokens_are_few() -> None:
    assert micro_batch_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert micro_batch_bounds(0, 2) == [(0, 0), (0, 0)]


def test_expert_grouping_index_hand_case() -> None:
    # received from rank 0: 2 rows for expert 0, 1 for expert 1; from rank 1: 1 row, 2 rows
    counts = torch.tensor([[2, 1], [1, 2]])
    # receive order rows: r0e0 r0e0 r0e1 r1e0 r1e1 r1e1 -> expert order: 0 1 3 | 2 4 5
    assert expert_grouping_index(counts).tolist() == [0, 1, 3, 2, 4, 5]
    assert expert_grouping_index(torch.tensor([[3, 4]])) is None


@pytest.fixture
def problem():
    return make_problem(1, "uniform", local_experts=4, tokens=11)


def test_three_dimensional_input_matches_flat(problem) -> None:
    x, ids, rw = problem.xs[0], problem.ids[0], problem.rws[0]
    ws = problem.local_weights(0)
    flat = mc2.fused_expert(x, *ws, ids, rw, micro_batches=3)
    batched = mc2.fused_expert(x.view(1, 11, -1), *ws, ids.view(1, 11, -1), rw.view(1, 11, -1),
                               micro_batches=3)
    assert batched.shape == (1, 11, x.shape[-1])
    torch.testing.assert_close(batched.view_as(flat), flat, rtol=0, atol=1e-12)
    torch.testing.assert_close(flat, dense_moe(x, *ws, ids, rw), rtol=0, atol=1e-10)


def test_inference_keeps_no_activations(problem) -> None:
    x, ids, rw = problem.xs[0], problem.ids[0], problem.rws[0]
    ws = [w.clone().requires_grad_(True) for w in problem.local_weights(0)]
    with torch.no_grad():
        out = mc2.fused_expert(x, *ws, ids, rw)
    assert not out.requires_grad
    torch.testing.assert_close(out, dense_moe(x, *problem.local_weights(0), ids, rw),
                               rtol=0, atol=1e-10)


def test_no_routing_weights_means_plain_sum(problem) -> None:
    x, ids = problem.xs[0], problem.ids[0]
    ws = problem.local_weights(0)
    out = mc2.fused_expert(x, *ws, ids)
    torch.testing.assert_close(out, dense_moe(x, *ws, ids, torch.ones(ids.shape, dtype=x.dtype)),
                               rtol=0, atol=1e-10)


def test_grouped_and_loop_gemms_agree_in_float32() -> None:
    p = make_problem(1, "uneven", local_experts=4, tokens=40, dtype=torch.float32)
    x, ids, rw = p.xs[0], p.ids[0], p.rws[0]
    outs = {}
    for gemm in ("loop", "grouped"):
        xg = x.clone().requires_grad_(True)
        ws = [w.clone().requires_grad_(True) for w in p.local_weights(0)]
        out = mc2.fused_expert(xg, *ws, ids, rw, micro_batches=2, gemm=gemm)
        out.backward(p.grad_outs[0])
        outs[gemm] = [out, xg.grad] + [w.grad for w in ws]
    for a, b in zip(outs["loop"], outs["grouped"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_grouped_gemm_rejects_float64(problem) -> None:
    with pytest.raises(ValueError, match="gemm='grouped' needs"):
        mc2.fused_expert(problem.xs[0], *problem.local_weights(0), problem.ids[0],
                         gemm="grouped")
