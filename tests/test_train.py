"""End-to-end training: MC2 equals serial, the loss falls, checkpoints resume exactly."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mc2.tools.training import TrainConfig, load_corpus, run_training

TINY = TrainConfig(steps=6, batch=2, seq=32, hidden=32, ffn=48, layers=2, heads=4, kv_heads=2,
                   experts=4, topk=2, lr=1e-2, corpus_bytes=200_000, progress=False)


def test_corpus_is_the_standard_library() -> None:
    data = load_corpus(50_000)
    assert data.numel() == 50_000
    assert b"import" in bytes(data.tolist())


def test_mc2_loss_curve_equals_serial_and_falls() -> None:
    serial = run_training(replace(TINY, overlap=False))["losses"]
    mc2 = run_training(replace(TINY, overlap=True, micro_batches=3))["losses"]
    assert len(serial) == len(mc2) == TINY.steps
    for a, b in zip(serial, mc2):
        assert a == pytest.approx(b, rel=1e-5)
    assert mc2[-1] < mc2[0] - 0.3, mc2


STRAIGHT = replace(TINY, steps=3, ep_size=2)  # 4 ranks as dp 2 x ep 2, no checkpoint


@pytest.fixture(scope="module")
def straight() -> list[float]:
    """The losses of :data:`STRAIGHT` run through, which both resumes must continue (one
    4-rank world for the two tests)."""
    return run_training(STRAIGHT, world_size=4)["losses"]


def test_resume_on_another_ep_size_continues_the_run(tmp_path, straight) -> None:
    """4 ranks: two steps as dp 2 x ep 2, then resumed as ep 4 from the DCP checkpoint (a
    same-size resume is in the kill -9 test below)."""
    first = replace(STRAIGHT, steps=2, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    run_training(first, world_size=4)
    resumed = run_training(replace(first, steps=3, ep_size=4, resume=True), world_size=4)
    assert resumed["losses"] == pytest.approx(straight, rel=1e-5)
    assert len(resumed["sync_s"]) == 3


def test_fsdp_trains_like_gradient_sync_and_resumes_on_another_ep_size(tmp_path,
                                                                      straight) -> None:
    """``mc2 train --fsdp``: the same losses as replicated training with GradientSync, and a
    sharded checkpoint (model and AdamW state) saved at dp 2 x ep 2 resumes at ep 4."""
    first = replace(STRAIGHT, steps=2, fsdp=True, checkpoint_dir=str(tmp_path),
                    checkpoint_every=2)
    head = run_training(first, world_size=4)["losses"]
    resumed = run_training(replace(first, steps=3, ep_size=4, resume=True), world_size=4)
    assert head == pytest.approx(straight[:2], rel=1e-5)
    assert resumed["losses"] == pytest.approx(straight, rel=1e-5)


def test_ep_size_must_divide_the_world() -> None:
    with pytest.raises(ValueError, match="must divide the world size"):
        run_training(replace(TINY, ep_size=3), world_size=4)


def _train_args(out) -> list[str]:
    return ["--steps", "3", "--batch", "2", "--seq", "32", "--out", str(out)]


def test_the_same_entry_point_runs_under_torchrun(tmp_path) -> None:
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", "-m", "mc2.tools.train", "--ep-size", "1", *_train_args(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 ranks as dp 2 x ep 1" in proc.stderr
    losses = json.loads((tmp_path / "losses.json").read_text())["runs"]["MC2 K=2"]["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_bf16_on_the_wire_trains_like_float32() -> None:
    plain = run_training(replace(TINY, steps=4, micro_batches=2))["losses"]
    bf16 = run_training(replace(TINY, steps=4, micro_batches=2, wire_dtype="bf16"))["losses"]
    assert bf16 != plain  # the format was applied
    for a, b in zip(plain, bf16):
        assert b == pytest.approx(a, rel=1e-2)


def _mc2_train(out, *extra: str, env: dict | None = None, wait: bool = True):
    """``mc2 train`` with these options: in this process (its ranks fork from the suite's
    preloaded server, the command's code path as on the command line), or with ``wait=False``
    as a command of its own in a new session, to be killed."""
    import os
    import subprocess
    import sys

    from mc2.tools.train import main

    args = ["--batch", "2", "--seq", "32", "--out", str(out), *extra]
    if not wait:
        return subprocess.Popen([sys.executable, "-m", "mc2.tools.cli", "train", *args],
                                env={**os.environ, **(env or {})}, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert env is None, "in this process the environment is the suite's"
    assert main(args) == 0


def _losses(out) -> list[float]:
    import json

    return json.loads((out / "losses.json").read_text())["runs"]["MC2 K=2"]["losses"]


def test_kill_9_in_the_middle_of_a_save_then_resume(tmp_path) -> None:
    """Saves write ``step-N.partial`` and publish by rename: a kill -9 between the two leaves
    the last good checkpoint, and ``--resume`` continues as if nothing happened."""
    import os
    import signal
    import time

    _mc2_train(tmp_path / "straight", "--steps", "4")
    run = tmp_path / "run"
    _mc2_train(run, "--steps", "2", "--checkpoint-every", "1")
    saves = run / "checkpoints" / "MC2_K=2"
    proc = _mc2_train(run, "--steps", "4", "--checkpoint-every", "1", "--resume",
                      env={"MC2_DEBUG_SAVE_DELAY_S": "60"}, wait=False)
    try:
        deadline = time.monotonic() + 120
        while not (saves / "step-000003.partial" / ".metadata").is_file():
            assert time.monotonic() < deadline and proc.poll() is None, "the save never came"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)  # every rank, in the middle of the save
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert sorted(p.name for p in saves.iterdir()) == [
        "step-000001", "step-000002", "step-000003.partial"]
    _mc2_train(run, "--steps", "4", "--checkpoint-every", "1", "--resume")
    assert _losses(run) == pytest.approx(_losses(tmp_path / "straight"), rel=1e-6)
    assert sorted(p.name for p in saves.iterdir()) == ["step-000003", "step-000004"]
