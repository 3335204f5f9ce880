"""Ranks whose configurations differ raise ``ValueError`` on every rank, within seconds, in
every mode: before this was agreed, a capacity call with another rank's capacity made Gloo
terminate the process ("Received data size doesn't match expected size"), and the normal
handshake did not carry capacity, overflow, gemm, timeout or check_finite (nor, for dedup
and capacity mode, topk)."""

from __future__ import annotations

import pytest
import torch

import mc2
from tests.problems import make_problem
from tests.reference import dense_moe
from tests.workers_agreement import changed_after_warmup, differing_option, later_mismatch

CASES = [  # (common, rank 0's, the others', the field the message names)
    ({"micro_batches": 1}, {"capacity": 72}, {"capacity": 64}, "capacity"),
    ({"micro_batches": 1, "capacity": 64}, {"overflow": "drop"}, {"overflow": "raise"},
     "overflow"),
    ({"micro_batches": 1}, {"capacity": 64}, {}, "capacity"),
    ({"micro_batches": 2, "capacity": 64}, {"timeout": 30}, {"timeout": 60}, "timeout"),
    ({"micro_batches": 2}, {"gemm": "loop"}, {"gemm": "grouped"}, "gemm"),
    ({"micro_batches": 2}, {"check_finite": True}, {}, "check_finite"),
    ({"micro_batches": 2}, {"timeout": 30}, {"timeout": 45}, "timeout"),
    # k-wide slot tables: a receive buffer sized by the receiver's own topk (before: Gloo
    # terminated the process, or a capacity call read uninitialised memory as token ids)
    ({"micro_batches": 1, "dedup": True}, {"topk": 1}, {}, "topk"),
    ({"micro_batches": 2, "capacity": 64}, {"topk": 1}, {}, "topk"),
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
        # far from the call's deadline (120 s): raised by the handshake, not by a timeout
        assert r["seconds"] < 60, (rank, r["seconds"])
        want = dense_moe(problem.xs[rank], problem.w_up, problem.w_gate, problem.w_down,
                         problem.ids[rank], problem.rws[rank])
        torch.testing.assert_close(r["after"], want, rtol=1e-5, atol=1e-5)  # and it recovers


@pytest.mark.parametrize("world", (2, 4))
def test_a_later_mismatch_in_capacity_mode_is_seen_by_every_rank(world: int) -> None:
    """After their first calls, capacity calls read nothing and run no handshake: a rank that
    then calls with another agreed configuration than its peers is caught by the header every
    call runs in host memory (trusted: nothing read from a device), on every rank, before a
    slab moves."""
    p = make_problem(world, "uniform", dtype=torch.float32, seed=5)
    a = {"micro_batches": 1, "capacity": 64, "overflow": "drop"}
    b = {"micro_batches": 1, "capacity": 64, "overflow": "raise"}
    for rank, r in enumerate(mc2.run_local(later_mismatch, world, args=(p, a, b),
                                           timeout_s=30, deadline_s=120)):
        assert r["raised"] is not None, f"rank {rank} did not see its peers' other options"
        assert "disagree on overflow" in r["raised"], (rank, r["raised"])
        want = dense_moe(p.xs[rank], p.w_up, p.w_gate, p.w_down, p.ids[rank], p.rws[rank])
        torch.testing.assert_close(r["after"], want, rtol=1e-5, atol=1e-5)  # and it recovers


@pytest.mark.parametrize("world", (2, 4))
def test_a_capacity_changed_by_one_rank_after_warm_up_raises_on_every_rank(world: int) -> None:
    """Every rank calls ``capacity=64`` twice, then the last rank alone ``capacity=72``: a
    clear error on every rank well within the call's deadline (before the trusted calls'
    handshake, every rank waited until the group's timeout: the changed rank in a handshake,
    the others in a slab exchange); then a call made alike equals the dense reference,
    forward and backward."""
    p = make_problem(world, "uniform", dtype=torch.float64, seed=7)
    deadline = 120.0
    results = mc2.run_local(changed_after_warmup, world, args=(p, deadline), timeout_s=60,
                            deadline_s=300)
    for rank, r in enumerate(results):
        assert r["raised"] is not None, f"rank {rank} ran a call its peers disagreed with"
        assert "disagree on capacity (values between 64 and 72)" in r["raised"], r["raised"]
        assert r["seconds"] < deadline / 2, (rank, r["seconds"])
        x = p.xs[rank].clone().requires_grad_(True)
        want = dense_moe(x, p.w_up, p.w_gate, p.w_down, p.ids[rank], p.rws[rank])
        want.backward(p.grad_outs[rank])
        torch.testing.assert_close(r["after"], want.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(r["x"], x.grad, rtol=0, atol=1e-12)


def test_host_numbers_agree_on_a_gloo_group_where_the_group_carries_no_host_memory() -> None:
    """The branch a NCCL group takes (its collectives take no CPU tensors), run on CPU: host
    numbers agree on a Gloo group over the same ranks, made once (one group, kept), so the
    decision of every forward never reads the device."""
    from tests.workers_agreement import host_agreement_without_host_memory

    for found in mc2.run_local(host_agreement_without_host_memory, 2, timeout_s=60):
        assert found["first"] == found["second"] == [1.0, 0.0, 0.5]
        assert found["third"] == [10.0]
        assert found["own_group"] and found["ranks"] == [0, 1]
        assert found["made"] == 1 and found["kept"]


@pytest.mark.parametrize("fingerprints", (True, False), ids=["fingerprint", "check-removed"])
def test_without_a_host_handshake_the_slab_fingerprint_catches_a_later_mismatch(
        fingerprints: bool) -> None:
    """The branch a group of NCCL alone takes (no host memory to agree in: steady capacity
    calls run no handshake), run on CPU with the host check forced off: rank 0 calls with
    another agreed configuration than its peers; the slabs are the same size and only the
    fingerprint in their headers tells. Every rank raises, naming it; with the fingerprint
    check removed, no rank does (the test's own mutation check)."""
    from tests.workers_agreement import later_mismatch_without_host_handshake

    p = make_problem(2, "uniform", dtype=torch.float32, seed=5)
    a = {"micro_batches": 1, "capacity": 64, "overflow": "drop"}
    b = {"micro_batches": 1, "capacity": 64, "overflow": "raise"}
    results = mc2.run_local(later_mismatch_without_host_handshake, 2,
                            args=(p, a, b, fingerprints), timeout_s=30, deadline_s=120)
    for rank, r in enumerate(results):
        if fingerprints:
            assert r["raised"] is not None and "configuration differs" in r["raised"], r
        else:
            assert r["raised"] is None, r
        want = dense_moe(p.xs[rank], p.w_up, p.w_gate, p.w_down, p.ids[rank], p.rws[rank])
        torch.testing.assert_close(r["after"], want, rtol=1e-5, atol=1e-5)
