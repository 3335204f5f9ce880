"""End-to-end training: MC2 equals serial, the loss falls, checkpoints resume exactly."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mc2.train import TrainConfig, load_corpus, run_training

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


def test_checkpoint_resume_continues_the_same_run(tmp_path) -> None:
    straight = run_training(replace(TINY, steps=4))["losses"]
    ckpt = replace(TINY, steps=2, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    run_training(ckpt)
    resumed = run_training(replace(ckpt, steps=4, resume=True))["losses"]
    assert resumed == pytest.approx(straight, rel=1e-6)
