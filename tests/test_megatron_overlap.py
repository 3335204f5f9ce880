"""Batch overlap in Megatron-Core 0.16.1: a ``GPTModel`` built from
``use_mc2(spec, batch_overlap=True)`` trains under Megatron's DDP with the losses of the same
model on Megatron's own ``MoELayer`` (same weights), the decoder's two halves of each batch run
stage by stage (two staged mc2 calls per MoE layer and step), with Megatron's state-dict keys:
with one and with two expert-parallel groups, with ``batch_overlap="auto"`` (what it measured
and chose visible), and in pipeline and virtual-pipeline stages under Megatron's own
schedules; what it cannot split equal is refused on every rank, naming the field
(tests/workers_megatron_overlap.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import mc2  # noqa: E402
from tests.workers_megatron import BATCH, SEQ, STEPS  # noqa: E402
from tests.workers_megatron_overlap import (  # noqa: E402
    MICRO_BATCHES, MODELS, PIPELINES, REFUSED, batch_overlap_training, pipeline_training,
    refusals)

TOLERANCE = 1e-5
PIPELINE_STEPS = 1e-3  # the pipeline test's losses after the first step (see there)
HALVES = [BATCH // 2 + BATCH % 2, BATCH // 2]  # sequences per half of the batch


def _moe_layers(kind: str) -> int:
    return sum(MODELS[kind].get("moe_layer_freq", [1] * MODELS[kind]["num_layers"]))


def _split(moe_layers: int) -> list[int]:
    """The staged calls one split forward begins: each MoE layer's two halves, in tokens."""
    return [h * SEQ for h in HALVES] * moe_layers


def _trains_as_megatrons(rank: int, found: dict, kind: str) -> None:
    """What every batch-overlap training run shows: Megatron's losses, every step each MoE
    layer as two staged calls, Megatron's keys and token counters, one sequence unsplit."""
    megatron, ours = found["losses megatron"], found["losses mc2"]
    assert len(ours) == STEPS and len(set(megatron)) == STEPS
    assert ours == pytest.approx(megatron, rel=TOLERANCE), (rank, ours, megatron)
    # every step ran each MoE layer as two staged calls, one per half of the batch
    assert found["calls mc2"] == [_split(_moe_layers(kind))] * STEPS, found["calls mc2"]
    assert found["calls megatron"] == [[]] * STEPS
    assert found["overlap layers"] == MODELS[kind]["num_layers"]
    assert all(layer == "MC2TransformerLayer" for layer, _ in found["layers"])
    assert sum(mlp == "MC2MoELayer" for _, mlp in found["layers"]) == _moe_layers(kind)
    assert found["keys"]["mc2"] == found["keys"]["megatron"]
    assert found["sharded_keys"]["mc2"] == found["sharded_keys"]["megatron"]
    assert found["counters mc2"] == found["counters megatron"]
    plain, split = found["one sequence"]
    assert split == pytest.approx(plain, rel=TOLERANCE) and found["calls one sequence"] == []
    if kind == "block_spec":
        assert found["counters mc2"] and any(any(c) for c in found["counters mc2"])


@pytest.mark.parametrize("world,kind", [(2, "layer_spec"), (2, "block_spec"),
                                        (4, "block_spec")])
def test_gpt_model_with_batch_overlap_trains_as_megatrons(world: int, kind: str) -> None:
    for rank, found in enumerate(mc2.run_local(batch_overlap_training, world, args=(kind,),
                                               deadline_s=600)):
        _trains_as_megatrons(rank, found, kind)


