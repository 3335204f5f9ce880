"""mc2 in Megatron-Core 0.16.1: ``MC2MoELayer`` against Megatron's own ``MoELayer`` (alltoall
dispatcher, ``SequentialMLP`` experts) with the same weights (one loaded from the other's
``state_dict``) and the same inputs, on 2 and 4 Gloo ranks, float32: the output, the input's
gradient, the router's and every expert's weight gradient within 1e-5 of Megatron's, the aux /
seq-aux / z losses Megatron logs equal, the expert bias's token counters equal, state-dict keys
identical. One world per size runs every case (tests/workers_megatron.py). Refusals raise
``ValueError`` naming the field on every rank, and the ranks then meet in a collective. A small
``GPTModel`` built with ``use_mc2`` trains under Megatron's DDP with the same losses as without
it, with the same checkpoint keys; ``import mc2.integrations.megatron_patch`` turns the GPT
spec functions' MoE layers into ``MC2MoELayer`` with the config from ``MC2_MEGATRON_CONFIG``.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("megatron.core")

import mc2  # noqa: E402
from tests.workers_megatron import (  # noqa: E402
    BATCH, CASES, REFUSALS, SEQ, STEPS, compare_layers, gpt_training, patched_specs, refusals)

TOLERANCE = 1e-5


@functools.lru_cache(maxsize=None)
def _layers(world: int) -> tuple[dict, ...]:
    return tuple(mc2.run_local(compare_layers, world, args=(list(CASES),), deadline_s=900))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_mc2_layer_equals_megatrons_moe_layer(world: int, case: str) -> None:
    for rank, results in enumerate(_layers(world)):
        found = results[case]
        errors = found["errors"]
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOLERANCE, f"rank {rank}: {worst} off by {errors[worst]:.2e}"
        # every tensor compared: output, input gradient, router and each local expert's weights
        assert {"out", "x.grad", "grad router.weight"} <= set(errors)
        local = CASES[case]["num_moe_experts"] // world  # SequentialMLP: fc1, fc2 per expert;
        grouped = CASES[case].get("moe_grouped_gemm", False)  # GroupedMLP: weight1, weight2
        assert found["expert_grads"] == (2 if grouped else 2 * local)
        megatron_losses, mc2_losses = found["losses"]
        assert mc2_losses == pytest.approx(megatron_losses, rel=TOLERANCE, abs=1e-7)
        assert found["keys_equal"], f"rank {rank}: state_dict keys differ from MoELayer's"


@pytest.mark.parametrize("world", [2, 4])
def test_the_layer_runs_its_config_and_reads_the_host_as_fused_expert_does(world: int) -> None:
    """The configured K and rows once per destination ran (the timeline), and the call read
    the host no more than ``fused_expert`` itself (two reads in the forward, none in the
    backward): Megatron's experts get ``tokens_per_expert`` from the counts the call read,
    and a capacity factor's dropped slots are found on the device (no ``nonzero``)."""
    for results in _layers(world):
        for case, found in results.items():
            if case not in CASES:
                continue
            options = CASES[case].get("mc2", {"micro_batches": 2})
            assert found["micro_batches"] == options["micro_batches"], case
            assert found["rows_once"] == options.get("dedup", False), case
            assert found["forward_reads"] <= 2, (case, found["forward_read_ops"])
            assert found["backward_reads"] == 0, case


@pytest.mark.parametrize("world", [2, 4])
def test_the_cases_exercise_what_they_name(world: int) -> None:
    """The capacity cases drop slots, the aux-loss cases log a nonzero loss, the expert-bias
    case counts tokens, and the overlapped shared experts run in mc2's call: equality there is
    not equality of nothing."""
    for results in _layers(world):
        assert results["capacity_drops"]["dropped"] > 0
        assert results["capacity_drops_position"]["dropped"] > 0
        skewed = results["capacity_drops_skewed"]
        assert skewed["dropped"] >= SEQ * BATCH // 2, skewed["dropped"]  # the skew drops


@pytest.mark.parametrize("world", [2, 4])
def test_dropped_slots_add_no_rows(world: int) -> None:
    """With a capacity factor the rows sent to each destination are exactly the router's kept
    (token, expert) slots: a dropped slot travels nowhere and computes nothing (it used to go
    to whichever expert ``topk`` picked among the map's ties, weight 0: a straggler where
    capacity factors are meant to bound the work)."""
    for rank, results in enumerate(_layers(world)):
        for case in ("capacity_drops", "capacity_drops_position", "capacity_drops_skewed"):
            found = results[case]
            assert found["rows_sent"] == found["kept_rows"], (rank, case, found["rows_sent"])
            assert sum(found["rows_sent"]) == SEQ * BATCH * CASES[case]["moe_router_topk"] \
                - found["dropped"], (rank, case)
        for case, loss in [("top2_aux_loss", "load_balancing_loss"),
                           ("sigmoid_expert_bias", "seq_load_balancing_loss"),
                           ("group_limited_z_loss", "z_loss")]:
            assert results[case]["losses"][0][loss] > 0, (case, loss)
        assert "router tokens_per_expert" in results["sigmoid_expert_bias"]["errors"]
        # moe_shared_expert_overlap: the shared experts ran inside mc2's call (and their
        # gradients, compared above, came from it); without it, beside the call
        assert results["shared_experts_gate_overlap"]["shared_inside"]
        assert not results["shared_experts"]["shared_inside"]


