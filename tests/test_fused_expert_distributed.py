"""fused_expert in real multi-process Gloo worlds equals a dense single-process reference.

One local world per world size runs every case (spawning is the slow part); each case is then
checked as its own test item: outputs and the gradients of x, the three weights and the routing
weights, for hostile routings, K that does not divide the token count, top-1/top-2, overlapped
and serial, float64/float32/bfloat16, both GEMM strategies.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass

import pytest
import torch

import mc2
from tests.problems import ROUTINGS, Problem, make_problem
from tests.reference import dense_moe
from tests.workers import run_cases

# Relative to the largest reference magnitude. bfloat16 keeps 8 significant bits (unit roundoff
# 2^-8 ~ 3.9e-3); an output passes ~6 rounded intermediates (gate, up, their product, the down
# projection, the weighted top-k sum, plus bf16 GEMM accumulation), so a few units of roundoff,
# ~2e-2 of the scale, bound the error; 3e-2 leaves margin without hiding a wrong route (which
# moves results by O(1) of the scale).
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class Case:
    routing: str
    topk: int
    micro_batches: int | str
    overlap: bool
    dtype: torch.dtype = torch.float64
    gemm: str = "auto"
    layout: str = "split"  # "packed": mc2.fused_expert_packed with the nn.Linear layout
    # tokens of rank 0 (each next rank 3 more): at 13, top-2 calls of 2 ranks (and top-1 calls
    # of 4) carry their ids in the handshake (validation.FOLD_IDS); at 40 none does
    tokens: int = 13

    @property
    def id(self) -> str:
        return (f"{self.routing}-top{self.topk}-K{self.micro_batches}-"
                f"{'overlap' if self.overlap else 'serial'}-{str(self.dtype)[6:]}-{self.gemm}-"
                f"{self.layout}" + (f"-{self.tokens}tokens" if self.tokens != 13 else ""))


CASES = [Case(r, k, m, o) for r, k, m, o in itertools.product(
    ROUTINGS, (1, 2), (1, 2, 3, 8), (True, False))]
CASES += [Case(r, 2, "auto", True) for r in ROUTINGS]
CASES += [Case(r, 2, m, True, torch.float32, g) for r, m, g in itertools.product(
    ("uniform", "uneven", "one_expert"), (1, 3), ("loop", "grouped"))]
CASES += [Case("uniform", 2, m, True, torch.bfloat16, g) for m, g in itertools.product(
    (1, 4), ("loop", "grouped"))]
CASES += [Case(r, k, m, o, layout="packed") for r, k, m, o in itertools.product(
    ROUTINGS, (1, 2), (1, 3), (True, False))]
CASES += [Case(r, 2, m, True, torch.float32, g, "packed") for r, m, g in itertools.product(
    ("uniform", "one_expert"), (1, 3), ("loop", "grouped"))]
CASES += [Case("uniform", 2, 4, True, torch.bfloat16, "loop", "packed")]
CASES += [Case(r, 2, m, o, tokens=40) for r, m, o in itertools.product(
    ROUTINGS, (1, 3, "auto"), (True, False))]
WORLDS = (2, 4)


def problem_for(case: Case, world: int) -> Problem:
    return make_problem(world, case.routing, topk=case.topk, dtype=case.dtype,
                        tokens=case.tokens,
                        seed=zlib.crc32(f"{case.routing}{case.topk}".encode()) % 1000)


@pytest.fixture(scope="module")
def world_results() -> dict[int, list[dict]]:
    results = {}
    for world in WORLDS:
        cases = [(problem_for(c, world), {"micro_batches": c.micro_batches, "overlap": c.overlap,
                                          "gemm": c.gemm, "layout": c.layout}) for c in CASES]
        results[world] = mc2.run_local(run_cases, world, args=(cases,), deadline_s=300)
    return results


def reference(problem: Problem) -> dict:
    """Dense float64 outputs and gradients of the whole problem, split back per rank."""
    up = lambda t: t.detach().to(torch.float64).requires_grad_(True)  # noqa: E731
    x, rw = up(torch.cat(problem.xs)), up(torch.cat(problem.rws))
    ws = [up(problem.w_up), up(problem.w_gate), up(problem.w_down)]
    out = dense_moe(x, *ws, torch.cat(problem.ids), rw)
    out.backward(torch.cat(problem.grad_outs).to(torch.float64))
    sizes = [t.shape[0] for t in problem.xs]
    L = problem.local_experts
    return {
        "out": out.detach().split(sizes), "x": x.grad.split(sizes), "rw": rw.grad.split(sizes),
        "w": [[w.grad[r * L:(r + 1) * L] for w in ws] for r in range(problem.world)],
    }


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str,
                 tolerance: dict[torch.dtype, float] = TOLERANCE) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if want.numel() == 0:
        return
    scale = max(want.abs().max().item(), 1e-3 if dtype != torch.float64 else 1.0)
    err = (got.to(torch.float64) - want).abs().max().item()
    assert err <= tolerance[dtype] * scale, f"{what}: max error {err:.3g} (scale {scale:.3g})"


def assert_ranks_match(got: list[dict], problem: Problem, what: str = "",
                       tolerance: dict[torch.dtype, float] = TOLERANCE) -> None:
    """Every rank's output and gradients (``run_cases``' results of one case) against the dense
    reference of ``problem``."""
    ref = reference(problem)
    dtype = problem.xs[0].dtype
    for rank, r in enumerate(got):
        at = f"{what} rank {rank}".strip()
        assert_close(r["out"], ref["out"][rank], dtype, f"{at} output", tolerance)
        assert_close(r["x"], ref["x"][rank], dtype, f"{at} grad x", tolerance)
        assert_close(r["rw"], ref["rw"][rank], dtype, f"{at} grad routing_weights", tolerance)
        for name, g, want in zip(("up", "gate", "down"), r["w"], ref["w"][rank]):
            assert_close(g, want, dtype, f"{at} grad weights_{name}", tolerance)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matches_dense_reference(world_results, world: int, case: Case) -> None:
    index = CASES.index(case)
    assert_ranks_match([r[index] for r in world_results[world]], problem_for(case, world))


@pytest.mark.parametrize("world", WORLDS)
def test_overlap_equals_serial(world_results, world: int) -> None:
    """Same problem, same K: the overlapped and the serial schedule give the same numbers."""
    for i, case in enumerate(CASES):
        if case.overlap or case.dtype != torch.float64:
            continue
        twin = CASES.index(Case(case.routing, case.topk, case.micro_batches, True,
                                layout=case.layout, tokens=case.tokens))
        for rank in range(world):
            a, b = world_results[world][rank][i], world_results[world][rank][twin]
            torch.testing.assert_close(a["out"], b["out"], rtol=0, atol=1e-12)
            torch.testing.assert_close(a["x"], b["x"], rtol=0, atol=1e-12)
