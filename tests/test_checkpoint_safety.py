"""Checkpoints that cannot load wrong: a save that dies leaves the old one whole, a
checkpoint of another model is refused, an optimizer's per-expert state follows its expert
whatever its shape, and ``mc2 train`` orders its checkpoints by step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint.api

import mc2
import mc2.checkpoint
from mc2.parallel import checkpoint


def _stack(layers: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(mc2.MoELayer(8, 12, 4, topk=2) for _ in range(layers)))


def test_a_save_that_dies_leaves_the_last_checkpoint_as_it_was(tmp_path, monkeypatch) -> None:
    """The second save writes its data, then dies before its metadata is its own (as a kill
    of some ranks leaves it: the old ``.metadata`` beside new shards). It wrote to
    ``<path>.partial``, so ``path`` still loads the first save, every tensor equal. Before,
    DCP wrote over ``path`` in place and that mix loaded without an error."""
    path = tmp_path / "ckpt"
    model = _stack(2)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    mc2.checkpoint.save(model, path, extra={"step": 1})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    real = checkpoint._dcp

    def dies(what: str, state: dict, where: Path) -> None:
        metadata = Path(where) / ".metadata"
        old = metadata.read_bytes() if metadata.is_file() else None
        real(what, state, where)  # the shards written
        if old is not None:
            metadata.write_bytes(old)  # the metadata not yet replaced
        raise KeyboardInterrupt  # killed

    monkeypatch.setattr(checkpoint, "_dcp", dies)
    with pytest.raises(KeyboardInterrupt):
        mc2.checkpoint.save(model, path, extra={"step": 2})
    monkeypatch.undo()
    fresh = _stack(2, seed=1)
    assert mc2.checkpoint.load(fresh, path) == {"step": 1}
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, first[name], rtol=0, atol=0)
    # the next save publishes over it, and leaves nothing beside it
    mc2.checkpoint.save(model, path, extra={"step": 2})
    assert mc2.checkpoint.load(fresh, path) == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_checkpoint_with_entries_the_model_lacks_is_refused(tmp_path) -> None:
    """A 3-layer checkpoint into a 2-layer model: before, the third layer's entries were
    left out silently."""
    mc2.checkpoint.save(_stack(3), tmp_path / "deep")
    with pytest.raises(KeyError, match="does not have"):
        mc2.checkpoint.load(_stack(2), tmp_path / "deep")
    # and the reverse, DCP's error, as before
    with pytest.raises(torch.distributed.checkpoint.api.CheckpointException):
        mc2.checkpoint.load(_stack(4), tmp_path / "deep")


def factored_state(rank: int, world: int, path: str) -> dict[str, Any]:
    """An EP-2 stack trained three steps with Adafactor (its moments of an expert tensor are
    ``[L, R, 1]`` and ``[L, 1, C]``, not shaped like it), saved, and loaded at the same
    layout into a fresh model and optimizer: whether every state tensor came back, and
    which of the experts' moments are not zero; with a per-rank statistic added, loaded
    again into the same optimizer, its state zeroed first: whether all came back."""
    model = _stack(2)
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):  # its first step leaves the moments zero (its decay starts at 1)
        opt.zero_grad()
        model(torch.randn(6, 8, generator=g)).pow(2).mean().backward()
        opt.step()
    expert = model[0].experts.w_down
    opt.state[expert]["rank_block"] = torch.full((1, 5), rank + 1.0)  # a statistic per rank
    mc2.checkpoint.save(model, path, optimizer=opt)
    saved = {id(v): v.clone() for st in opt.state.values() for v in st.values()
             if isinstance(v, torch.Tensor)}
    for st in opt.state.values():  # the same optimizer, its state zeroed, loaded again
        for v in st.values():
            if isinstance(v, torch.Tensor):
                v.zero_()
    mc2.checkpoint.load(model, path, optimizer=opt)
    same_again = all(torch.equal(v, saved[id(v)]) for st in opt.state.values()
                     for v in st.values() if isinstance(v, torch.Tensor))
    opt.state[expert].pop("rank_block")
    fresh = _stack(2, seed=1)
    again = torch.optim.Adafactor(fresh.parameters(), lr=1e-2)
    mc2.checkpoint.load(fresh, path, optimizer=again)
    names = dict(zip(model.parameters(), (n for n, _ in model.named_parameters())))
    found, moving = {}, set()
    for (p, state), q in zip(opt.state.items(), fresh.parameters()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                found[f"{names[p]}.{key}"] = torch.equal(value, again.state[q][key])
                if "experts" in names[p] and value.dim() and bool((value != 0).any()):
                    moving.add(f"{names[p]}.{key}")  # moments that differ between ranks
    return {"same": found, "moving": sorted(moving), "same_again": same_again}


def test_an_optimizers_per_expert_state_follows_its_expert_whatever_its_shape(tmp_path) -> None:
    """Adafactor's factored moments of the experts, 2 ranks: each rank's come back, and a
    state of the rank's experts as a whole (``[1, 5]``, as Adafactor keeps for a 2-D expert
    tensor) too. Before, state not shaped like its parameter was written as replicated, one
    rank's copy for both, and the other rank loaded its peer's."""
    for found in mc2.run_local(factored_state, 2, args=(str(tmp_path / "c"),), timeout_s=120):
        assert any("row_var" in k for k in found["moving"]), found
        same = found["same"]
        assert all(same.values()), [k for k, equal in same.items() if not equal]
        # a state of the rank's experts as a whole (leading with 1, not the expert count):
        # kept as one block per rank, each rank's own back
        assert found["same_again"]


def test_mc2_train_orders_its_checkpoints_by_step(tmp_path) -> None:
    """By name, ``step-1000000`` came before ``step-999999``: ``--resume`` took the older,
    and keeping the last two deleted the newest."""
    from mc2.tools.training import TrainConfig, _checkpoints

    for step in (999998, 999999, 1000000):
        folder = tmp_path / f"step-{step:06d}"
        folder.mkdir()
        (folder / ".metadata").write_bytes(b"")
    (tmp_path / "step-1000001.partial").mkdir()  # never published: not listed
    names = [p.name for p in _checkpoints(TrainConfig(checkpoint_dir=str(tmp_path)))]
    assert names == ["step-999998", "step-999999", "step-1000000"]


def test_a_models_extra_state_and_once_persistent_buffers_still_load(tmp_path) -> None:
    """What ``load``'s refusal of unknown entries must let through: a module's dict
    ``_extra_state`` (DCP flattens it into entries inside it) and a buffer saved while it was
    persistent, now non-persistent (as ``inv_freq`` once changed)."""

    class Stateful(torch.nn.Module):
        def __init__(self, persistent: bool) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(3))
            self.register_buffer("inv_freq", torch.arange(3.0), persistent=persistent)
            self.extra = {"scale": 5.0, "n": 7}

        def get_extra_state(self) -> dict:
            return dict(self.extra)

        def set_extra_state(self, state: dict) -> None:
            self.extra = dict(state)

    mc2.checkpoint.save(Stateful(persistent=True), tmp_path / "s")
    again = Stateful(persistent=False)
    again.extra = {"scale": 0.0, "n": 0}  # a fresh model's, before its load
    mc2.checkpoint.load(again, tmp_path / "s")
    assert again.extra == {"scale": 5.0, "n": 7}


def test_a_symlinked_folder_is_saved_through_its_link(tmp_path) -> None:
    """The link names its target, which is replaced; the link stays a link (before, the
    rename replaced the link itself with a folder and orphaned the data it pointed to)."""
    real = tmp_path / "volume" / "real"
    mc2.checkpoint.save(_stack(1), real, extra={"step": 1})
    link = tmp_path / "ckpt"
    link.symlink_to(real, target_is_directory=True)
    mc2.checkpoint.save(_stack(1), link, extra={"step": 2})
    assert link.is_symlink() and mc2.checkpoint.load(_stack(1), real) == {"step": 2}
    assert sorted(p.name for p in real.parent.iterdir()) == ["real"]


def test_a_save_killed_between_its_renames_is_published_by_the_next(tmp_path,
                                                                     monkeypatch) -> None:
    """Killed after the old folder was set aside and before the new one took its place:
    ``path`` is missing (a load fails, loudly) and the new checkpoint is whole in
    ``.partial``. The next save publishes it before anything else, so that one dying too
    still leaves it (before, the next save deleted it first)."""
    path = tmp_path / "ckpt"
    checkpoint._dcp("save", {"model.w": torch.ones(2), checkpoint.EXTRA_KEY:
                             __import__("io").BytesIO(b'{"step": 2}')},
                    tmp_path / "ckpt.partial")  # whole, never renamed
    with pytest.raises(FileNotFoundError):
        mc2.checkpoint.load(_stack(1), path)

    def dies(what: str, state: dict, where: Path) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "_dcp", dies)
    with pytest.raises(KeyboardInterrupt):
        mc2.checkpoint.save(_stack(1), path, extra={"step": 3})
    monkeypatch.undo()
    assert checkpoint.saved_keys(path) and (path / ".metadata").is_file()


def test_the_working_folder_is_refused(tmp_path, monkeypatch) -> None:
    """Renamed away and removed, it would take the process's working folder with it."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="working folder"):
        mc2.checkpoint.save(_stack(1), ".")


