"""A recompute runs the K its own forward ran, also where another call of another shape shares
its experts (one experts module over two inputs of different token counts, each call under
activation checkpointing): 2 ranks, float64, ``micro_batches="auto"``."""

from __future__ import annotations

import torch

import mc2
from tests.workers_recompute_shapes import two_shapes_over_shared_experts


def test_each_recompute_runs_its_own_forwards_k() -> None:
    results = mc2.run_local(two_shapes_over_shared_experts, 2, timeout_s=120)
    for rank in results:
        plain, got = rank["plain"], rank["checkpointed"]
        # the planner chose K = 3 for the long call, then K = 1 for the short one
        assert plain["long"]["forward_experts"] == [0, 1, 2]
        assert plain["short"]["forward_experts"] == [0]
        # each forward, then its recompute with the same K
        assert got["long"]["forward_experts"] == [0, 0, 1, 1, 2, 2]
        assert got["short"]["forward_experts"] == [0, 0]
        for name in ("long", "short"):
            for what in ("out", "x_grad"):
                torch.testing.assert_close(got[name][what], plain[name][what], rtol=1e-12,
                                           atol=1e-12, msg=f"{name} {what}")
        for mine, want in zip(got["expert_grads"], plain["expert_grads"]):
            torch.testing.assert_close(mine, want, rtol=1e-12, atol=1e-12)
