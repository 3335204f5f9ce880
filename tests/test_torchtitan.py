"""mc2 in TorchTitan 0.3.0 (issue 41): its MoE block with EP = 2 on Gloo, mc2's routed-experts
node switched on by TorchTitan's ``--override.imports`` mechanism, against the same block with
TorchTitan's All-to-All token dispatcher from the same weights and tokens: output, input
gradient and every parameter's gradient within bfloat16 rounding (TorchTitan's GroupedExperts
computes in bfloat16 whatever the parameter dtype, and so does mc2's node). Weights reach
``fused_expert`` as views; DeepEP/HybridEP and bad options are refused on every rank."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan")

import mc2  # noqa: E402
from tests import workers_torchtitan as w  # noqa: E402

# bfloat16 keeps 8 significant bits (relative rounding 2**-9, 2**-8 per GEMM output); sums of
# a few dozen rounded products differ by a few of those. Relative to the tensor's largest
# element, so a wrong route, weight or scale (errors of order 1) cannot pass. Seen: <= 8e-3;
# gate and up swapped: >= 0.66.
BF16 = 2e-2


def _check(results: list[dict], tolerance: float) -> None:
    for rank, r in enumerate(results):
        assert r["node"] == "MC2RoutedExperts"
        assert r["keys"] == r["ref_keys"], "state-dict keys are TorchTitan's"
        assert r["local_experts"] == w.E // len(results)
        assert r["group_size"] == len(results)
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= tolerance, (rank, worst, r["errors"])
        assert any(k.endswith("w1_EFD") for k in r["errors"])


@pytest.mark.parametrize("dtype,micro_batches", [("float32", 2), ("bfloat16", 3),
                                                 ("float32", 1)])
def test_equal_to_torchtitans_dispatcher_dtensor_weights(dtype: str, micro_batches: int) -> None:
    """partial_dtensor: the experts are Shard(0) DTensors on the ep mesh."""
    results = mc2.run_local(w.equal_to_torchtitan, 2, args=(
        dtype, {"micro_batches": micro_batches}, "partial_dtensor", False, False))
    assert all(r["dtensor"] for r in results)
    _check(results, BF16)


def test_equal_with_plain_local_shards_under_spmd_types() -> None:
    """spmd_types: the experts are plain local (E/2, ...) tensors."""
    results = mc2.run_local(w.equal_to_torchtitan, 2, args=(
        "float32", {"micro_batches": 2}, "spmd_types", False, False))
    assert not any(r["dtensor"] for r in results)
    _check(results, BF16)


def test_a_hook_on_the_experts_runs_as_torchtitan_runs_it() -> None:
    """A forward hook on TorchTitan's ``GroupedExperts``: mc2 reads their weights only where
    nothing else would run, so the hooked module runs as the experts stage, called, and the
    hook's scaling reaches the output and gradients as in TorchTitan's own node (before:
    skipped, the output 1.5x off)."""
    results = mc2.run_local(w.equal_to_torchtitan, 2, args=(
        "float32", {"micro_batches": 2}, "partial_dtensor", False, False, False, True))
    _check(results, BF16)


def test_equal_with_shared_experts_and_auto() -> None:
    """A DeepSeek/Qwen-style block (shared experts beside the routed ones, TorchTitan's own
    sum), micro_batches="auto" (the planner measures on first use, on both ranks)."""
    results = mc2.run_local(w.equal_to_torchtitan, 2, args=(
        "float32", {"micro_batches": "auto"}, "partial_dtensor", True, False))
    assert all(any("shared_experts" in k for k in r["errors"]) for r in results)
    _check(results, BF16)


@pytest.mark.parametrize("world", [2, 4])
def test_equal_to_the_unsharded_block_in_one_process(world: int) -> None:
    """EP = 2 and 4 with mc2 against EP = 1 (the block unsharded, TorchTitan's local path) on
    every rank's tokens at once: output, input gradient, every expert's and router gradient."""
    results = mc2.run_local(w.equal_to_ep1, world, args=({"micro_batches": 2},))
    for rank, r in enumerate(results):
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= BF16, (rank, worst, r["errors"])
        assert any(k.endswith("w1_EFD") for k in r["errors"])
        assert any("router" in k for k in r["errors"])
        # mc2's node ran its call, on the EP group (not TorchTitan's EP = 1 forward) ...
        assert r["node"] == "MC2RoutedExperts" and r["group_size"] == world, r
        assert r["calls"] == 1 and r["micro_batches"] == 2, r
        # ... reading to the host no more than fused_expert's own: two in the forward, none
        # in the whole backward
        assert r["forward_reads"] <= 2 and r["backward_reads"] == 0, r


def test_equal_under_full_activation_checkpointing() -> None:
    """torch.utils.checkpoint over the whole block: the recompute runs mc2's call again (its
    collectives included, on both ranks) and the gradients are the uncheckpointed ones."""
    results = mc2.run_local(w.equal_to_torchtitan, 2, args=(
        "float32", {"micro_batches": 2}, "partial_dtensor", False, True))
    _check(results, BF16)


def test_grouped_experts_weights_reach_fused_expert_as_views() -> None:
    """bf16 parameters: gate = w1ᵀ, up = w3ᵀ, down = w2ᵀ, each a view of the local shard."""
    for rank in mc2.run_local(w.weights_passed_without_copy, 2):
        for name, seen in rank.items():
            assert seen["same_memory"] and seen["transposed"], (name, seen)
        assert rank["gate"]["shape"] == (w.E // 2, w.D, w.F)
        assert rank["down"]["shape"] == (w.E // 2, w.F, w.D)


def test_refusals_on_every_rank() -> None:
    results = mc2.run_local(w.refusals, 2)
    assert results[0] == results[1]
    errors = results[0]
    assert "DeepEPTokenDispatcher" in errors["deepep"]
    assert "HybridEPTokenDispatcher" in errors["hybridep"]
    assert "TorchAOTokenDispatcher" in errors["torchao"] and "pads" in errors["torchao"]
    assert "micro_batch" in errors["unknown option"] and "MC2Config" in errors["unknown option"]
    assert "micro_batches" in errors["bad value"]


def test_gpt_oss_experts_run_as_mc2s_experts_stage() -> None:
    """gpt-oss's experts (fused mlp1 with biases, clamped SwiGLU) are no SwiGLU mc2 computes:
    TorchTitan's own module runs as the experts stage on each micro-batch. bfloat16: its
    experts return bfloat16 whatever the input (TorchTitan's own block fails in float32)."""
    results = mc2.run_local(w.equal_to_torchtitan, 2, args=(
        "bfloat16", {"micro_batches": 2}, "partial_dtensor", False, False, True))
    assert all(any(k.endswith("mlp2_bias_ED") for k in r["errors"]) for r in results)
    for rank, r in enumerate(results):
        assert r["node"] == "MC2RoutedExperts" and r["keys"] == r["ref_keys"]
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= BF16, (rank, worst, r["errors"])


def test_the_command_line_form_switches_the_node() -> None:
    """The documented ``--override.imports`` token, parsed by TorchTitan's own CLI parser and
    applied by its ``apply_overrides``, turns RoutedExperts into MC2RoutedExperts with the
    keywords as its MC2Config."""
    from torchtitan.config import OverrideConfig, apply_overrides
    from torchtitan.config.override import parse_cli_imports

    from mc2.integrations.torchtitan import MC2RoutedExperts

    token = 'mc2.integrations.torchtitan.mc2_routed_experts={"micro_batches": "auto"}'
    cfg = w.moe_config()
    applied = apply_overrides(OverrideConfig(imports=parse_cli_imports([token])), cfg)
    assert len(applied) == 1 and "MC2RoutedExperts" in applied[0]
    assert isinstance(cfg.routed_experts, MC2RoutedExperts.Config)
    assert cfg.routed_experts.mc2 == {"micro_batches": "auto"}
    assert cfg.routed_experts.sharding_config is not None  # carried over by derive
    node = cfg.routed_experts.build()
    assert isinstance(node, MC2RoutedExperts) and node.mc2_config.micro_batches == "auto"
    assert cfg.to_dict()["routed_experts"]["mc2"] == {"micro_batches": "auto"}


def test_the_paired_accumulation_override_extends_torchtitans_checkpoint_manager() -> None:
    """``mc2_paired_accumulation`` replaces the checkpoint node by TorchTitan's DCP manager
    extended, every field carried over; its ``load`` (where ``train()`` begins) pairs the
    trainer it was built with, once, and ends a paired step left open at every load; a
    trainer it cannot pair raises there, naming why.
    Another manager's config is refused by the factory, naming it."""
    from types import SimpleNamespace

    import torch
    from torchtitan.components.checkpointer import BaseCheckpointManager
    from torchtitan.config import OverrideConfig, apply_overrides
    from torchtitan.config.override import parse_cli_imports

    from mc2.integrations.torchtitan_schedule import (
        PairedCheckpointManager, PairedFwdBwd, mc2_paired_accumulation
    )

    from tests import workers_torchtitan_model as m

    tree = m.checkpoint_tree()
    tree.checkpoint.interval = 7
    applied = apply_overrides(OverrideConfig(imports=parse_cli_imports([m.PAIRED])), tree)
    assert len(applied) == 1 and "PairedCheckpointManager" in applied[0]
    assert isinstance(tree.checkpoint, PairedCheckpointManager.Config)
    assert tree.checkpoint.interval == 7  # carried over by derive

    paired: list[object] = []
    abandoned: list[str] = []  # every load ends a step left open: the model changes
    made = SimpleNamespace(loop=SimpleNamespace(abandon=abandoned.append))
    trainer = SimpleNamespace(
        model_parts=[torch.nn.Linear(2, 2)], fwd_bwd_fn=None,
        parallel_dims=SimpleNamespace(pp_enabled=False, cp_enabled=False),
        config=SimpleNamespace(training=SimpleNamespace(disable_cuda_graphs=True)))
    manager = m.checkpoint_manager(tree, trainer)
    assert trainer.fwd_bwd_fn is None  # nothing before train() begins
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("mc2.integrations.torchtitan_schedule.pair_accumulation",
                      lambda t: (paired.append(t), made)[1])
        assert manager.load(step=-1) is False  # checkpointing off: nothing loaded
        manager.load(step=-1)
    assert paired == [trainer]  # once
    assert abandoned == ["a checkpoint was loaded"] * 2

    trainer.config.training.disable_cuda_graphs = False
    manager = m.checkpoint_manager(tree, trainer)
    with pytest.raises(ValueError, match="disable_cuda_graphs"):
        manager.load(step=-1)
    assert not isinstance(trainer.fwd_bwd_fn, PairedFwdBwd)
    with pytest.raises(ValueError, match="BaseCheckpointManager.Config"):
        mc2_paired_accumulation(BaseCheckpointManager.Config())


def test_selective_ac_with_the_mc2_override_recomputes_without_an_exchange() -> None:
    """TorchTitan's own ``SelectiveAC`` over the block: as it is, its recompute runs mc2's
    call again (more collectives in the backward, the same gradients); with the
    ``mc2_selective_ac`` override it saves mc2's operator and the backward issues exactly
    the collectives of an uncheckpointed one. Both equal TorchTitan's dispatcher."""
    results = mc2.run_local(w.under_selective_ac, 2)
    for rank, r in enumerate(results):
        for mode, found in r.items():
            worst = max(found["errors"], key=found["errors"].get)
            assert found["errors"][worst] <= BF16, (rank, mode, worst, found["errors"])
        assert r["mc2_selective"]["policy"] == "MC2SelectiveAC"
        assert r["selective"]["policy"] == "SelectiveAC"
        plain = r["none"]["backward_collectives"]
        assert plain > 0
        assert r["mc2_selective"]["backward_collectives"] == plain
        assert r["selective"]["backward_collectives"] > plain  # TorchTitan's list: recomputed


def test_qwen3_moe_model_trains_like_torchtitan_under_fsdp_and_ep() -> None:
    """TorchTitan's own Qwen3 MoE (2 layers, 8 experts top-2) parallelized by its own
    ``parallelize_qwen3`` on 4 ranks: FSDP over the 4 for the dense parameters, EP = 2 for
    the experts, FSDP-sharded over ``efsdp`` (2). Built twice from the same seed, with and
    without mc2's override, and trained 3 AdamW steps on the same tokens (TorchTitan's
    cross-entropy, its expert-bias hook, bf16 FSDP parameters): the global losses per step
    agree within bfloat16 rounding (seen 7e-5) while they fall by far more (~7 %); mc2's node
    ran in every layer on a 2-rank EP group; the state-dict keys and the sharding are
    TorchTitan's."""
    from tests import workers_torchtitan_model as m

    steps = 3
    results = mc2.run_local(m.train_against_torchtitan, 4, args=({"micro_batches": 2}, steps),
                            deadline_s=300)
    first = results[0]
    for rank, r in enumerate(results):
        assert r["same_init"] and r["same_shards_init"], rank
        assert (r["ref_losses"], r["losses"]) == (first["ref_losses"], first["losses"]), rank
        assert r["keys"] == r["ref_keys"], "state-dict keys are TorchTitan's"
        assert r["sharding"]["dense"] == r["ref_sharding"]["dense"] == [
            (("fsdp",), ("S(0)",))], r["sharding"]["dense"]
        for ref_layer, layer in zip(r["ref_sharding"]["layers"], r["sharding"]["layers"],
                                    strict=True):
            assert ref_layer["node"] == "RoutedExperts" and ref_layer["group_size"] is None
            assert layer["node"] == "MC2RoutedExperts" and layer["group_size"] == m.EP
            assert layer["weights"] == ref_layer["weights"], (rank, layer, ref_layer)
            for name, weight in layer["weights"].items():
                assert weight["mesh"] == ("efsdp", "ep") and weight["efsdp_dim"] == 0, name
                assert weight["global"][0] == m.EXPERTS, name
                assert weight["local"][0] == m.EXPERTS // len(results), name  # EP x efsdp
    ref, got = first["ref_losses"], first["losses"]
    assert len(got) == steps
    worst = max(abs(b - a) / abs(a) for a, b in zip(ref, got, strict=True))
    assert worst <= BF16, (worst, ref, got)
    for losses in (ref, got):
        assert losses[0] - losses[-1] > 20 * worst * abs(losses[0]), (losses, worst)


def test_torchtitans_accumulation_pairs_and_trains_as_its_own_loop() -> None:
    """TorchTitan's gradient accumulation (3 micro-batches a step, as its ``train_step``
    calls ``fwd_bwd_fn``) on its Qwen3 MoE under its own FSDP + EP (4 ranks): with
    ``pair_accumulation`` each micro-batch's forward runs beside the previous one's
    backward (the forward's exchanges travel across the backward's compute), FSDP2's units
    held gathered for the step and sharded again after it; the global losses of 3 AdamW
    steps equal TorchTitan's own loop's within bfloat16 rounding while they fall by far
    more. A trainer with CUDA graphs, TorchTitan's chunked loss, memory-budget activation
    checkpointing or a compiled model is refused, naming it."""
    from tests import workers_torchtitan_model as m

    results = mc2.run_local(m.accumulation_against_torchtitan, 4, args=(3, 3), deadline_s=300)
    first = results[0]
    for rank, r in enumerate(results):
        assert (r["ref_losses"], r["losses"]) == (first["ref_losses"], first["losses"]), rank
        assert r["paired_by_override"], rank
        assert r["under_backward"] > 0, rank
        assert r["sharded"], rank
        assert "disable_cuda_graphs" in r["refused"]["cuda graphs"]
        assert "ChunkedLossWrapper" in r["refused"]["chunked loss"]
        assert "MemoryBudgetAC" in r["refused"]["memory budget"], r["refused"]
        assert "compile.enable" in r["refused"]["compiled"], r["refused"]
    ref, got = first["ref_losses"], first["losses"]
    worst = max(abs(b - a) / abs(a) for a, b in zip(ref, got, strict=True))
    assert worst <= BF16, (worst, ref, got)
    for losses in (ref, got):
        assert losses[0] - losses[-1] > 20 * worst * abs(losses[0]), (losses, worst)


def test_shared_expert_views_only_where_the_linears_read_as_their_weights() -> None:
    """TorchTitan's shared ``FeedForward`` enters the call as views of its weights only while
    each linear is TorchTitan's own, bias-free, in bfloat16, with no hook and no
    parametrization, asked at every call: a hook (an adapter's, an optimizer's) or a
    parametrization added later makes it run beside the call, as TorchTitan runs it."""
    import torch
    from torch.nn.utils import parametrize
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear

    from mc2.integrations.torchtitan import shared_views

    shared = FeedForward.Config(w1=Linear.Config(in_features=8, out_features=16),
                                w2=Linear.Config(in_features=16, out_features=8),
                                w3=Linear.Config(in_features=8, out_features=16)).build()
    shared = shared.to(torch.bfloat16)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    assert shared_views(shared, x) is not None
    handle = shared.w1.register_forward_hook(lambda *_: None)
    assert shared_views(shared, x) is None
    handle.remove()
    assert shared_views(shared, x) is not None

    class Doubled(torch.nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return 2 * w

    parametrize.register_parametrization(shared.w3, "weight", Doubled())
    assert shared_views(shared, x) is None