def test_batch_overlap_auto_trains_as_megatrons_and_shows_what_it_decided() -> None:
    """``batch_overlap="auto"``: the training steps alternate split and unsplit forwards (the
    first of each side untimed), every loss Megatron's; the decision shows what it measured
    (``Planner.batch_overlaps()``), decides after three timed forwards a side, the same on
    both ranks, and the next forward runs as it chose."""
    split = _split(_moe_layers("layer_spec"))
    results = mc2.run_local(batch_overlap_training, 2, args=("layer_spec", "auto"),
                            deadline_s=600)
    for rank, found in enumerate(results):
        megatron, ours = found["losses megatron"], found["losses mc2"]
        assert len(set(megatron)) == STEPS
        assert ours == pytest.approx(megatron, rel=TOLERANCE), (rank, ours, megatron)
        assert found["calls mc2"] == [split, split, [], []], found["calls mc2"]
        after = found["after steps"]
        assert after["chosen"] is None, after
        (measured,) = after["planner"]
        assert measured["mode"] == "auto" and measured["chosen"] is None, measured
        assert [len(measured["times"][side]) for side in ("on", "off")] == [1, 1], measured
        assert all(t > 0 for side in ("on", "off") for t in measured["times"][side])
        deciding = found["deciding"]
        # the no-grad forwards after the steps: measured apart from the training steps
        # (a forward alone never decides a training step), the sides alternating, each loss
        # Megatron's, until three forwards a side are timed
        assert [bool(calls) for _, calls in deciding["forwards"]] == [True, True, False,
                                                                       False] * 3, deciding
        for loss, calls in deciding["forwards"]:
            assert calls in (split, []) and loss == pytest.approx(deciding["want"],
                                                                  rel=TOLERANCE)
        assert deciding["chosen"] in (True, False)
        (report,) = deciding["planner"]
        decided = report["forward_only"]  # no-grad forwards decide for forwards alone
        assert report["mode"] == "auto" and decided["chosen"] is deciding["chosen"]
        assert [len(decided["times"][side]) for side in ("on", "off")] == [3, 3], decided
        loss, calls = deciding["decided"]
        assert calls == (split if deciding["chosen"] else []), deciding
        assert loss == pytest.approx(deciding["want"], rel=TOLERANCE)
    # agreed on the EP group: the same times (its slowest rank's) and the same choice
    assert results[0]["after steps"] == results[1]["after steps"]
    assert results[0]["deciding"]["planner"] == results[1]["deciding"]["planner"]


def test_two_expert_parallel_groups_train_as_megatrons() -> None:
    """4 ranks, ``expert_model_parallel_size=2``: two EP groups, each expert held by two
    data-parallel ranks whose gradients Megatron's DDP averages; batch overlap (decoder-block
    spec: dense layer, gated shared expert inside the call, expert bias) trains as Megatron's
    model under the same DDP."""
    results = mc2.run_local(batch_overlap_training, 4, args=("block_spec", True, 2),
                            deadline_s=600)
    for rank, found in enumerate(results):
        _trains_as_megatrons(rank, found, "block_spec")
        assert found["ep groups"] == [(0, 1) if rank < 2 else (2, 3)], found["ep groups"]
        # agreed on every rank of the stage, not per EP group: DDP's buckets span the groups
        assert found["decision group"] == (0, 1, 2, 3), found["decision group"]
        assert found["experts mc2"] == pytest.approx(found["experts megatron"], rel=TOLERANCE)
    for rank in (0, 1):  # the replicas of the same experts stayed equal; the others differ
        for name in ("mc2", "megatron"):
            assert results[rank][f"experts {name}"] == results[rank + 2][f"experts {name}"]
    assert results[0]["experts mc2"] != results[1]["experts mc2"]


def test_pipeline_and_virtual_pipeline_stages_train_as_megatrons() -> None:
    """``pipeline_model_parallel_size=2`` (EP = 2 within each stage), then with
    ``virtual_pipeline_model_parallel_size=2``, in one world: each stage's (each virtual
    stage's) block runs its own layers with batch overlap under Megatron's own schedule
    (1F1B, interleaved), equal to Megatron's model in the same stages: every stage's first
    gradients and the last stage's first losses within 1e-5, its later ones within 1e-3."""
    results = mc2.run_local(pipeline_training, 4, deadline_s=600)
    for rank, found in enumerate(results):
        assert set(found) == set(PIPELINES)
        for case, r in found.items():
            chunks = 1 if PIPELINES[case]["vpp"] is None else PIPELINES[case]["vpp"]
            assert r["layers"] == [["MC2TransformerLayer"] * 2] * chunks, r["layers"]
            assert r["stage layers"] == [[2, 2]] * chunks, r["stage layers"]
            # each micro-batch: every MoE layer of this rank's stages as two staged calls
            assert r["calls mc2"] == [_split(2 * chunks) * MICRO_BATCHES] * STEPS, \
                (case, r["calls mc2"])
            assert r["calls megatron"] == [[]] * STEPS
            # every stage's gradients of the first step, reduced by DDP: Megatron's
            assert r["gradients"] >= 9 * 2 * chunks and r["gradient difference"] <= TOLERANCE, \
                (case, r)
            megatron, ours = r["losses megatron"], r["losses mc2"]
            assert r["last stage"] == (rank >= 2)
            if r["last stage"]:
                assert [len(step) for step in megatron] == [MICRO_BATCHES] * STEPS
                assert len({tuple(step) for step in megatron}) == STEPS
                assert ours[0] == pytest.approx(megatron[0], rel=TOLERANCE), (case, ours, megatron)
                # the later steps' within rounding of the routing: a token whose top-2 experts
                # nearly tie flips with float32 rounding (seen 7e-5; 6e-5 with mc2's in-layer
                # mode in these stages, without batch overlap)
                assert sum(ours, []) == pytest.approx(sum(megatron, []), rel=PIPELINE_STEPS), \
                    (case, ours, megatron)
            else:
                assert megatron == ours == [[]] * STEPS


