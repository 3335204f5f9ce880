"""Rank functions for a recompute whose weights another call of another shape shares
(``tests/test_recompute_shapes.py``)."""

from __future__ import annotations

from typing import Any, Callable

import torch

TOKENS = {"long": 24, "short": 8}  # per rank: two shapes of the planner's (token buckets)


def _inputs(rank: int, tokens: int, experts: int, hidden: int, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 10 * rank)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g, dtype=torch.float64)
    grad = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    return x, ids, weights, grad


def _step(rank: int, world: int, checkpointed: bool) -> dict[str, Any]:
    """Two warm-up calls of the long shape, then a step of both shapes over the same experts,
    each call checkpointed (full, non-reentrant) or not.

    A planner trying K in (1, 3), one timed trial each: the warm-up is the long shape's K = 1
    trial (its settling call, then its timed one), so the step's long call runs K = 3 (a
    settling trial) and the short call (a new shape) K = 1, the later of the two forwards."""
    import mc2
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    hidden, ffn, local = 16, 24, 2
    experts = [(torch.randn(local, *shape, dtype=torch.float64) * 0.3).requires_grad_(True)
               for shape in ((hidden, ffn), (hidden, ffn), (ffn, hidden))]
    from tests.workers import PriorPlanner

    planner = PriorPlanner([1, 3], candidates=(1, 3), explore=2, trials=1)
    timelines = {name: mc2.Timeline() for name in TOKENS}

    def call(name: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            return mc2.fused_expert(x, *experts, ids, weights, micro_batches="auto",
                                    planner=planner, timeline=timelines[name])
        return run

    warm = _inputs(rank, TOKENS["long"], world * local, hidden, seed=1)
    for _ in range(2):
        call("long")(*warm[:3]).backward(warm[3])
    for timeline in timelines.values():
        timeline.clear()
    for w in experts:
        w.grad = None
    result: dict[str, Any] = {}
    loss = torch.zeros((), dtype=torch.float64)
    for name, tokens in TOKENS.items():
        x, ids, weights, grad = _inputs(rank, tokens, world * local, hidden, seed=2)
        x.requires_grad_(True)
        out = checkpoint(call(name), x, ids, weights, use_reentrant=False) if checkpointed \
            else call(name)(x, ids, weights)
        loss = loss + (out * grad).sum()
        result[name] = {"x": x, "out": out.detach()}
    loss.backward()
    for name in TOKENS:
        x = result[name].pop("x")
        result[name]["x_grad"] = x.grad
        # each forward (and recompute) files its experts' spans by micro-batch
        result[name]["forward_experts"] = sorted(
            s.micro_batch for s in timelines[name].spans
            if s.kind == "compute" and s.name == "experts" and s.phase == "forward")
    result["expert_grads"] = [w.grad for w in experts]
    return result


def two_shapes_over_shared_experts(rank: int, world: int) -> dict[str, Any]:
    """The step without and with checkpointing."""
    return {"plain": _step(rank, world, False), "checkpointed": _step(rank, world, True)}
