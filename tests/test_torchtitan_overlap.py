"""Batch overlap in TorchTitan 0.3.0 (``mc2.integrations.torchtitan_overlap``): TorchTitan's
own Qwen3 MoE, every MoE block with a shared expert, parallelized by its own
``parallelize_qwen3`` on 4 ranks (FSDP over the 4, EP = 2, the experts FSDP-sharded over
``efsdp``), with the ``mc2_batch_overlap`` override against the same model without it: the
same losses over a few AdamW steps, each MoE block run as two staged calls per step (one per
half of the batch) with the shared expert inside, with ``batch_overlap`` ``True``, ``False``
and ``"auto"`` (what it measured and chose visible); a flex-attention ``BlockMask`` split by
batch gives each half the attention of the whole; refusals on every rank, pipeline
parallelism through TorchTitan's own ``pipeline_llm`` among them."""

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


@pytest.mark.parametrize("hooked", ["moe", "moe.routed_experts", "moe subclass"])
def test_a_hooked_moe_module_runs_unsplit_and_called(hooked: str) -> None:
    """Batch overlap runs a block's parts, not its MoE module or routed experts: where one
    of them has a forward hook (here scaling its output), or the MoE a forward of its own (a
    subclass's; found by a review), the forward runs unsplit and calls the module, so the
    hook runs as in TorchTitan's model; the losses equal TorchTitan's (before: split, the
    hook or the forward skipped)."""
    from tests import workers_torchtitan_model as m

    results = mc2.run_local(m.train_against_torchtitan, 4,
                            args=({"batch_overlap": True, "min_tokens": 1}, 1, "partial_dtensor",
                                  OVERLAP, True, False, hooked), deadline_s=300)
    for rank, r in enumerate(results):
        assert r["begun"] == [[]], r["begun"]  # nothing split
        ref, got = r["ref_losses"], r["losses"]
        assert abs(got[0] - ref[0]) / ref[0] <= FIRST_STEP, (rank, ref, got)


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


def test_batch_overlap_auto_trains_like_torchtitan_and_shows_what_it_decided() -> None:
    """``{"batch_overlap": "auto"}`` through the override: the training steps alternate split
    and unsplit forwards (the first of each side untimed), the shared expert inside the call
    either way, the losses TorchTitan's; the decision shows what it measured
    (``Planner.batch_overlaps()``), decides after three timed forwards a side, agreed on each
    EP group, and the next forward runs as it chose."""
    from tests import workers_torchtitan_model as m

    steps = 4
    results = mc2.run_local(m.train_against_torchtitan, 4,
                            args=({"batch_overlap": "auto", "min_tokens": 1}, steps,
                                  "partial_dtensor", OVERLAP, True, True), deadline_s=300)
    split = [((m.BATCH // 2, m.SEQ, m.DIM), True)] * (2 * m.LAYERS)
    whole = [((m.BATCH, m.SEQ, m.DIM), True)] * m.LAYERS
    first = results[0]
    for rank, r in enumerate(results):
        assert r["same_init"] and r["same_shards_init"], rank
        assert (r["ref_losses"], r["losses"]) == (first["ref_losses"], first["losses"]), rank
        assert all(b.endswith("MC2Qwen3TransformerBlock") for b in r["blocks"]), r["blocks"]
        assert r["begun"] == [split, split, [], []], r["begun"]
        assert r["fused_calls"] == [[], [], whole, whole], r["fused_calls"]
        d = r["decided"]
        after = d["after steps"]
        (measured,) = after["planner"]
        assert after["chosen"] is None and measured["mode"] == "auto", after
        assert [len(measured["times"][side]) for side in ("on", "off")] == [1, 1], measured
        # the no-grad forwards after the steps: measured apart from the training steps, the
        # sides alternating until three forwards a side are timed; split or not, the same
        # loss (seen: bitwise), and TorchTitan's within the training steps' bfloat16 drift
        assert [split for _, split in d["forwards"]] == [True, True, False, False] * 3, d
        (same, _) = d["forwards"][0]
        for loss, _ in d["forwards"]:
            assert abs(loss - same) <= FIRST_STEP * abs(same), d["forwards"]
            assert abs(loss - d["want"]) <= BF16 * abs(d["want"]), (loss, d["want"])
        (report,) = d["planner"]
        decided = report["forward_only"]  # no-grad forwards decide for forwards alone
        assert d["chosen"] in (True, False) and decided["chosen"] is d["chosen"], d
        assert [len(decided["times"][side]) for side in ("on", "off")] == [3, 3], decided
        loss, begun, calls = d["decided"]
        assert (begun, calls) == ((split, []) if d["chosen"] else ([], whole)), d
        assert abs(loss - same) <= FIRST_STEP * abs(same), (loss, same)
        # agreed on every rank, not on the EP group (FSDP's collectives span the EP groups):
        # the same times (the slowest rank's) and the same choice
        assert len(d["group"]) == len(results) > m.EP and rank in d["group"]
        for other in d["group"]:
            assert results[other]["decided"]["planner"] == d["planner"], (rank, other)
    ref, got = first["ref_losses"], first["losses"]
    worst = max(abs(b - a) / abs(a) for a, b in zip(ref, got, strict=True))
    assert worst <= BF16 and abs(got[0] - ref[0]) / ref[0] <= FIRST_STEP, (ref, got)
    for losses in (ref, got):
        assert losses[0] - losses[-1] > 20 * worst * abs(losses[0]), (losses, worst)


def test_pipeline_parallelism_is_refused_on_every_rank_or_its_blocks_run_whole() -> None:
    """TorchTitan's own ``pipeline_llm`` (2 stages of 2 blocks, 4 ranks). With EP = 2 the
    override's blocks refuse it on every rank when the stages are parallelized, naming
    ``pipeline_parallel_degree``. With EP = 1 TorchTitan does not parallelize the blocks, so
    nothing refuses: they run whole (said once), and 2 steps through its 1F1B schedule give
    TorchTitan's losses. (Recorded, the first stage's blocks waited for a last block it does
    not hold and handed its input on unchanged.)"""
    from tests import workers_torchtitan_model as m

    for rank, found in enumerate(mc2.run_local(m.pipeline_parallelism, 4, args=(OVERLAP,),
                                               deadline_s=300)):
        refused = found[2]
        assert refused.startswith("ValueError: ") and "pp > 1" in refused \
            and "pipeline_parallel_degree" in refused, (rank, refused)
        r = found[1]
        assert r["blocks mc2"] == ["FSDPMC2Qwen3TransformerBlock"] * 2, r["blocks mc2"]
        assert r["begun"] == []
        assert any("not parallelized" in said for said in r["said mc2"]), r["said mc2"]
        ref, got = r["losses ref"], r["losses mc2"]
        if rank < 2:  # the first stage
            assert ref == got == [None, None]
        else:
            assert len(set(ref)) == 2 and got == pytest.approx(ref, rel=1e-6), (ref, got)


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
