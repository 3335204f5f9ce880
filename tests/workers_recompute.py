"""Rank functions for activation checkpointing: plain, full recompute and mc2's policy."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

HIDDEN, FFN, EXPERTS = 16, 24, 4


class Block(nn.Module):
    """A decoder-layer stand-in: a dense mixing step, then an MoE layer, both residual."""

    def __init__(self, **moe: Any) -> None:
        import mc2

        super().__init__()
        self.mix = nn.Linear(HIDDEN, HIDDEN, dtype=torch.float64)
        self.moe = mc2.MoELayer(HIDDEN, FFN, EXPERTS, topk=2, shared_experts=1,
                                dtype=torch.float64, **moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.mix(x))
        out = x + self.moe(x)
        # an aten.max after the call: a policy that saves aten.max must save this one (the
        # call's own, inside it, are not the region's)
        return out / (1 + out.abs().max())


class CollectiveCounter:
    """Counts the collectives mc2 issues (its comm layer calls these three)."""

    NAMES = ("all_to_all_single", "all_reduce", "all_gather")

    def __init__(self) -> None:
        import torch.distributed as dist

        self.count = 0
        self._dist, self._saved = dist, {n: getattr(dist, n) for n in self.NAMES}
        for name, fn in self._saved.items():
            setattr(dist, name, self._counting(fn))

    def _counting(self, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return fn(*args, **kwargs)
        return wrapper

    def close(self) -> None:
        for name, fn in self._saved.items():
            setattr(self._dist, name, fn)


def _run(mode: str, x: torch.Tensor, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    import mc2
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    torch.manual_seed(0)
    mode, dedup = mode.removesuffix("+dedup"), mode.endswith("+dedup")
    blocks = nn.ModuleList(Block(micro_batches=2, dedup=dedup) for _ in range(2))
    for i, b in enumerate(blocks):
        mc2.load_full_state_dict(b.moe, {k.removeprefix(f"{i}.moe."): v for k, v in state.items()
                                         if k.startswith(f"{i}.moe.")})
        b.mix.load_state_dict({"weight": state[f"{i}.mix.weight"],
                               "bias": state[f"{i}.mix.bias"]})
    h = x.clone().requires_grad_(True)
    packed_shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed_shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = h
        for b in blocks:
            if mode == "none":
                out = b(out)
            elif mode == "full":
                out = checkpoint(b, out, use_reentrant=False)
            else:
                also = (torch.ops.aten.max.default,) if mode == "selective_max" else ()
                context = partial(create_selective_checkpoint_contexts,
                                  mc2.checkpoint_policy(*also))
                out = checkpoint(b, out, use_reentrant=False, context_fn=context)
    loss = out.pow(2).mean()
    counter = CollectiveCounter()
    try:
        loss.backward()
    finally:
        counter.close()
    grads = {n: p.grad.clone() for n, p in blocks.named_parameters()}
    return {"out": out.detach(), "x_grad": h.grad, "grads": grads,
            "backward_collectives": counter.count,
            "gate_up_packed": any(len(s) == 2 and s[-1] == 2 * FFN for s in packed_shapes)}


def checkpointing_modes(rank: int, world: int, x: torch.Tensor, state: dict[str, torch.Tensor]
                        ) -> dict[str, Any]:
    """The same two blocks without checkpointing, with full recompute and with mc2's policy."""
    mine = x.chunk(world)[rank]
    return {mode: _run(mode, mine, state)
            for mode in ("none", "full", "selective", "selective_max", "full+dedup",
                         "selective+dedup")}


def full_state(seed: int = 3) -> dict[str, torch.Tensor]:
    """The two blocks' state with all experts, made in one process."""
    torch.manual_seed(seed)
    blocks = nn.ModuleList(Block() for _ in range(2))
    for b in blocks:
        b.moe.reset_parameters(std=0.3)
        nn.init.normal_(b.moe.gate.weight, std=0.5)
    return {k: v.clone() for k, v in blocks.state_dict().items()}
