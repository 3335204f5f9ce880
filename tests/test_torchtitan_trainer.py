"""TorchTitan's own ``Trainer`` (its ``__init__`` and ``train`` loop) with mc2's overrides named
in ``override.imports``, against the same trainer without them: Qwen3 MoE under its own FSDP + EP
on 4 ranks, launched by ``torchrun`` so that TorchTitan initialises the distributed world itself
(and turns autograd's device threads off, as it does on every machine). What the run shims for
the CPU, and why, is in tests/torchtitan_trainer_run.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(tmp_path: Path, ranks: int, *args: str) -> list[dict]:
    """tests/torchtitan_trainer_run.py in a ``torchrun`` world of ``ranks``: each rank's
    results."""
    out = tmp_path / "result.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(ranks), str(ROOT / "tests" / "torchtitan_trainer_run.py"), "--out", str(out),
         *args], env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in range(ranks)]


def _relative(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / abs(x) for x, y in zip(a, b, strict=True)]


@pytest.fixture(scope="module")
def trainers(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One world of 4 ranks for the module's tests (a world's start imports TorchTitan's
    trainer in 4 processes): the trainers of tests/torchtitan_trainer_run.py, float32,
    TorchTitan's default (selective) activation checkpointing."""
    return _run(tmp_path_factory.mktemp("trainers"), 4, "--param-dtype", "float32",
                "--runs", "own,paired,paired_mc2_policy")


def _equal_to_its_own(own: dict, paired: dict) -> None:
    """The first two steps within float32 rounding (1e-5: the first from the same weights,
    the second after one AdamW update); the third within 2e-3 (AdamW's first updates take
    the sign of gradients that rounding flips, then routing follows) while the loss falls
    by far more."""
    assert paired["losses"][0] == own["losses"][0]  # one forward from the same weights
    assert max(_relative(own["grad_norms"][:2], paired["grad_norms"][:2])) <= 1e-5, (own, paired)
    assert max(_relative(own["losses"][:2], paired["losses"][:2])) <= 1e-5, (own, paired)
    assert max(_relative(own["losses"], paired["losses"])) <= 2e-3, (own, paired)
    for run in (own, paired):
        assert run["losses"][0] - run["losses"][-1] > 0.1 * run["losses"][0], run


def test_torchtitans_trainer_with_mc2s_overrides_trains_as_its_own(trainers: list[dict]
                                                                   ) -> None:
    """Trainers built by TorchTitan from one seed, float32 parameters, its default selective
    activation checkpointing, 3 micro-batches per step (``global_batch_size`` over
    ``local_batch_size`` times the 4 data-parallel ranks), 3 AdamW steps with its gradient
    clipping, warm-up and expert-bias hook: TorchTitan's own, and with
    ``mc2_routed_experts`` (mc2's call in every MoE layer) and ``mc2_paired_accumulation``,
    whose checkpoint manager made the trainer's ``fwd_bwd_fn`` the paired one at
    ``train()``'s start, so that two of each step's three forwards ran in the partner thread
    beside a backward. Its losses and gradient norms are TorchTitan's
    (:func:`_equal_to_its_own`)."""
    assert all(r == trainers[0] for r in trainers[1:])  # global losses and norms, per step
    own, paired = trainers[0]["own"], trainers[0]["paired"]
    assert own["fwd_bwd_fn"] == "TorchTitan's own" and paired["fwd_bwd_fn"] == "PairedFwdBwd"
    assert own["nodes"] == ["RoutedExperts"] and paired["nodes"] == ["MC2RoutedExperts"]
    steps, micro_batches, layers = 3, 3, 2
    assert own["accumulation"] == paired["accumulation"] == micro_batches
    assert paired["paired_forwards"] == steps * (micro_batches - 1) * layers, paired
    assert own["paired_forwards"] == 0
    assert not paired["multithreading"]  # TorchTitan turned autograd's device threads off
    # every MoE forward (3 micro-batches, 2 layers, 3 steps), and the recomputes (TorchTitan's
    # save list does not name mc2's call), in TorchTitan's selective regions
    assert paired["in_selective_regions"] >= steps * micro_batches * layers, paired
    _equal_to_its_own(own, paired)


def test_the_paired_trainer_with_mc2s_checkpointing_policy_trains_as_its_own(
        trainers: list[dict]) -> None:
    """With ``mc2_selective_ac`` too (TorchTitan's selective policy saving mc2's call, so
    that its recompute runs no exchange), the paired trainer pairs as many forwards and
    trains as TorchTitan's own does."""
    own, paired = trainers[0]["own"], trainers[0]["paired_mc2_policy"]
    assert paired["fwd_bwd_fn"] == "PairedFwdBwd" and paired["paired_forwards"] == 12, paired
    _equal_to_its_own(own, paired)
