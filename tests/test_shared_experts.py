"""Shared experts (every token, computed under the first dispatch), with or without a per-token
scale (Qwen2-MoE's gated shared expert), equal the dense reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mc2
from tests.problems import make_problem
from tests.reference import dense_moe
from tests.workers import run_with_shared


@pytest.mark.parametrize("k", [1, 3])
def test_shared_experts_match_reference_on_two_ranks(k: int) -> None:
    p = make_problem(2, "uneven", seed=11)
    g = torch.Generator().manual_seed(3)
    shared = [torch.randn(2, 16, 8, generator=g, dtype=torch.float64) * 0.3,
              torch.randn(2, 16, 8, generator=g, dtype=torch.float64) * 0.3,
              torch.randn(2, 8, 16, generator=g, dtype=torch.float64) * 0.3]
    got = mc2.run_local(run_with_shared, 2, args=(p, shared, k))

    x = torch.cat(p.xs).requires_grad_(True)
    ss = [t.clone().requires_grad_(True) for t in shared]
    out = dense_moe(x, p.w_up, p.w_gate, p.w_down, torch.cat(p.ids), torch.cat(p.rws))
    for i in range(2):
        out = out + (F.silu(x @ ss[1][i]) * (x @ ss[0][i])) @ ss[2][i]
    out.backward(torch.cat(p.grad_outs))
    sizes = [t.shape[0] for t in p.xs]
    for rank, r in enumerate(got):
        torch.testing.assert_close(r["out"], out.detach().split(sizes)[rank], rtol=0, atol=1e-10)
        torch.testing.assert_close(r["x"], x.grad.split(sizes)[rank], rtol=0, atol=1e-10)
    # shared weights are replicated: their gradient is the sum of the ranks' contributions
    for j in range(3):
        total = got[0]["shared"][j] + got[1]["shared"][j]
        torch.testing.assert_close(total, ss[j].grad, rtol=0, atol=1e-10)


def test_shared_weights_must_come_together() -> None:
    p = make_problem(1, "uniform")
    with pytest.raises(ValueError, match="go together"):
        mc2.fused_expert(p.xs[0], *p.local_weights(0), p.ids[0],
                         shared_up=torch.zeros(1, 16, 4, dtype=torch.float64))


def run_with_scaled_shared(rank: int, world: int, problem, shared: list, scale: torch.Tensor,
                           k: int) -> dict:
    """fused_expert with shared experts times a per-token scale on this rank's tokens: once
    with everything trainable, once with only the scale (it alone must make the call keep what
    the backward needs); then a call where rank 1 alone passes a bad scale."""
    mine = scale.split([t.shape[0] for t in problem.xs])[rank]

    def step(train_all: bool) -> tuple:
        x = problem.xs[rank].clone().requires_grad_(train_all)
        ss = [t.clone().requires_grad_(train_all) for t in shared]
        s = mine.clone().requires_grad_(True)
        out = mc2.fused_expert(x, *problem.local_weights(rank), problem.ids[rank],
                               problem.rws[rank], micro_batches=k, shared_up=ss[0],
                               shared_gate=ss[1], shared_down=ss[2], shared_scale=s)
        out.backward(problem.grad_outs[rank])
        return out.detach(), x.grad, [t.grad for t in ss], s.grad

    out, grad_x, grad_shared, grad_scale = step(True)
    _, _, _, only_scale = step(False)
    bad = mine[:-1] if rank == 1 else mine
    try:
        mc2.fused_expert(problem.xs[rank], *problem.local_weights(rank), problem.ids[rank],
                         problem.rws[rank], shared_up=shared[0], shared_gate=shared[1],
                         shared_down=shared[2], shared_scale=bad)
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"out": out, "x": grad_x, "shared": grad_shared, "scale": grad_scale,
            "only_scale": only_scale, "error": error}


def test_scaled_shared_experts_match_reference_on_two_ranks() -> None:
    """Qwen2-MoE's gated shared expert: out = routed + scale * shared, scale's gradient too;
    a bad scale on one rank stops every rank."""
    p = make_problem(2, "uneven", seed=5)
    g = torch.Generator().manual_seed(4)
    shared = [torch.randn(1, 16, 8, generator=g, dtype=torch.float64) * 0.3,
              torch.randn(1, 16, 8, generator=g, dtype=torch.float64) * 0.3,
              torch.randn(1, 8, 16, generator=g, dtype=torch.float64) * 0.3]
    x = torch.cat(p.xs)
    scale = torch.rand(x.shape[0], 1, generator=g, dtype=torch.float64) + 0.5
    got = mc2.run_local(run_with_scaled_shared, 2, args=(p, shared, scale, 2))

    x.requires_grad_(True)
    s = scale.clone().requires_grad_(True)
    ss = [t.clone().requires_grad_(True) for t in shared]
    routed = dense_moe(x, p.w_up, p.w_gate, p.w_down, torch.cat(p.ids), torch.cat(p.rws))
    out = routed + s * ((F.silu(x @ ss[1][0]) * (x @ ss[0][0])) @ ss[2][0])
    out.backward(torch.cat(p.grad_outs))
    sizes = [t.shape[0] for t in p.xs]
    for rank, r in enumerate(got):
        want = {"out": out.detach(), "x": x.grad, "scale": s.grad, "only_scale": s.grad}
        for key, value in want.items():
            torch.testing.assert_close(r[key], value.split(sizes)[rank], rtol=0, atol=1e-10)
    for j in range(3):
        total = got[0]["shared"][j] + got[1]["shared"][j]
        torch.testing.assert_close(total, ss[j].grad, rtol=0, atol=1e-10)
    assert "shared_scale must be one factor per token" in got[1]["error"]
    assert "another rank of the group rejected" in got[0]["error"]


def test_shared_scale_needs_shared_experts_and_one_factor_per_token() -> None:
    p = make_problem(1, "uniform")
    x, tokens = p.xs[0], p.xs[0].shape[0]
    with pytest.raises(ValueError, match="pass shared_up/gate/down too"):
        mc2.fused_expert(x, *p.local_weights(0), p.ids[0],
                         shared_scale=torch.ones(tokens, 1, dtype=torch.float64))
    shared = {"shared_up": torch.zeros(1, 16, 4, dtype=torch.float64),
              "shared_gate": torch.zeros(1, 16, 4, dtype=torch.float64),
              "shared_down": torch.zeros(1, 4, 16, dtype=torch.float64)}
    with pytest.raises(ValueError, match="one factor per token"):
        mc2.fused_expert(x, *p.local_weights(0), p.ids[0], **shared,
                         shared_scale=torch.ones(tokens, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="x's dtype"):
        mc2.fused_expert(x, *p.local_weights(0), p.ids[0], **shared,
                         shared_scale=torch.ones(tokens, 1, dtype=torch.float32))
