"""Activation checkpointing around MoE layers: equal results, and mc2's policy recomputes a
layer without a second All-to-All (2 ranks, two blocks, float64)."""

from __future__ import annotations

import pytest
import torch

import mc2
from tests.workers_recompute import checkpointing_modes, full_state


@pytest.fixture(scope="module")
def modes():
    x = torch.randn(2 * 10, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    return mc2.run_local(checkpointing_modes, 2, args=(x, full_state()), timeout_s=120)


@pytest.mark.parametrize("mode", ["full", "selective", "selective_max", "full+dedup",
                                  "selective+dedup"])
def test_checkpointing_gives_the_same_outputs_and_gradients(modes, mode: str) -> None:
    for rank in modes:
        plain, got = rank["none"], rank[mode]
        torch.testing.assert_close(got["out"], plain["out"], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["x_grad"], plain["x_grad"], rtol=1e-12, atol=1e-12)
        for name, grad in plain["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-12, atol=1e-12)


def test_the_policy_recomputes_without_collectives(modes) -> None:
    for rank in modes:
        plain = rank["none"]["backward_collectives"]
        assert plain == 2 * 2 * 2  # 2 layers x K=2 x (dispatch, combine) of the gradients
        assert rank["selective"]["backward_collectives"] == plain  # the recompute made none
        assert rank["selective_max"]["backward_collectives"] == plain
        # a full recompute plans and exchanges again: the handshake (whose ids, this call being
        # small, count its routes: no counts exchange) and 2K All-to-Alls a layer
        assert rank["full"]["backward_collectives"] == plain + 2 * (1 + 2 * 2)
        # rows once per destination: the routing weights' gradients return in one more a
        # layer; a recompute under the policy still makes none, a full one also its slots
        once = rank["selective+dedup"]["backward_collectives"]
        assert once == plain + 2
        assert rank["full+dedup"]["backward_collectives"] == once + 2 * (3 + 2 * 2)


def test_saved_tensor_hooks_see_the_activations(modes) -> None:
    assert all(rank["none"]["gate_up_packed"] for rank in modes)


def test_the_policy_names_the_fused_call() -> None:
    from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

    policy = mc2.checkpoint_policy(torch.ops.aten.mm.default)
    ctx = SelectiveCheckpointContext(is_recompute=False)
    assert policy(ctx, torch.ops.mc2.fused_expert.default) is CheckpointPolicy.MUST_SAVE
    assert policy(ctx, torch.ops.aten.mm.default) is CheckpointPolicy.MUST_SAVE
    assert policy(ctx, torch.ops.aten.add.Tensor) is CheckpointPolicy.PREFER_RECOMPUTE
