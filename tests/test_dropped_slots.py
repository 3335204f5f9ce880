"""Slots of no expert (id ``-1``, what a capacity factor drops): they send no row, compute
nothing and add nothing, in every way rows travel (pairs at K=1 and K=3, once per
destination, capacity slabs), on 2 and 4 ranks with hostile routings and about half the
slots dropped (every slot of some tokens): outputs and every gradient equal the dense
reference over the kept slots (float64, 1e-12), the dropped slots' weight gradients are zero,
and the rows sent to each destination are exactly the kept slots' (once per destination: the
kept tokens')."""

from __future__ import annotations

import pytest
import torch

import mc2
from tests.problems import make_problem
from tests.workers_dropped import (
    MODES, TWO_STAGE, dense_kept, drop, dropped_step, expected_rows)

ROUTINGS = ("uniform", "one_expert", "uneven", "zero_tokens")


@pytest.mark.parametrize("world,modes", [(2, MODES), (4, MODES), (4, TWO_STAGE)],
                         ids=["2 ranks", "4 ranks", "4 ranks as 2 nodes, 2-D exchange"])
def test_dropped_slots_send_nothing_and_add_nothing(world: int, modes: dict) -> None:
    problems = [drop(make_problem(world, routing, seed=i), seed=i)
                for i, routing in enumerate(ROUTINGS)]
    results = mc2.run_local(dropped_step, world, args=(problems, modes),
                            ranks_per_node=2 if modes is TWO_STAGE else None)
    modes = list(modes)
    for p_index, problem in enumerate(problems):
        want = dense_kept(problem)
        L = problem.local_experts
        for m_index, mode in enumerate(modes):
            what = f"{ROUTINGS[p_index]} {mode}"
            for rank in range(world):
                got = results[rank][p_index * len(modes) + m_index]
                for key in ("out", "grad_x", "grad_rw"):
                    torch.testing.assert_close(got[key], want[key][rank], atol=1e-12, rtol=0,
                                               msg=f"{what} rank {rank} {key}")
                dropped = problem.ids[rank] < 0
                assert bool((got["grad_rw"][dropped] == 0).all()), f"{what} rank {rank}"
                for name, g, w in zip(("up", "gate", "down"), got["grads"], want["grads"]):
                    torch.testing.assert_close(g, w[rank * L:(rank + 1) * L], atol=1e-12,
                                               rtol=0, msg=f"{what} rank {rank} grad {name}")
                assert bool(got["node_rows"]) == mode.startswith("2d"), what  # 2-D: ran
                if mode != "capacity":  # slabs are fixed-size: their rows are slots
                    assert got["rows_sent"] == expected_rows(
                        problem, rank, once="dedup" in mode), f"{what} rank {rank}"


def test_an_id_below_minus_one_is_refused() -> None:
    problem = make_problem(1, "uniform")
    ids = problem.ids[0].clone()
    ids[0, 0] = -2
    with pytest.raises(ValueError, match="expert id -2 out of range"):
        mc2.fused_expert(problem.xs[0], *problem.local_weights(0), ids, problem.rws[0])
