"""Batch overlap in TorchTitan 0.3.0 (``mc2.integrations.torchtitan_overlap``): TorchTitan's
own Qwen3 MoE, every MoE block with a shared expert, parallelized by its own
``parallelize_qwen3`` on 4 ranks (FSDP over the 4, EP = 2, the experts FSDP-sharded over
``efsdp``), with the ``mc2_batch_overlap`` override against the same model without it: the
same losses over a few AdamW steps, each MoE block run as two staged calls per step (one per
half of the batch) with the shared expert inside; a flex-attention ``BlockMask`` split by
batch gives each half the attention of the whole; refusals on every rank."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan")

import mc2  # noqa: E402
from tests.test_torchtitan import BF16  # noqa: E402

OVERLAP = "mc2.integrations.torchtitan_overlap.mc2_batch_overlap"
FIRST_STEP = 2e-4


def test_qwen3_moe_model_with_batch_overlap_trains_like_torchtitan() -> None:
    from tests import workers_torchtitan_model as m

    steps = 3
    results = mc2.run_local(m.train_against_torchtitan, 4,
                            args=({"batch_overlap": True, "min_tokens": 1}, steps,
                                  "partial_dtensor", OVERLAP, True), deadline_s=300)
    first = results[0]
    half = (m.BATCH // 2, m.SEQ, m.DIM)
    for rank, r in enumerate(results):
        assert r["same_init"] and r["same_shards_init"], rank
        assert (r["ref_losses"], r["losses"]) == (first["ref_losses"], first["losses"]), rank
        assert r["keys"] == r["ref_keys"], "state-dict keys are TorchTitan's"
        assert all(b.endswith("MC2Qwen3TransformerBlock") for b in r["blocks"]), r["blocks"]
        # every step: each MoE layer as two staged calls, one per half, shared expert inside
        assert r["begun"] == [[(half, True)] * (2 * m.LAYERS)] * steps, r["begun"]
        for layer in r["sharding"]["layers"]:
            assert layer["node"] == "MC2RoutedExperts" and layer["group_size"] == m.EP
    ref, got = first["ref_losses"], first["losses"]
    worst = max(abs(b - a) / abs(a) for a, b in zip(ref, got, strict=True))
    assert worst <= BF16, (worst, ref, got)
    # the first step's loss, before bfloat16 rounding compounds through the optimizer: seen
    # 1.6e-5; with the shared expert's output cancelled, 1.4e-3
    assert abs(got[0] - ref[0]) / ref[0] <= FIRST_STEP, (ref, got)
    for losses in (ref, got):
        assert losses[0] - losses[-1] > 20 * worst * abs(losses[0]), (losses, worst)


def test_unsplit_the_shared_experts_still_run_inside_the_call() -> None:
    """``batch_overlap=False``: the blocks run unsplit, each MoE block as one in-layer mc2
    call per step with the shared expert inside it, equal to TorchTitan's model."""
    from tests import workers_torchtitan_model as m

    steps = 2
    results = mc2.run_local(m.train_against_torchtitan, 4,
                            args=({"batch_overlap": False}, steps, "partial_dtensor", OVERLAP,
                                  True), deadline_s=300)
    whole = (m.BATCH, m.SEQ, m.DIM)
    for rank, r in enumerate(results):
        assert r["begun"] == [[]] * steps, r["begun"]
        assert r["fused_calls"] == [[(whole, True)] * m.LAYERS] * steps, r["fused_calls"]
        ref, got = r["ref_losses"], r["losses"]
        assert abs(got[0] - ref[0]) / ref[0] <= FIRST_STEP, (rank, ref, got)
        assert max(abs(b - a) / abs(a) for a, b in zip(ref, got, strict=True)) <= BF16


def test_a_block_mask_split_by_batch_gives_each_part_the_whole_batchs_attention() -> None:
    """TorchTitan's causal + packed-document flex mask (its ``mask_mod`` reads
    ``positions[b]``) over 4 sequences, split 3 + 1: flex attention of each part with its
    piece equals the whole batch's, exactly (eager flex attention on the CPU). The piece's
    ``mask_mod`` must be shifted: the sliced mask alone refuses to run, and the unshifted
    ``mask_mod`` attends otherwise."""
    import torch
    from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention
    from torchtitan.models.common.attention import (
        get_causal_mask_mod, get_efficient_causal_mask_mod_for_packed_document)

    from mc2.integrations.torchtitan_overlap import split_block_mask

    batch, length, heads, dim = 4, 256, 2, 16
    positions = torch.stack([torch.cat([torch.arange(n), torch.arange(length - n)])
                             for n in (100, 37, 200, 256)])  # documents restart the count
    mod = and_masks(get_causal_mask_mod(),
                    get_efficient_causal_mask_mod_for_packed_document(positions))
    mask = create_block_mask(mod, batch, None, length, length, device="cpu")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, dim, generator=g) for _ in range(3))
    whole = flex_attention(q, k, v, block_mask=mask)
    first, second = split_block_mask(mask, [3, 1])
    parts = torch.cat([flex_attention(q[:3], k[:3], v[:3], block_mask=first),
                       flex_attention(q[3:], k[3:], v[3:], block_mask=second)])
    assert torch.equal(parts, whole)
    with pytest.raises(RuntimeError, match="sliced"):
        flex_attention(q[3:], k[3:], v[3:], block_mask=mask[3:4])
    unshifted = create_block_mask(mod, 1, None, length, length, device="cpu")
    assert not torch.allclose(flex_attention(q[3:], k[3:], v[3:], block_mask=unshifted),
                              whole[3:])
    broadcast = create_block_mask(get_causal_mask_mod(), 1, None, length, length, device="cpu")
    assert split_block_mask(broadcast, [3, 1]) == [broadcast, broadcast]


def test_refused_under_activation_checkpointing_on_every_rank() -> None:
    from tests import workers_torchtitan_model as m

    for rank, found in enumerate(mc2.run_local(m.batch_overlap_under_checkpointing, 2,
                                               args=(OVERLAP,), deadline_s=300)):
        assert found.startswith("ValueError: ") and "activation_checkpoint" in found, \
            (rank, found)


@pytest.mark.parametrize("options,field", [({"batch_overlap": "sometimes"}, "batch_overlap"),
                                           ({"micro_batchs": 2}, "micro_batchs")])
def test_the_override_refuses_bad_options_naming_them(options: dict, field: str) -> None:
    from tests import workers_torchtitan_model as m

    with pytest.raises(ValueError, match=field):
        m.build_model(1, "partial_dtensor", options, OVERLAP)


@pytest.mark.parametrize("parallelism", ["pp", "tp", "cp"])
def test_pipeline_tensor_and_context_parallelism_are_refused_when_parallelized(
        parallelism: str) -> None:
    """A pipeline stage's blocks would wait for a last block the stage does not hold (their
    work lost); tensor- and context-parallel activations are not split by batch here: each
    refused, naming it, when TorchTitan parallelizes the blocks (every rank alike)."""
    from types import SimpleNamespace

    from tests import workers_torchtitan_model as m

    model = m.build_model(1, "partial_dtensor", {"batch_overlap": True}, OVERLAP)
    dims = SimpleNamespace(pp_enabled=False, tp_enabled=False, cp_enabled=False)
    setattr(dims, f"{parallelism}_enabled", True)
    with pytest.raises(ValueError, match=f"{parallelism} > 1"):
        model.layers["0"].parallelize(dims)
