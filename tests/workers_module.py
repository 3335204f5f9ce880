"""Rank functions for the module-stage tests: an experts module that is not mc2's SwiGLU."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from tests.problems import Problem


class BiasedGeluExperts(nn.Module):
    """Experts with biases, GELU and a clamp (like gpt-oss's): nothing mc2's SwiGLU computes.
    Hugging Face's experts signature: ``forward(rows, local_ids [R, 1], weights [R, 1])``."""

    def __init__(self, up: Tensor, down: Tensor, bias: Tensor) -> None:
        super().__init__()
        self.num_experts = up.shape[0]
        self.up, self.down, self.bias = nn.Parameter(up), nn.Parameter(down), nn.Parameter(bias)

    def forward(self, rows: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        out = torch.zeros_like(rows)
        for e in range(self.num_experts):
            pick = ids[:, 0] == e
            h = torch.nn.functional.gelu(rows[pick] @ self.up[e]).clamp(max=1.5)
            out[pick] = (h @ self.down[e] + self.bias[e]) * weights[pick]
        return out


def experts_of(problem: Problem, rank: int | None = None) -> BiasedGeluExperts:
    """All experts (``rank=None``) or one rank's, from the problem's up/down weights and a
    bias drawn from them."""
    L = problem.local_experts
    sl = slice(None) if rank is None else slice(rank * L, (rank + 1) * L)
    bias = problem.w_down.sum(1)[sl] * 0.1
    return BiasedGeluExperts(problem.w_up[sl].clone(), problem.w_down[sl].clone(), bias.clone())


def dense(problem: Problem) -> dict[str, Any]:
    """The unsharded reference: every rank's tokens through all experts on one process."""
    experts = experts_of(problem)
    outs, grads_x, grads_rw = [], [], []
    for x, ids, rw, g in zip(problem.xs, problem.ids, problem.rws, problem.grad_outs):
        x, rw = x.clone().requires_grad_(), rw.clone().requires_grad_()
        out = sum(rw[:, j:j + 1] * experts(x, ids[:, j:j + 1], torch.ones_like(rw[:, :1]))
                  for j in range(ids.shape[1])) if x.shape[0] else x * 0
        (out * g).sum().backward()
        outs.append(out.detach())
        grads_x.append(x.grad if x.grad is not None else torch.zeros_like(x))
        grads_rw.append(rw.grad if rw.grad is not None else torch.zeros_like(rw))
    return {"out": outs, "grad_x": grads_x, "grad_rw": grads_rw,
            "params": {n: p.grad for n, p in experts.named_parameters()}}


def module_step(rank: int, world: int, problems: list[Problem], ks: list[int]) -> list[dict]:
    """Each problem at each K: this rank's output and gradients through fused_expert_module."""
    import mc2

    results = []
    for problem in problems:
        for k in ks:  # K, or (K, dedup)
            k, dedup = (k, False) if isinstance(k, int) else k
            experts = experts_of(problem, rank)
            x = problem.xs[rank].clone().requires_grad_()
            rw = problem.rws[rank].clone().requires_grad_()
            out = mc2.fused_expert_module(x, experts, problem.ids[rank], rw, micro_batches=k,
                                          dedup=dedup)
            (out * problem.grad_outs[rank]).sum().backward()
            results.append({"out": out.detach(), "grad_x": x.grad, "grad_rw": rw.grad,
                            "params": {n: p.grad for n, p in experts.named_parameters()}})
    return results


def enable_step(rank: int, world: int, model_type: str, ids: Tensor, grad: Tensor) -> dict:
    """enable_mc2 on a tiny Hugging Face model whose blocks mc2's SwiGLU does not compute:
    this rank's logits and gradients (experts by global index)."""
    from mc2.integrations.module_stage import ModuleStageExperts, SharedInsideBlock
    from mc2.integrations.transformers import enable_mc2
    from tests.hf_tiny import tiny_model

    model = tiny_model(model_type)
    replaced = enable_mc2(model)
    staged = {n: m for n, m in model.named_modules() if isinstance(m, ModuleStageExperts)}
    logits = model(ids.chunk(world)[rank]).logits
    (logits * grad.chunk(world)[rank]).sum().backward()
    experts = {f"{n}.{p}": (m.first_expert, param.grad)
               for n, m in staged.items() for p, param in m.mc2_expert_parameters().items()}
    replicated = {n: p.grad for n, p in model.named_parameters()
                  if p.grad is not None and not any(n.startswith(s + ".") for s in staged)}
    return {"logits": logits.detach(), "experts": experts, "replicated": replicated,
            "replaced": replaced, "staged": len(staged),
            "shared_inside": sum(isinstance(m, SharedInsideBlock) for m in model.modules())}
