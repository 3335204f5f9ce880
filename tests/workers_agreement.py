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
    raised and how long it took; then a call every rank makes alike, which must still work.
    A ``topk`` option keeps that many of each token's experts."""
    args = (problem.xs[rank], *problem.local_weights(rank), problem.ids[rank], problem.rws[rank])
    options = {**common, **(mine if rank == 0 else theirs)}
    first = args
    if "topk" in options:
        k = options.pop("topk")
        first = args[:-2] + (args[-2][:, :k].contiguous(), args[-1][:, :k].contiguous())
    start = time.monotonic()
    try:
        with torch.no_grad():
            mc2.fused_expert(*first, **options)
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


def host_agreement_without_host_memory(rank: int, world: int) -> dict:
    """:func:`mc2.engine.transport.comm.host_max` on a group whose collectives are taken to
    carry no CPU tensors (as NCCL's): it agrees on a Gloo group of its own over the same ranks,
    made once and kept in the group's state; what it agreed, and which groups it used."""
    import torch.distributed as dist

    from mc2.engine.transport import comm
    from mc2.engine.transport.group_state import group_state

    group = dist.new_group(list(range(world)))
    first = comm.host_max([rank, -rank, 0.5 * rank], group, "test")
    assert comm.host_group(group) is group  # Gloo carries host memory: no group made
    comm.carries_host_memory = lambda g: False  # as a NCCL group
    made_before = len(dist.distributed_c10d._world.pg_names)
    second = comm.host_max([rank, -rank, 0.5 * rank], group, "test")
    host = group_state(group).host
    third = comm.host_max([10 * rank], group, "test")
    return {"first": first, "second": second, "third": third,
            "own_group": host is not None and host is not group,
            "ranks": dist.get_process_group_ranks(host),
            "made": len(dist.distributed_c10d._world.pg_names) - made_before,
            "kept": group_state(group).host is host}


def later_mismatch_without_host_handshake(rank: int, world: int, problem: Problem,
                                          a: dict[str, Any], b: dict[str, Any],
                                          fingerprints: bool) -> dict:
    """:func:`later_mismatch` where the group is taken to carry no host memory (as NCCL's):
    steady capacity calls then run no handshake at all, and only the configuration
    fingerprint in the slabs' headers tells that rank 0 called with other options.
    ``fingerprints=False``: every fingerprint 0 (the check removed)."""
    from mc2.engine.decide import call_plan

    call_plan.carries_host_memory = lambda group: False
    if not fingerprints:
        call_plan.fingerprint_of = lambda values: 0
    return later_mismatch(rank, world, problem, a, b)
