"""Two emulated nodes in network namespaces: Gloo runs across tc-shaped links, the 2-D
exchange equals the flat one and the reference there, and nothing is left behind."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import mc2
from mc2.tools.netns import EmulatedCluster, NetnsError, leftover_namespaces, parse_rate
from tests.problems import make_problem
from tests.test_fused_expert_distributed import assert_close, reference
from tests.workers import hierarchy_pair

CAN = os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")
# this process's namespaces only (EmulatedCluster names them by its pid): another pytest-xdist
# worker's tests may make theirs meanwhile (make test runs two)
MINE = f"mc2-{os.getpid()}-"
needs_root = pytest.mark.skipif(not CAN, reason="network namespaces need root and iproute2 "
                                                "(CI runs as root, so it runs there)")


@needs_root
def test_flat_and_2d_agree_across_shaped_nodes() -> None:
    before = leftover_namespaces(MINE)
    p = make_problem(4, "uneven", seed=5)
    with EmulatedCluster(2, 2, "1gbit") as cluster:
        made = set(leftover_namespaces(MINE)) - set(before)
        assert made == {cluster.switch, cluster.node_ns(0), cluster.node_ns(1)}
        results = mc2.run_local(hierarchy_pair, 4, args=(p,), ranks_per_node=2,
                                rank_env=cluster.rank_environment, deadline_s=120)
    assert leftover_namespaces(MINE) == before, "namespaces left behind"
    ref = reference(p)
    for rank, r in enumerate(results):
        assert torch.equal(r["flat"][0], r["2d"][0]) and torch.equal(r["flat"][1], r["2d"][1])
        assert_close(r["2d"][0], ref["out"][rank], torch.float64, f"rank {rank} out")
        assert_close(r["2d"][1], ref["x"][rank], torch.float64, f"rank {rank} grad x")


@needs_root
def test_teardown_on_failure() -> None:
    before = leftover_namespaces(MINE)
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(2, 1, None):
            raise RuntimeError("boom")
    assert leftover_namespaces(MINE) == before


def test_rates_are_validated() -> None:
    assert parse_rate("2GBIT") == "2gbit"
    with pytest.raises(ValueError, match="bandwidth must look like"):
        parse_rate("fast")


def test_not_root_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetnsError, match="needs root"):
        EmulatedCluster(2, 2).__enter__()


@needs_root
def test_torchrun_across_two_emulated_nodes(tmp_path) -> None:
    """A real ``torchrun --nnodes 2`` rendezvous between namespaces: dp across, ep inside."""
    import json

    from mc2.tools.cli import main

    before = leftover_namespaces(MINE)
    out = tmp_path / "run"
    code = main(["train", "--nodes", "2", "--ranks-per-node", "2", "--ep-size", "2",
                 "--inter-node-bandwidth", "1gbit", "--steps", "3", "--batch", "2", "--seq",
                 "32", "--out", str(out)])
    assert code == 0
    assert leftover_namespaces(MINE) == before
    runs = json.loads((out / "losses.json").read_text())["runs"]
    losses = runs["MC2 K=2"]["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0]
    from mc2.tools.training import TrainConfig, run_training

    local = run_training(TrainConfig(steps=3, batch=2, seq=32, ep_size=2, progress=False), 4)
    assert losses == pytest.approx(local["losses"], rel=1e-5)  # the same run, on loopback
