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