@pytest.mark.parametrize("kind", ["layer_spec", "block_spec"])
def test_a_hook_on_an_moe_layer_runs_unsplit_and_one_on_a_layer_is_refused(kind: str) -> None:
    """Batch overlap runs an MoE layer's parts, not the layer: a forward where it has a
    forward hook (here scaling its output) runs unsplit, the layer called, equal to
    Megatron's model with the same hook (before: split, the hook skipped). A decoder layer's
    own hook would see the recorded stand-ins: refused on every rank, naming it."""
    from tests.workers_megatron_overlap import hooked_parts

    for rank, found in enumerate(mc2.run_local(hooked_parts, 2, args=(kind,), deadline_s=300)):
        assert found["begun"] == [], (rank, found["begun"])
        losses = found["losses"]
        assert losses["mc2"] == pytest.approx(losses["megatron"], rel=TOLERANCE), (rank, losses)
        assert "layer 0" in found["layer hook"] and "batch_overlap=False" in found["layer hook"]


def test_batch_overlap_refuses_what_it_cannot_split_equal_on_every_rank() -> None:
    for rank, found in enumerate(mc2.run_local(refusals, 2, deadline_s=300)):
        for field in [*REFUSED, "batch_overlap"]:
            message = found[field]
            assert message.startswith("ValueError: "), f"rank {rank}, {field}: {message}"
            assert field in message, f"rank {rank}: {message} does not name {field}"


