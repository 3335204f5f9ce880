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
    handshake runs (both were agreed), the slabs are the same size, and only the fingerprint
    in their headers tells. What each rank raised, then a call made alike."""
    args = (problem.xs[rank], *problem.local_weights(rank), problem.ids[rank], problem.rws[rank])
    with torch.no_grad():
        mc2.fused_expert(*args, **a)
        mc2.fused_expert(*args, **b)
        try:
            mc2.fused_expert(*args, **(a if rank == 0 else b))
            raised = None
        except mc2.CapacityOverflow as exc:
            raised = (str(exc), exc.mismatched)
        after = mc2.fused_expert(*args, **b)
    return {"raised": raised, "after": after}
