"""Single-process behaviour: shapes, inference mode, routing bookkeeping, GEMM strategies."""

from __future__ import annotations

import pytest
import torch

import mc2
from mc2.engine.decide.routing import expert_grouping_indices, micro_batch_bounds
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
    assert expert_grouping_indices(counts.unsqueeze(1), [6])[0].tolist() == [0, 1, 3, 2, 4, 5]
    assert expert_grouping_indices(torch.tensor([[[3, 4]]]), [7]) is None


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


def test_the_backward_frees_each_micro_batch_as_it_goes(problem, monkeypatch) -> None:
    """Without a saved-tensor hook, a micro-batch's activations are gone once its backward
    used them (they were held by ``ctx.saved_tensors`` until the whole backward returned)."""
    import gc
    import weakref

    from mc2.engine.compute import experts

    used: list[weakref.ref] = []
    alive_at_each: list[int] = []
    original = experts.swiglu_backward_input

    def watching(rows, activations, *args, **kwargs):
        gc.collect()
        alive_at_each.append(sum(ref() is not None for ref in used))
        used.append(weakref.ref(activations.gate_up))
        return original(rows, activations, *args, **kwargs)

    monkeypatch.setattr(experts, "swiglu_backward_input", watching)
    x = problem.xs[0].clone().requires_grad_(True)
    ws = [w.clone().requires_grad_(True) for w in problem.local_weights(0)]
    out = mc2.fused_expert(x, *ws, problem.ids[0], problem.rws[0], micro_batches=4)
    out.sum().backward()
    assert len(alive_at_each) == 4  # one expert backward per micro-batch
    assert alive_at_each == [0, 0, 0, 0]  # the earlier micro-batches' activations are freed


def test_autocast_casts_each_parameter_once(problem) -> None:
    """Under autocast the experts are cast through a cache: two calls with the same weights
    (two micro-batches of batch overlap, two layers sharing experts) share one copy while it
    is alive, and a changed parameter is cast again."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ws = [w.float().clone().requires_grad_(True) for w in problem.local_weights(0)]
    shapes = {tuple(w.shape) for w in ws}

    class CountCasts(TorchDispatchMode):
        casts = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) in shapes:
                CountCasts.casts += 1
            return func(*args, **kwargs)

    x, ids, rw = problem.xs[0].float(), problem.ids[0], problem.rws[0].float()
    with torch.autocast("cpu", dtype=torch.bfloat16), CountCasts():
        first = mc2.fused_expert(x, *ws, ids, rw)
        second = mc2.fused_expert(x, *ws, ids, rw)
        assert CountCasts.casts == len(ws)
        with torch.no_grad():
            ws[0].mul_(2)  # a new version: its copy is stale
        third = mc2.fused_expert(x, *ws, ids, rw)
        assert CountCasts.casts == len(ws) + 1
    assert first.dtype == torch.bfloat16
    (first.float().sum() + second.float().sum() + third.float().sum()).backward()
    assert all(w.grad is not None and w.grad.dtype == torch.float32 for w in ws)
