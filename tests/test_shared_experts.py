"""Shared experts (every token, computed under the first dispatch) equal the dense reference."""

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
