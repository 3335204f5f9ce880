"""Rank functions for the dropped-slot tests: expert id ``-1`` (no expert) in every way rows
travel."""

from __future__ import annotations

from typing import Any

import torch

import mc2
from tests.problems import Problem

# (name, options): rows per pair at K=1 and K=3, once per destination, capacity slabs
MODES: dict[str, dict[str, Any]] = {
    "pairs K=1": dict(micro_batches=1),
    "pairs K=3": dict(micro_batches=3),
    "dedup K=3": dict(micro_batches=3, dedup=True),
    "capacity": dict(micro_batches=2, capacity=64),
}
# the two-stage exchange (ranks presented as nodes of two): rows per pair, once per destination
TWO_STAGE: dict[str, dict[str, Any]] = {
    "2d pairs K=2": dict(micro_batches=2, hierarchy="2d"),
    "2d dedup K=2": dict(micro_batches=2, hierarchy="2d", dedup=True),
}


def drop(problem: Problem, seed: int) -> Problem:
    """``problem`` with about half of its slots dropped (id ``-1``; their weights left as they
    were: a dropped slot must add nothing whatever its weight), every slot of some tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = []
    for rank_ids in problem.ids:
        dropped = torch.rand(rank_ids.shape, generator=g) < 0.5
        if rank_ids.shape[0]:
            dropped[0] = True  # a token with no expert at all
        ids.append(torch.where(dropped, -1, rank_ids))
    return Problem(problem.xs, ids, problem.rws, problem.grad_outs, problem.w_up,
                   problem.w_gate, problem.w_down, problem.world)


def dropped_step(rank: int, world: int, problems: list[Problem],
                 modes: dict[str, dict[str, Any]] = MODES) -> list[dict[str, Any]]:
    """Every problem in every mode: this rank's output, gradients and rows sent per
    destination."""
    out = []
    for problem in problems:
        w_up, w_gate, w_down = (w.clone().requires_grad_() for w in problem.local_weights(rank))
        for options in modes.values():
            x = problem.xs[rank].clone().requires_grad_()
            rw = problem.rws[rank].clone().requires_grad_()
            with mc2.count_traffic() as traffic:
                y = mc2.fused_expert(x, w_up, w_gate, w_down, problem.ids[rank], rw, **options)
            (y * problem.grad_outs[rank]).sum().backward()
            out.append({"out": y.detach(), "grad_x": x.grad, "grad_rw": rw.grad,
                        "grads": [w.grad.clone() for w in (w_up, w_gate, w_down)],
                        "rows_sent": list(traffic.rows_sent),
                        "node_rows": list(traffic.node_rows)})
            for w in (w_up, w_gate, w_down):
                w.grad = None
    return out


def dense_kept(problem: Problem) -> dict[str, Any]:
    """The dense reference (:func:`tests.reference.dense_moe`) with only the kept slots
    (a dropped slot's weight is zeroed there, on a valid expert): outputs and gradients."""
    from tests.reference import dense_moe

    ws = [w.clone().requires_grad_() for w in (problem.w_up, problem.w_gate, problem.w_down)]
    outs, grad_x, grad_rw = [], [], []
    for rank in range(problem.world):
        x = problem.xs[rank].clone().requires_grad_()
        rw = problem.rws[rank].clone().requires_grad_()
        kept = problem.ids[rank] >= 0
        y = dense_moe(x, *ws, problem.ids[rank].clamp(min=0), rw * kept)
        (y * problem.grad_outs[rank]).sum().backward()
        outs.append(y.detach())
        grad_x.append(x.grad)
        grad_rw.append(rw.grad)
    return {"out": outs, "grad_x": grad_x, "grad_rw": grad_rw, "grads": [w.grad for w in ws]}


def expected_rows(problem: Problem, rank: int, *, once: bool) -> list[int]:
    """Rows ``rank`` must send to each rank: one per kept slot, or (``once``) one per token and
    destination holding a kept slot; a dropped slot none."""
    dest = problem.ids[rank] // problem.local_experts  # -1 // L == -1: no destination
    rows = []
    for d in range(problem.world):
        hit = dest == d
        rows.append(int(hit.any(1).sum()) if once else int(hit.sum()))
    return rows
