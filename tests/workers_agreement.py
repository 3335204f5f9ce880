"""Rank functions where one rank's configuration differs from its peers'."""

from __future__ import annotations

import time
from typing import Any

import torch

import mc2
from tests.problems import Problem


def differing_option(rank: int, world: int, problem: Problem, common: dict[str, Any],
                     mine: dict[str, Any], theirs: dict[str, Any]) -> dict:
    """Rank 0 calls with ``common | mine``, the others with ``common | theirs``: what each
    raised and how long it took; then a call every rank makes alike, which must still work."""
    args = (problem.xs[rank], *problem.local_weights(rank), problem.ids[rank], problem.rws[rank])
    options = {**common, **(mine if rank == 0 else theirs)}
    start = time.monotonic()
    try:
        with torch.no_grad():
            mc2.fused_expert(*args, **options)
        raised = None
    except ValueError as exc:
        raised = str(exc)
    took = time.monotonic() - start
    with torch.no_grad():
        after = mc2.fused_expert(*args, **{**common, **theirs})
    return {"raised": raised, "seconds": took, "after": after}


def later_mismatch(rank: int, world: int, problem: Problem, a: dict[str, Any],
                   b: dict[str, Any]) -> dict:
    """Every rank runs capacity calls with options ``a``, then ``b`` (each agreed by its first
    call's handshake); then rank 0 calls with ``a`` while the others call with ``b``: no
    handshake runs (both were agreed), the slabs are the same size, and only the
    fingerprints in the calls' headers tell. What each rank raised, then a call made alike."""
    args = (problem.xs[rank], *problem.local_weights(rank), problem.ids[rank], problem.rws[rank])
    with torch.no_grad():
        mc2.fused_expert(*args, **a)
        mc2.fused_expert(*args, **b)
        try:
            mc2.fused_expert(*args, **(a if rank == 0 else b))
            raised = None
        except ValueError as exc:
            raised = str(exc)
        after = mc2.fused_expert(*args, **b)
    return {"raised": raised, "after": after}


def changed_after_warmup(rank: int, world: int, problem: Problem, timeout: float) -> dict:
    """Every rank calls ``capacity=64`` twice (agreed, then trusted); then the last rank alone
    calls ``capacity=72`` (a capacity sized from its own batch). What each rank raised and how
    long it took; then a call made alike (its output and input gradient), which must still
    work."""
    args = (problem.xs[rank], *problem.local_weights(rank), problem.ids[rank], problem.rws[rank])
    with torch.no_grad():
        for _ in range(2):
            mc2.fused_expert(*args, micro_batches=1, capacity=64, timeout=timeout)
        start = time.monotonic()
        try:
            mc2.fused_expert(*args, micro_batches=1, timeout=timeout,
                             capacity=72 if rank == world - 1 else 64)
            raised = None
        except ValueError as exc:
            raised = str(exc)
        took = time.monotonic() - start
    x = problem.xs[rank].clone().requires_grad_(True)
    after = mc2.fused_expert(x, *args[1:], micro_batches=2, capacity=64, timeout=timeout)
    after.backward(problem.grad_outs[rank])
    return {"raised": raised, "seconds": took, "after": after.detach(), "x": x.grad}
