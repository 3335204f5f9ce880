"""Rows once per destination (``dedup=True``): equal to the dense reference, and fewer rows.

Real Gloo worlds of 2 ranks and of 4 ranks presented as 2 nodes of 2 (one world each, every
case inside): every hostile routing, including a token's experts all on one rank and no
token's experts on its own rank, K that does not divide the tokens, overlapped and serial, the
flat and the 2-D exchange, float64/float32/bfloat16, both layouts and every wire format. The
rows the exchanges were sized for are counted (:func:`mc2.count_traffic`) and compared with the
distinct (token, rank) and (token, node) pairs of the routing, counted here independently.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import mc2
from mc2.engine.decide.dedup import expected_destinations
from tests.problems import DEDUP_ROUTINGS, make_problem
from tests.test_fused_expert_distributed import assert_ranks_match
from tests.test_wire import BLOCK, FP8, check, hostile
from tests.workers import count_rows, run_cases_as_nodes

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 3e-2}


def _problem(world: int, routing: str, dtype: torch.dtype = torch.float64):
    return make_problem(world, routing, topk=3 if routing == "same_rank" else 2, dtype=dtype,
                        seed=len(routing))


def _cases(world: int) -> list[tuple[str, object, dict]]:
    hierarchies = ("flat", "2d") if world == 4 else ("flat",)
    cases = [(f"{r} K{k} {'overlap' if o else 'serial'} {h}", _problem(world, r),
              {"micro_batches": k, "overlap": o, "hierarchy": h})
             for r, k, o, h in itertools.product(DEDUP_ROUTINGS, (1, 3), (True, False),
                                                 hierarchies)
             if o or h == "flat"]
    cases += [(f"uniform K3 {d} {g} {lay}", _problem(world, "uniform", d),
               {"micro_batches": 3, "gemm": g, "layout": lay})
              for d, g, lay in [(torch.float32, "loop", "split"), (torch.float32, "grouped",
                                                                      "packed"),
                                (torch.bfloat16, "grouped", "split")]]
    cases += [("same_rank auto", _problem(world, "same_rank"), {"micro_batches": "auto"})]
    cases += [(f"wire {w} {h}", hostile("uneven", world=world),
               {"micro_batches": 2, "wire_dtype": w, "wire_block": BLOCK, "hierarchy": h})
              for w in (torch.bfloat16, FP8, "int8", (FP8, torch.bfloat16))
              for h in hierarchies]
    return [(name, p, {**opts, "dedup": True}) for name, p, opts in cases]


@pytest.fixture(scope="module", params=(2, 4), ids=("2 ranks", "2 nodes x 2"))
def world(request):
    n = request.param
    cases = _cases(n)
    results = mc2.run_local(run_cases_as_nodes, n, args=(2, [(p, o) for _, p, o in cases]),
                            deadline_s=300)
    return n, cases, results


def test_equals_the_dense_reference(world) -> None:
    _, cases, results = world
    for i, (name, problem, options) in enumerate(cases):
        if "wire_dtype" in options:
            check([r[i] for r in results], problem, options["wire_dtype"], name)
            continue
        assert_ranks_match([r[i] for r in results], problem, name, TOLERANCE)


def _distinct(ids: torch.Tensor, per: int) -> list[int]:
    """Rows per destination if each token goes once to each destination of ``per`` experts."""
    dests = ids // per
    counts = [0] * (int(dests.max()) + 1 if dests.numel() else 0)
    for row in dests.tolist():
        for d in set(row):
            counts[d] += 1
    return counts


@pytest.mark.parametrize("hierarchy", ("flat", "2d"))
def test_rows_sent_are_the_distinct_destinations(hierarchy: str) -> None:
    p = make_problem(4, "uniform", topk=3, local_experts=3, tokens=40, seed=5)
    results = mc2.run_local(count_rows, 4, args=(2, p, {"micro_batches": 2, "dedup": True,
                                                         "hierarchy": hierarchy}),
                            deadline_s=120)
    plain = mc2.run_local(count_rows, 4, args=(2, p, {"micro_batches": 2}), deadline_s=120)
    L = p.local_experts
    for rank, (got, base) in enumerate(zip(results, plain)):
        want = _distinct(p.ids[rank], L)
        assert got["rows_sent"] == want + [0] * (4 - len(want))
        assert base["rows_sent"] == [int((p.ids[rank] // L == d).sum()) for d in range(4)]
        assert got["pairs"] == base["pairs"] == p.ids[rank].numel()
        if hierarchy == "2d":
            nodes = _distinct(p.ids[rank], 2 * L)
            assert got["node_rows"] == nodes + [0] * (2 - len(nodes))
    total = sum(sum(r["rows_sent"]) for r in results)
    assert total < sum(sum(r["rows_sent"]) for r in plain)  # something was saved


def test_expected_destinations() -> None:
    """The formula the benchmark checks the counter against."""
    assert expected_destinations(8, 2, 2) == pytest.approx(2 * (1 - 6 / 28))
    assert expected_destinations(8, 8, 1) == pytest.approx(1.0)
    assert expected_destinations(256, 1, 8) == 1.0
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(64, generator=g)[:6] for _ in range(4000)])
    seen = sum(len(set(r)) for r in (ids // 8).tolist()) / len(ids)
    assert seen == pytest.approx(expected_destinations(64, 8, 6), rel=0.02)
