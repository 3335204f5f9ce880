"""Deterministic MoE problems for multi-rank tests, including hostile routings."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ROUTINGS = ("uniform", "one_expert", "rank_receives_nothing", "zero_tokens", "uneven")
# more hostile to rows sent once per destination: every token's experts on one (random) rank,
# and no token's experts on its own rank
DEDUP_ROUTINGS = ROUTINGS + ("same_rank", "none_local")


@dataclass
class Problem:
    """A global problem: per-rank tokens and routes, all experts' weights."""

    xs: list[Tensor]  # per rank [T_r, H]
    ids: list[Tensor]  # per rank [T_r, k]
    rws: list[Tensor]  # per rank [T_r, k]
    grad_outs: list[Tensor]  # per rank [T_r, H]
    w_up: Tensor  # [E, H, F]
    w_gate: Tensor
    w_down: Tensor  # [E, F, H]
    world: int

    @property
    def local_experts(self) -> int:
        return self.w_up.shape[0] // self.world

    def local_weights(self, rank: int) -> tuple[Tensor, Tensor, Tensor]:
        sl = slice(rank * self.local_experts, (rank + 1) * self.local_experts)
        return self.w_up[sl], self.w_gate[sl], self.w_down[sl]


def make_problem(world: int, routing: str, *, topk: int = 2, hidden: int = 16, ffn: int = 24,
                 local_experts: int = 2, tokens: int = 13, dtype=torch.float64,
                 seed: int = 0) -> Problem:
    if routing not in DEDUP_ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}")
    g = torch.Generator().manual_seed(seed)
    experts = world * local_experts
    counts = [tokens + 3 * r for r in range(world)]
    if routing == "zero_tokens":
        counts[1 % world] = 0
    if routing == "uneven":
        counts = [int(torch.randint(0, 3 * tokens, (1,), generator=g)) for _ in range(world)]
        counts[0] = max(counts[0], 1)
    xs, ids, rws, gouts = [], [], [], []
    for rank, n in enumerate(counts):
        xs.append(torch.randn(n, hidden, generator=g, dtype=torch.float64).to(dtype))
        if routing == "one_expert":
            chosen = torch.arange(topk).repeat(n, 1) % experts  # experts 0..k-1, on rank 0
        elif routing == "rank_receives_nothing":
            allowed = experts - local_experts  # the last rank's experts are never chosen
            chosen = torch.stack([torch.randperm(allowed, generator=g)[:topk] for _ in range(n)]) \
                if n else torch.empty(0, topk, dtype=torch.int64)
        elif routing in ("same_rank", "none_local") and n:
            others = [r for r in range(world) if routing == "same_rank" or r != rank or world == 1]
            picks = []
            for _ in range(n):
                home = others[int(torch.randint(0, len(others), (1,), generator=g))]
                if routing == "same_rank":  # all k on one rank (repeats when k > local)
                    local = torch.randperm(local_experts, generator=g).repeat(topk)[:topk]
                    picks.append(home * local_experts + local)
                else:
                    pool = torch.tensor([e for e in range(experts)
                                         if e // local_experts != rank or world == 1])
                    picks.append(pool[torch.randperm(len(pool), generator=g)[:topk]])
            chosen = torch.stack(picks)
        elif routing in ("same_rank", "none_local"):
            chosen = torch.empty(0, topk, dtype=torch.int64)
        elif routing == "uneven":
            probs = torch.linspace(1.0, 0.05, experts) ** 3
            chosen = torch.multinomial(probs.expand(max(n, 1), -1), topk, generator=g)[:n]
        else:
            chosen = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(n)]) \
                if n else torch.empty(0, topk, dtype=torch.int64)
        ids.append(chosen.to(torch.int64))
        rws.append(torch.rand(n, topk, generator=g, dtype=torch.float64).to(dtype))
        gouts.append(torch.randn(n, hidden, generator=g, dtype=torch.float64).to(dtype))
    scale = hidden ** -0.5
    w_up = (torch.randn(experts, hidden, ffn, generator=g, dtype=torch.float64) * scale).to(dtype)
    w_gate = (torch.randn(experts, hidden, ffn, generator=g, dtype=torch.float64) * scale).to(dtype)
    w_down = (torch.randn(experts, ffn, hidden, generator=g, dtype=torch.float64) * ffn ** -0.5
              ).to(dtype)
    return Problem(xs, ids, rws, gouts, w_up, w_gate, w_down, world)