def failing_publish(rank: int, world: int, path: str) -> str | None:
    """Rank 0's rename fails; what each rank raised."""
    from mc2.parallel import checkpoint_publish

    if rank == 0:
        def refused(*args: Any) -> None:
            raise PermissionError("renames refused here")
        checkpoint_publish._publish = refused
    try:
        mc2.checkpoint.save(_stack(1), path)
    except (PermissionError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def test_a_step_failing_on_rank_zero_raises_on_every_rank(tmp_path) -> None:
    """Before, rank 0 raised alone and its peers waited in a barrier until the group's
    timeout."""
    got = mc2.run_local(failing_publish, 2, args=(str(tmp_path / "c"),), timeout_s=60)
    assert got[0] == "PermissionError: renames refused here", got
    assert got[1] is not None and "another rank failed to publish" in got[1], got


def node_local_save(rank: int, world: int, base: str) -> dict[str, list[str]]:
    """Each rank a node of its own with a disk of its own (its own working folder, a relative
    ``path``): saved twice; what each node's folder then holds."""
    import os

    node = Path(base) / f"node{rank}"
    node.mkdir(parents=True, exist_ok=True)
    os.chdir(node)
    for step in (1, 2):
        mc2.checkpoint.save(_stack(1), "ckpt", extra={"step": step})
    return {p.name: sorted(q.name for q in p.iterdir()) for p in node.iterdir()}


def test_nodes_with_disks_of_their_own_each_publish_their_shards(tmp_path) -> None:
    """Rank 0's node holds the metadata and its shard, the other node its shard, both under
    ``ckpt`` (before, the other node's stayed in ``ckpt.partial``, which a later copy of the
    folders together would miss)."""
    got = mc2.run_local(node_local_save, 2, args=(str(tmp_path),), ranks_per_node=1,
                        timeout_s=60)
    assert got[0] == {"ckpt": [".metadata", "__0_0.distcp"]}, got
    assert got[1] == {"ckpt": ["__1_0.distcp"]}, got
