"""Rank functions for graph capture: torch.compile and torch.export of an mc2-enabled model."""

from __future__ import annotations

from typing import Any

import torch

from tests.workers_mesh import batches, unpatched_model


class _Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, use_cache=False).logits


def compile_and_export(rank: int, world: int, save_to: str | None = None) -> dict[str, Any]:
    """Eager, then ``torch.compile(fullgraph=True)`` (forward and backward), then
    ``torch.export`` of the same enable_mc2 Mixtral; what differs, and the graph breaks.
    Rank 0 saves the exported program to ``save_to`` (``torch.export.save``)."""
    import mc2
    from mc2.integrations.transformers import enable_mc2

    mesh = mc2.expert_parallel_mesh(world, num_experts=8)
    model = unpatched_model()
    enable_mc2(model, mesh=mesh, micro_batches=2)
    ids = batches(1, world)[0, rank]
    eager = model(ids, labels=ids)
    eager.loss.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    explained = torch._dynamo.explain(model)(ids, labels=ids)
    compiled = torch.compile(model, fullgraph=True)(ids, labels=ids)
    compiled.loss.backward()
    grad_diff = max(float((p.grad - eager_grads[n]).abs().max() / eager_grads[n].abs().max())
                    for n, p in model.named_parameters())
    with torch.no_grad():  # the logits alone: a loader needs no transformers output types
        exported = torch.export.export(_Logits(model), (ids,))
        exported_logits = exported.module()(ids)
        eager_logits = model(ids, use_cache=False).logits
    calls = [n for n in exported.graph.nodes if "mc2.fused_expert" in str(n.target)]
    if save_to is not None and rank == 0:
        torch.export.save(exported, save_to)
    return {"graphs": explained.graph_count, "breaks": explained.graph_break_count,
            "loss_diff": float((compiled.loss - eager.loss).abs()),
            "logits_diff": float((compiled.logits - eager.logits).abs().max()),
            "grad_rel_diff": grad_diff,
            "export_diff": float((exported_logits - eager_logits).abs().max()),
            "exported_calls": len(calls)}
