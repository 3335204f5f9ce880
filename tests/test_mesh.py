"""EP x DP meshes on real 4-rank Gloo worlds: training equals one process, checkpoints move.

The model is Hugging Face's Mixtral (tiny), switched with ``enable_mc2(model, mesh=...)``.
Every rank trains on its own batch; the reference trains the unpatched model in one process on
the mean of the four ranks' losses. Losses are float32 and must agree to 1e-5 relative.
"""

from __future__ import annotations

import pytest
import torch

import mc2
import mc2.parallel.checkpoint
from tests.workers_mesh import (
    BAD_MESHES,
    RESUMED_STEPS,
    bad_meshes,
    batches,
    load_on_mesh,
    reference_losses,
    save_on_mesh,
    train_on_mesh,
    unpatched_model,
)

pytest.importorskip("transformers")
RTOL = 1e-5


@pytest.mark.parametrize("ep_size,overlapped", [(2, False), (4, False), (2, True)],
                         ids=["dp2xep2", "ep4", "dp2xep2-overlapped-sync"])
def test_mesh_training_equals_one_process(ep_size: int, overlapped: bool) -> None:
    data = batches(3)
    want = reference_losses(data)
    got = mc2.run_local(train_on_mesh, 4, args=(ep_size, data, overlapped), timeout_s=120)
    for rank, losses in enumerate(got):
        for step, loss in enumerate(losses):
            assert loss == pytest.approx(want[step][rank], rel=RTOL), (rank, step)
    # the steps changed the model: the same batch scores differently after training
    untrained = reference_losses(data[-1:])[0]
    assert max(abs(a - b) for a, b in zip(untrained, want[-1])) > 100 * RTOL


def test_a_checkpoint_moves_between_meshes_and_back_to_hugging_face(tmp_path) -> None:
    data = batches(2 + RESUMED_STEPS)
    path = str(tmp_path / "ckpt")
    saved = mc2.run_local(save_on_mesh, 4, args=(2, data, path), timeout_s=120)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    for ep_size in (4, 1):  # ep=4, then dp=4 x ep=1
        loaded = mc2.run_local(load_on_mesh, 4, args=(ep_size, data, path), timeout_s=120)
        for rank, r in enumerate(loaded):
            assert r["extra"] == {"step": 2}
            torch.testing.assert_close(r["logits"], saved[rank]["logits"], rtol=0, atol=1e-6)
            # resuming (momentum included) continues the uninterrupted run
            assert r["next_losses"] == pytest.approx(saved[rank]["next_losses"], rel=RTOL)
    model = unpatched_model(seed=1)  # different weights until the checkpoint lands
    assert mc2.parallel.checkpoint.load(model, path) == {"step": 2}
    assert type(model.model.layers[0].mlp).__name__ == "MixtralSparseMoeBlock"
    with torch.no_grad():
        for rank in range(4):
            torch.testing.assert_close(model(data[0, rank]).logits, saved[rank]["logits"],
                                       rtol=0, atol=1e-6)


def test_a_checkpoint_without_optimizer_state_says_so(tmp_path) -> None:
    model = unpatched_model()
    mc2.parallel.checkpoint.save(model, tmp_path / "m")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(KeyError, match="no optimizer state"):
        mc2.parallel.checkpoint.load(model, tmp_path / "m", optimizer=opt)
    with pytest.raises(FileNotFoundError, match="no mc2 checkpoint"):
        mc2.parallel.checkpoint.load(model, tmp_path / "missing")


def test_a_bad_mesh_raises_on_every_rank() -> None:
    expected = {"unnamed": "named ('dp', 'ep')",
                "ep-does-not-divide-experts": "6 experts do not split over an EP size of 4",
                "helper-experts": "must divide the number of experts",
                "helper-world": "must divide the world size",
                "does-not-cover": "every rank must be in it"}
    assert set(expected) == set(BAD_MESHES)
    # one world tries them all: a rank left waiting would make the next attempt hang
    for errors in mc2.run_local(bad_meshes, 4, timeout_s=30, deadline_s=120):
        for what, message in expected.items():
            assert message in errors[what], (what, errors[what])


def test_expert_parallel_mesh_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        mc2.expert_parallel_mesh(2)


def test_gradient_sync_accumulates_under_no_sync_and_refuses_a_second_backward() -> None:
    from tests.workers_mesh import accumulate_with_no_sync

    results = mc2.run_local(accumulate_with_no_sync, 4, args=(batches(2),), timeout_s=60,
                            deadline_s=180)
    for r in results:
        for name, grad in r["after"].items():
            torch.testing.assert_close(r["overlapped"][name], grad, rtol=1e-5, atol=1e-7)
        assert r["error"] is not None and "no_sync" in r["error"]


def test_norms_and_gradient_sync_on_the_layouts_without_a_mesh_and_with_frozen_experts() -> None:
    """``clip_grad_norm_`` of layers on the default group sums every rank's experts (it
    counted each rank's own: a different norm and scale per rank, replicated parameters then
    drifting apart); frozen experts get no gradient from ``average_gradients`` (before: zeros,
    which weight decay then moved) and ``GradientSync`` builds (before: a hook on a tensor
    that needs no gradient); layers on EP groups smaller than the world without a mesh are
    refused by the gradient sync, naming ``mesh=`` (before: experts divided by the world,
    never summed over the replicas that hold them)."""
    from tests.workers_mesh import layer_sync_edges

    results = mc2.run_local(layer_sync_edges, 2)
    for rank, found in enumerate(results):
        got, want = found["norm"]
        assert got == pytest.approx(want, rel=1e-12), (rank, got, want)
        assert got == pytest.approx(results[0]["norm"][0], rel=1e-12)
        assert found["frozen grads"] and all(g is None for g in found["frozen grads"])
        assert found["frozen sync"] == "built", found["frozen sync"]
        assert "mesh=" in found["subgroup"] and "1 ranks in a world of 2" in found["subgroup"]

