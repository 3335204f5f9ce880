"""Rank functions for the Hugging Face integration tests (import transformers lazily)."""

from __future__ import annotations

from typing import Any

import torch


def build(kind: str, config: dict[str, Any], state: dict, dtype: torch.dtype):
    import transformers

    cfg = getattr(transformers, f"{kind}Config")(**config)
    model = getattr(transformers, f"{kind}ForCausalLM")(cfg).to(dtype)
    model.load_state_dict(state)
    return model


def patched_step(rank: int, world: int, kind: str, config: dict, state: dict,
                 input_ids: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype,
                 micro_batches: int | str, checkpointing: bool = False) -> dict:
    from mc2.integrations.transformers import MC2SparseMoeBlock, enable_mc2

    model = build(kind, config, state, dtype)
    replaced = enable_mc2(model, micro_batches=micro_batches)
    if checkpointing:  # full activation checkpointing: the recompute runs the call again
        model.train()
        model.gradient_checkpointing_enable()
    ids = input_ids.chunk(world)[rank]
    logits = model(ids).logits
    (logits * grad.chunk(world)[rank]).sum().backward()
    experts = {}
    for name, m in model.named_modules():
        if isinstance(m, MC2SparseMoeBlock):
            experts[name] = {"index": m.expert_index.tolist(), "gate_up_proj": m.experts.gate_up_proj.grad,
                             "down_proj": m.experts.down_proj.grad}
    replicated = {n: p.grad for n, p in model.named_parameters()
                  if p.grad is not None and ".experts." not in n}
    return {"logits": logits.detach(), "experts": experts, "replicated": replicated,
            "replaced": replaced}


def meta_init_state(rank: int, world: int, kind: str, config: dict, input_ids: torch.Tensor,
                    seed: int) -> dict:
    """Build on the meta device, enable_mc2, ``to_empty`` and ``init_weights()`` (seeded alike on
    every rank), then run this rank's tokens: the state, expert indices and logits."""
    import transformers

    from mc2.integrations.transformers import MC2SparseMoeBlock, enable_mc2

    cfg = getattr(transformers, f"{kind}Config")(**config)
    with torch.device("meta"):
        model = getattr(transformers, f"{kind}ForCausalLM")(cfg)
    enable_mc2(model)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    index = {name: m.expert_index.tolist() for name, m in model.named_modules()
             if isinstance(m, MC2SparseMoeBlock)}
    with torch.no_grad():
        logits = model(input_ids.chunk(world)[rank]).logits
    return {"state": {k: v.clone() for k, v in model.state_dict().items()}, "index": index,
            "logits": logits}
