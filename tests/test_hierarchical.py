"""Hierarchical (2-D) All-to-All on 4 ranks as 2 nodes x 2: equal to flat, bit for bit, and to
the dense reference, forward and backward, overlapped and serial, hostile routings included."""

from __future__ import annotations

import itertools

import pytest
import torch

import mc2
from tests.problems import make_problem
from tests.test_fused_expert_distributed import assert_close, reference
from tests.workers import (
    auto_hierarchy_row_bytes,
    measurement_after_the_comm_thread,
    run_cases_as_nodes,
)

CASES = [(routing, k, overlap) for routing, k, overlap in itertools.product(
    ("uniform", "one_expert", "rank_receives_nothing", "zero_tokens", "uneven"), (1, 3),
    (True, False))]


@pytest.fixture(scope="module")
def results() -> list[list[dict]]:
    cases = []
    for routing, k, overlap in CASES:
        p = make_problem(4, routing, seed=7)
        for hierarchy in ("flat", "2d"):
            cases.append((p, {"micro_batches": k, "overlap": overlap, "hierarchy": hierarchy}))
    return mc2.run_local(run_cases_as_nodes, 4, args=(2, cases), deadline_s=300)


@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=[f"{r}-K{k}-{'overlap' if o else 'serial'}" for r, k, o in CASES])
def test_2d_equals_flat_and_reference(results, index: int) -> None:
    routing, k, overlap = CASES[index]
    ref = reference(make_problem(4, routing, seed=7))
    for rank in range(4):
        flat, two_d = results[rank][2 * index], results[rank][2 * index + 1]
        for key in ("out", "x", "rw"):
            assert torch.equal(flat[key], two_d[key]), f"rank {rank} {key}: 2d != flat"
        for a, b in zip(flat["w"], two_d["w"]):
            assert torch.equal(a, b), f"rank {rank}: weight grads 2d != flat"
        assert_close(two_d["out"], ref["out"][rank], torch.float64, f"rank {rank} out")
        assert_close(two_d["x"], ref["x"][rank], torch.float64, f"rank {rank} grad x")
        for g, want in zip(two_d["w"], ref["w"][rank]):
            assert_close(g, want, torch.float64, f"rank {rank} grad w")


def test_auto_measures_and_agrees() -> None:
    """'auto' times both exchanges once, all ranks take the same choice, results equal flat."""
    p = make_problem(4, "uniform", seed=9)
    cases = [(p, {"micro_batches": 2, "hierarchy": h}) for h in ("flat", "auto", "auto")]
    results = mc2.run_local(run_cases_as_nodes, 4, args=(2, cases), deadline_s=120)
    for r in results:
        assert torch.equal(r[0]["out"], r[1]["out"]) and torch.equal(r[0]["out"], r[2]["out"])
        assert torch.equal(r[0]["x"], r[1]["x"])


def test_auto_measures_rows_as_wide_as_the_wire_format() -> None:
    """fp8 rows are 1 byte per channel plus a float32 scale per block: 'auto' times those."""
    p = make_problem(4, "uniform", seed=9)
    hidden = p.xs[0].shape[-1]
    plain = hidden * p.xs[0].dtype.itemsize
    fp8 = hidden + 4 * hidden // 8
    results = mc2.run_local(auto_hierarchy_row_bytes, 4,
                            args=(2, p, [None, torch.float8_e4m3fn, torch.bfloat16]),
                            deadline_s=120)
    for seen in results:
        assert seen == [[plain], [fp8], [2 * hidden]]


def test_auto_measures_after_the_exchanges_running_on_the_comm_thread() -> None:
    """A measurement issues collectives on the intra- and inter-node groups from the
    caller's thread; an exchange of another call still running on the communication thread
    (a backward's 2-D combine beside a paired forward) issues on the same groups, and two
    threads issuing on one group issue in different orders on different ranks. The
    measurement begins after that exchange ended (it began at once before)."""
    for order in mc2.run_local(measurement_after_the_comm_thread, 4, args=(2,),
                               deadline_s=120):
        assert order == ["exchange in flight ended", "measured"], order