def test_refusals_raise_naming_the_field_on_every_rank() -> None:
    for rank, found in enumerate(mc2.run_local(refusals, 2)):
        assert found.pop("after") == "2", f"rank {rank}: the ranks did not meet afterwards"
        for field in REFUSALS:
            message = found[field]
            assert message.startswith("ValueError: "), f"rank {rank}, {field}: {message}"
            assert field in message, f"rank {rank}: {message} does not name {field}"


@pytest.mark.parametrize("overlap_grad_reduce", [True, False])
def test_gpt_model_with_use_mc2_trains_as_megatrons(overlap_grad_reduce: bool,
                                                    tmp_path) -> None:
    """Training equal to Megatron's, and checkpoints that move both ways: ``state_dict``
    always, Megatron's ``dist_checkpointing`` (``torch_dist``) in one of the two runs."""
    where = str(tmp_path) if overlap_grad_reduce else None
    for rank, found in enumerate(mc2.run_local(gpt_training, 2, args=(overlap_grad_reduce, where),
                                               deadline_s=600)):
        assert found["mc2_layers"] == [True, True], found["mc2_layers"]
        assert found["megatron_layers"] == ["MoELayer", "MoELayer"]
        megatron, ours = found["losses megatron"], found["losses mc2"]
        assert len(ours) == STEPS
        assert ours == pytest.approx(megatron, rel=TOLERANCE), (rank, ours, megatron)
        assert len(set(megatron)) == STEPS  # the steps changed the model
        assert found["keys"]["mc2"] == found["keys"]["megatron"]
        assert found["sharded_keys"]["mc2"] == found["sharded_keys"]["megatron"]
        assert any(".mlp.experts." in k for k in found["keys"]["mc2"])
        trained, reloaded = found["reload"]
        assert reloaded == pytest.approx(trained, rel=TOLERANCE), "checkpoint without mc2"
        if where is not None:
            round_trip = found["dist_checkpointing"]
            assert round_trip["layers"] == [[False, False], [True, True]]
            trained, plain, back = round_trip["losses"]
            assert plain == pytest.approx(trained, rel=TOLERANCE), "dist_checkpointing -> Megatron"
            assert back == pytest.approx(trained, rel=TOLERANCE), "dist_checkpointing -> mc2"


@pytest.mark.parametrize("source", ["text", "file"])
def test_one_import_patches_the_gpt_specs(source: str, tmp_path) -> None:
    text = '{"micro_batches": 3, "dedup": true}'
    env = text
    if source == "file":
        path = tmp_path / "mc2.json"
        path.write_text(text)
        env = str(path)
    want = mc2.MC2Config(micro_batches=3, dedup=True)
    for found in mc2.run_local(patched_specs, 2, args=(env,)):
        # the decoder block's two layers, a layer spec, a MoE spec
        assert found["patched"] == [("MC2MoELayer", want)] * 4
        assert found["built"] == ["MC2MoELayer", "MC2MoELayer"]
        assert found["unpatched"] == [("MoELayer", None)] * 4
        # no batch overlap asked: the layers stay Megatron's (their MoE layers are mc2's,
        # whose calls a paired schedule pairs inside the layers)
        assert found["layers"] == ["TransformerLayer"] * 4
        assert found["built layers"] == ["TransformerLayer"] * 2
        assert found["unpatched layers"] == ["TransformerLayer"] * 4
        # Megatron's schedule honours overlap_moe_expert_parallel_comm, and is given back
        assert found["schedule"] == ["mc2's", "Megatron's"]


def test_one_import_switches_batch_overlap_on() -> None:
    """``"batch_overlap": true`` in the same JSON: the block's and the MoE layer spec's layers
    build MC2TransformerLayer (a dense layer spec stays Megatron's), the model is built with
    them, and unpatch() gives Megatron's functions back."""
    env = '{"micro_batches": 2, "batch_overlap": true}'
    for found in mc2.run_local(patched_specs, 2, args=(env,)):
        assert found["patched"] == [("MC2MoELayer", mc2.MC2Config(micro_batches=2))] * 4
        assert found["layers"] == ["MC2TransformerLayer"] * 3 + ["TransformerLayer"]
        assert found["built layers"] == ["MC2TransformerLayer"] * 2
        assert found["unpatched layers"] == ["TransformerLayer"] * 4


def test_settings_from_env_read_batch_overlap() -> None:
    from mc2.integrations.megatron import settings_from_env

    assert settings_from_env('{"batch_overlap": "auto", "dedup": true}') == (
        mc2.MC2Config(dedup=True), "auto")
    with pytest.raises(ValueError, match="MC2_MEGATRON_CONFIG.*batch_overlap"):
        settings_from_env('{"batch_overlap": "sometimes"}')


