"""FSDP2 with expert parallelism (``mc2.fully_shard``): one 4-rank world, dp 2 x ep 2."""

from __future__ import annotations

import pytest
import torch

import mc2
from tests.workers_fsdp import (DEEP_LAYERS, adamw_reference, fsdp_data, fsdp_world,
                                layers_held_world, stack_reference, stack_states)
from tests.workers_mesh import CONFIG, unpatched_model


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    data = fsdp_data()
    path = str(tmp_path_factory.mktemp("fsdp") / "ckpt")
    results = mc2.run_local(fsdp_world, 4, args=(data, path, stack_states()),
                             timeout_s=240)
    return {"data": data, "path": path, "results": results, "reference": adamw_reference(data)}


def test_losses_and_norms_equal_one_process_adamw(fsdp_run) -> None:
    ref = fsdp_run["reference"]
    for rank, r in enumerate(fsdp_run["results"]):
        assert r["all_dtensors"]
        got = r["losses"]
        want = [step[rank] for step in ref["losses"]]
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        # ep 4, dp 1: FSDP2 over one rank divides the expert gradients once, not twice
        assert r["ep_only_norm"] == pytest.approx(ref["norms"][1], rel=1e-5)


def test_the_manual_pattern_trains_the_same(fsdp_run) -> None:
    ref = fsdp_run["reference"]["losses"]
    for rank, r in enumerate(fsdp_run["results"]):
        assert r["manual_losses"] == pytest.approx([step[rank] for step in ref[:2]], rel=1e-5)


def test_batch_overlap_under_fully_shard_trains_the_same(fsdp_run) -> None:
    ref = fsdp_run["reference"]
    for rank, r in enumerate(fsdp_run["results"]):
        got = r["overlapped"]
        assert got["chosen"] is True
        assert got["losses"] == pytest.approx([step[rank] for step in ref["losses"][:2]],
                                              rel=1e-5)
        assert got["norms"] == pytest.approx(ref["norms"][:4], rel=1e-5)
        assert got["freed"] == [True, True]  # layers freed after their forward, gathered again
        assert got["sharded_after_no_grad"]
        torch.testing.assert_close(*got["logits"], rtol=1e-5, atol=1e-6)  # no grad: a prefill


def test_batch_overlap_frees_each_layer_in_its_backward() -> None:
    """Under batch overlap each decoder layer is reduce-scattered and resharded as soon as
    both micro-batches' backward through it is done (not all at the backward's end): at most
    two layers hold gathered parameters at any time, in either pass, as in plain FSDP2; the
    gradients are plain FSDP2's. A 4-layer float64 Mixtral on 2 ranks (ep 2)."""
    ids = fsdp_data()[0, :2]
    results = mc2.run_local(layers_held_world, 2, args=(ids,), timeout_s=120)
    for r in results:
        plain, got = r["plain"], r["overlapped"]
        assert got["chosen"] is True
        assert plain["peak"]["backward"] <= 2  # what FSDP2's own hooks do
        assert got["peak"] == {"forward": 2, "backward": 2}, got["events"]
        reduced = [layer for what, layer, _ in got["events"] if what == "reduce"]
        gathered = [layer for what, layer, _ in got["events"] if what == "gather"]
        # the top layer's reduce-scatter runs before the backward reaches the bottom layer
        assert gathered.index(0) > reduced.index(DEEP_LAYERS - 1), got["events"]
        assert got["held_after"] == 0 and got["sharded_after"]
        assert got["loss"] == pytest.approx(plain["loss"], rel=1e-12)
        assert got["grads"].keys() == plain["grads"].keys()
        for name, grad in plain["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-10, atol=1e-12,
                                       msg=name)


def test_each_rank_holds_a_quarter_of_everything(fsdp_run) -> None:
    model = unpatched_model()
    total = {"dense": 0, "experts": 0}
    for name, p in model.named_parameters():
        total["experts" if ".experts." in name else "dense"] += p.numel() * p.element_size()
    held = [r["held"] for r in fsdp_run["results"]]
    for kind in ("dense", "experts"):
        assert sum(h[kind] for h in held) == total[kind]  # nothing held twice
        for h in held:  # FSDP's chunks differ by at most a row per tensor
            assert h[kind] <= total[kind] / 4 * 1.15, (kind, h[kind], total[kind])


def test_the_checkpoint_loads_into_the_unpatched_model(fsdp_run) -> None:
    import mc2.checkpoint

    model = unpatched_model(seed=1)
    extra = mc2.checkpoint.load(model, fsdp_run["path"])
    assert extra == {"step": len(fsdp_run["data"])}
    for key, value in fsdp_run["reference"]["state"].items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-4, atol=1e-6)


def test_bf16_parameters_with_fp32_reduction(fsdp_run) -> None:
    first = fsdp_run["reference"]["losses"][0]
    for rank, r in enumerate(fsdp_run["results"]):
        mixed = r["mixed"]
        assert mixed["finite"]
        assert mixed["grad_dtypes"] == {torch.float32}  # sharded gradients in the params' dtype
        assert mixed["loss"] == pytest.approx(first[rank], rel=2e-2)


def test_a_stack_of_moe_layers(fsdp_run) -> None:
    x = torch.randn(4 * 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    out, gate_grad, expert_grads = stack_reference(x)
    results = fsdp_run["results"]
    # tolerances scaled to the values: the stack's output is ~1e-10 and its router's gradient
    # ~1e-21 (two small-weighted SwiGLU layers), so a fixed atol of 1e-12 passed anything
    torch.testing.assert_close(torch.cat([r["stack_out"] for r in results]), out, rtol=1e-10,
                               atol=1e-10 * float(out.abs().max()))
    for r in results:
        torch.testing.assert_close(r["stack_gate_grad"], gate_grad, rtol=1e-9,
                                   atol=1e-9 * float(gate_grad.abs().max()))
        assert set(r["stack_expert_grads"]) == set(expert_grads)
        for name, (got, experts) in r["stack_expert_grads"].items():
            want = expert_grads[name][experts]
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9 * float(want.abs().max()))


def test_fully_shard_needs_a_dp_ep_mesh() -> None:
    layer = mc2.MoELayer(8, 8, 4)
    with pytest.raises(ValueError, match="one \\('dp', 'ep'\\) mesh"):
        mc2.fully_shard(layer)
    with pytest.raises(ValueError, match="no MC2 block"):
        mc2.fully_shard(torch.nn.Linear(2, 2))
    assert CONFIG["num_local_experts"] % 2 == 0