def test_a_block_spec_with_a_layer_batch_overlap_cannot_run_is_refused() -> None:
    """Every layer of a block takes part in batch overlap (a layer left as it was would run
    between recorded ones, and the stack's last would never be reached): a block spec with
    another layer class is refused, naming it."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from mc2.integrations.megatron import use_mc2

    layer = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    block = TransformerBlockSubmodules(layer_specs=[layer, ModuleSpec(module=IdentityOp)])
    with pytest.raises(ValueError, match=r"layer_specs\[1\] \(IdentityOp\)"):
        use_mc2(block, batch_overlap=True)
    assert use_mc2(dataclasses.replace(block, layer_specs=[layer, layer]), batch_overlap=True)


def assert_the_same_losses(found: dict, count: int | None = None) -> None:
    """Every micro-batch's loss of every step of ``found["mc2"]`` is ``found["megatron"]``'s
    (``count`` of them, all different: the steps changed the model)."""
    want = [x for step in found["megatron"] for x in step]
    got = [x for step in found["mc2"] for x in step]
    assert count is None or len(want) == count
    assert len(set(want)) == len(want)
    assert got == pytest.approx(want, rel=TOLERANCE), (got, want)


@pytest.mark.parametrize("world,kind", [(2, "layer_spec"), (2, "block_spec")])
def test_paired_gradient_accumulation_trains_as_megatrons(world: int, kind: str) -> None:
    """``mc2.forward_backward(overlap=True)`` on the batch-overlap ``GPTModel`` under Megatron's
    DDP, 3 micro-batches per Adam step: every micro-batch's loss over 4 steps is Megatron's
    own model's, trained by the sequential loop (with and without a shared expert; 4 ranks:
    the flag's test below, which pairs the same model through Megatron's function)."""
    from tests.workers_megatron_overlap import paired_accumulation

    for found in mc2.run_local(paired_accumulation, world, args=(kind,), deadline_s=600):
        assert_the_same_losses(found)


@pytest.mark.parametrize("world,kind", [(2, "layer_spec"), (2, "block_spec")])
def test_the_paired_schedule_equals_megatrons_no_pipelining_schedule(world: int,
                                                                     kind: str) -> None:
    """``forward_backward_paired`` (Megatron's ``forward_backward_no_pipelining`` signature,
    one micro-batch's forward beside another's backward) on the batch-overlap model against
    Megatron's own schedule on Megatron's model, same weights, under Megatron's DDP with its
    no_sync: every micro-batch's loss over 4 Adam steps of 3 micro-batches, 1e-5, and
    Megatron's timers started and stopped as its own schedule does; a model with nothing to
    pair is refused on every rank."""
    from tests.workers_megatron_overlap import schedule_against_megatrons

    for found in mc2.run_local(schedule_against_megatrons, world, args=(kind,),
                               deadline_s=600):
        assert_the_same_losses(found, 12)
        assert "made no mc2 call" in (found["refused"] or ""), found["refused"]
        # Megatron's timers as its own schedule runs them: the step's forward-backward, each
        # micro-batch's forward and backward compute
        timed = found["timers"]
        assert timed["mc2"] == timed["megatron"] and timed["mc2"]["forward-backward start"] \
            == timed["mc2"]["forward-backward stop"] == 4, timed


@pytest.mark.parametrize("world,kind", [(2, "layer_spec"), (4, "block_spec")])
def test_megatrons_own_overlap_flag_runs_the_paired_schedule_through_the_patch(
        world: int, kind: str) -> None:
    """Megatron's ``overlap_moe_expert_parallel_comm=True`` under ``import
    mc2.integrations.megatron_patch``: the patched specs build ``MC2MoELayer`` in Megatron's
    ``TransformerLayer`` and Megatron's ``get_forward_backward_func()`` runs mc2's paired schedule where it
    measures faster (its first steps run both ways; 3 micro-batches a step), equal to
    Megatron's model without the flag, same weights, same function: every micro-batch's
    loss over 4 Adam steps, 1e-5 (with and without a shared expert, 2 and 4 ranks); a model
    built with ``use_mc2`` without the patch, equal too. Megatron's pipelined schedule refuses
    the flag under the patch, naming it."""
    from tests.workers_megatron_overlap import megatrons_flag_through_the_patch

    for found in mc2.run_local(megatrons_flag_through_the_patch, world, args=(kind,),
                               deadline_s=600):
        assert_the_same_losses(found, 12)
        # "auto": its first steps run both ways (and the losses are Megatron's either way)
        assert found["paired"] and set(found["paired"]) == {3}, found["paired"]
        assert set(found["layers"]) == set(found["in-layer layers"]) == {"TransformerLayer"}
        assert found["in-layer paired"] and set(found["in-layer paired"]) == {3}
        assert_the_same_losses({"megatron": found["megatron"], "mc2": found["mc2 in-layer"]}, 12)
        assert "overlap_moe_expert_parallel_comm=True with pipeline parallelism" in \
            found["pipelined"]


@pytest.mark.parametrize("wrapper", ["TorchFullyShardedDataParallel", "FullyShardedDataParallel"])
def test_the_paired_schedule_refuses_megatrons_fsdp_wrappers(wrapper: str) -> None:
    """A model under Megatron's FSDP (``use_torch_fsdp2``, ``use_megatron_fsdp``) is refused
    by ``forward_backward_paired`` before anything runs, naming why (its units keep one
    pass's state at a time); a forward-only call still runs Megatron's own function."""
    from types import SimpleNamespace

    import torch

    from mc2.integrations import megatron_schedule

    config = SimpleNamespace(overlap_moe_expert_parallel_comm=False,
                             hybrid_context_parallel=False)
    sharded = type(wrapper, (torch.nn.Module,), {})()
    sharded.config = config
    with pytest.raises(ValueError, match="sharded by FSDP"):
        megatron_schedule.forward_backward_paired(
            forward_step_func=None, data_iterator=iter(()), model=[sharded],
            num_microbatches=2, seq_length=4, micro_batch_size=1)
    assert megatron_schedule.unpaired_sharding(torch.nn.Linear(2, 2)) is None


def test_the_paired_schedule_refuses_fine_grained_activation_offloading() -> None:
    """Megatron's fine-grained activation offloading keeps its chunks in forward order, each
    forward's followed by its own backward: ``forward_backward_paired`` refuses it, naming the
    field (before: paired, the offload manager's chunks mixed and never reset)."""
    from types import SimpleNamespace

    import torch

    from mc2.integrations import megatron_schedule

    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace(overlap_moe_expert_parallel_comm=False,
                                   hybrid_context_parallel=False,
                                   fine_grained_activation_offloading=True)
    with pytest.raises(ValueError, match="fine_grained_activation_offloading=True"):
        megatron_schedule.forward_backward_paired(
            forward_step_func=None, data_iterator=iter(()), model=[model],
            num_microbatches=2, seq_length=4, micro_batch_size=1)