def test_config_from_env_refuses_naming_the_variable(tmp_path) -> None:
    from mc2.integrations.megatron import DEFAULT_CONFIG, ENV, config_from_env

    assert config_from_env("") is DEFAULT_CONFIG
    assert config_from_env('{"overlap": false}') == mc2.MC2Config(overlap=False)
    for bad in ['{"micro_batches": 0}', '{"nope": 1}', "[1]", "{not json",
                str(tmp_path / "missing.json")]:
        with pytest.raises(ValueError, match=ENV):
            config_from_env(bad)


def test_use_mc2_refuses_a_spec_without_moe_layer() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mc2.integrations.megatron import use_mc2

    with pytest.raises(ValueError, match="no MoELayer"):
        use_mc2(get_gpt_layer_local_spec())


@pytest.mark.parametrize("wait,batch_overlap", [(True, False), (False, False), (True, True)],
                         ids=["waits", "no waits", "batch overlap"])
def test_distributed_optimizer_with_overlapped_parameter_gather(wait: bool,
                                                                batch_overlap: bool) -> None:
    """``use_distributed_optimizer`` + ``overlap_param_gather``: mc2 waits for the gathers of
    every parameter it reads without calling its module (the shared MLP's views, the experts
    on stand-ins), so training equals Megatron's own model over the steps; without the waits
    (``wait=False``) it does not: Megatron's next ``start_param_sync`` finds a bucket group
    never waited, or the losses differ. Batch overlap's staged calls wait the same way."""
    from tests.workers_megatron import gathered_training

    for rank, found in enumerate(mc2.run_local(gathered_training, 2,
                                               args=(wait, batch_overlap), deadline_s=600)):
        megatron = found["megatron"]
        assert isinstance(megatron, list) and len(set(megatron)) == STEPS, (rank, megatron)
        # batch overlap: each step's 2 MoE layers as 2 staged calls each (halves of the batch)
        assert found["staged calls"] == (4 * STEPS if batch_overlap else 0), found
        if wait:
            assert found["mc2"] == pytest.approx(megatron, rel=TOLERANCE), (rank, found)
        else:
            assert found["mc2"] != pytest.approx(megatron, rel=TOLERANCE), (rank, found)


def test_a_block_with_other_layers_is_refused_under_batch_overlap_only() -> None:
    """A block that holds a layer mc2's layer loop cannot run: use_mc2 refuses batch overlap,
    naming the layer; without it (and through the patch) the block is built with MC2MoELayer
    in Megatron's TransformerLayer, whose calls a paired schedule pairs inside the layer."""
    import torch
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from mc2.integrations.megatron import other_layers, use_mc2
    from mc2.integrations.megatron_patch import _layers

    build = gpt_layer_specs.get_gpt_layer_local_spec  # Megatron's own, if a test patched it
    moe = getattr(build, "__mc2_original__", build)(num_experts=4)
    block = TransformerBlockSubmodules(layer_specs=[moe, ModuleSpec(module=torch.nn.Identity)])
    assert other_layers(moe) == []
    assert other_layers(block) == ["layer_specs[1] (Identity)"]
    with pytest.raises(ValueError, match=r"layer_specs\[1\] \(Identity\)"):
        use_mc2(block, batch_overlap=True)
    for built in (use_mc2(block), _layers(block, mc2.MC2Config(), False)):
        assert [s.module.__name__ for s in built.layer_specs] == ["TransformerLayer", "Identity"]
        assert built.layer_specs[0].submodules.mlp.module.__name__ == "MC2MoELayer"
    assert _layers(moe, mc2.MC2Config(), True).module.__name__ == "MC2TransformerLayer"
    with pytest.raises(ValueError, match="Identity"):
        _layers(block, mc2.MC2Config(), True)


@pytest.mark.parametrize("kind", ["shared forward hook", "shared forward replaced"])
def test_a_changed_shared_mlp_under_overlap_computes_what_megatron_computes(kind: str) -> None:
    """Under ``moe_shared_expert_overlap`` Megatron's dispatcher calls the shared MLP's staged
    methods, not the module: a hook on it, or its forward replaced, does not run there. mc2
    ran them beside its call by calling the module (outputs 0.27 apart; found by a review)."""
    from tests.workers_megatron import hook_case

    for r in mc2.run_local(hook_case, 2, args=("shared_experts_gate_overlap", kind)):
        assert r["error"] is None and r["worst"] < 1e-5, r


def test_a_hook_on_the_experts_module_is_refused_on_every_rank() -> None:
    """mc2 calls Megatron's experts module with unit weights and applies the probabilities
    after the combine: a hook that is not linear in them saw other tensors (a clamp: outputs
    0.83 apart, silently; found by a review)."""
    from tests.workers_megatron import hook_case

    for r in mc2.run_local(hook_case, 2, args=("top1", "experts clamp hook")):
        assert r["error"] is not None and "experts: SequentialMLP has hooks" in r["error"], r
