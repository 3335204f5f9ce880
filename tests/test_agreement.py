"""Ranks whose configurations differ raise ``ValueError`` on every rank, within seconds, in
every mode: before this was agreed, a capacity call with another rank's capacity made Gloo
terminate the process ("Received data size doesn't match expected size"), and the normal
handshake did not carry capacity, overflow, gemm, timeout or check_finite."""

from __future__ import annotations

import pytest
import torch

import mc2
from tests.problems import make_problem
from tests.workers_agreement import differing_option, later_mismatch

CASES = [  # (common, rank 0's, the others', the field the message names)
    ({"micro_batches": 1}, {"capacity": 72}, {"capacity": 64}, "capacity"),
    ({"micro_batches": 1, "capacity": 64}, {"overflow": "drop"}, {"overflow": "raise"},
     "overflow"),
    ({"micro_batches": 1}, {"capacity": 64}, {}, "capacity"),
    ({"micro_batches": 2, "capacity": 64}, {"timeout": 30}, {"timeout": 60}, "timeout"),
    ({"micro_batches": 2}, {"gemm": "loop"}, {"gemm": "grouped"}, "gemm"),
    ({"micro_batches": 2}, {"check_finite": True}, {}, "check_finite"),
    ({"micro_batches": 2}, {"timeout": 30}, {"timeout": 45}, "timeout"),
]


@pytest.fixture(scope="module", params=(2, 4))
def worlds(request):
    world = request.param
    p = make_problem(world, "uniform", dtype=torch.float32, seed=3)
    return world, p, [mc2.run_local(differing_option, world, args=(p, *case[:3]),
                                    timeout_s=30, deadline_s=120) for case in CASES]


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[3] + str(i) for i, c in
                                                          enumerate(CASES)])
def test_every_rank_raises_naming_the_field(worlds, index: int) -> None:
    world, problem, results = worlds
    field = CASES[index][3]
    for rank, r in enumerate(results[index]):
        assert r["raised"] is not None, f"rank {rank} ran a call its peers disagreed with"
        assert field in r["raised"] and "disagree" in r["raised"], (rank, r["raised"])
        assert r["seconds"] < 10, (rank, r["seconds"])
        assert r["after"].shape == problem.xs[rank].shape


@pytest.mark.parametrize("world", (2, 4))
def test_a_later_mismatch_in_capacity_mode_is_seen_by_every_rank(world: int) -> None:
    """After their first calls, capacity calls read nothing and exchange no handshake: a rank
    that then calls with another agreed configuration than its peers is caught by the
    fingerprint every slab carries, on every rank (at the end of the call on a CPU)."""
    p = make_problem(world, "uniform", dtype=torch.float32, seed=5)
    a = {"micro_batches": 1, "capacity": 64, "overflow": "drop"}
    b = {"micro_batches": 1, "capacity": 64, "overflow": "raise"}
    for rank, r in enumerate(mc2.run_local(later_mismatch, world, args=(p, a, b),
                                           timeout_s=30, deadline_s=120)):
        assert r["raised"] is not None, f"rank {rank} did not see its peers' other options"
        message, mismatched = r["raised"]
        assert "configuration differs" in message and mismatched >= 1, (rank, message)
        assert r["after"].shape == p.xs[rank].shape
