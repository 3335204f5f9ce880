"""Rank functions for Hugging Face's expert parallelism under ep_implementation="mc2"."""

from __future__ import annotations

import os

import torch


def stack_step(rank: int, world: int, path: str, out: str, ids: torch.Tensor,
               prompt: torch.Tensor) -> dict:
    """Gradient checkpointing, generate and save_pretrained with mc2 as the EP implementation
    (ranks holding different batches, FSDP over them)."""
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import mc2.integrations.hf_expert_parallel  # noqa: F401

    os.environ.setdefault("LOCAL_RANK", str(rank))
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, distributed_config=DistributedConfig(
            ep_size=world, fsdp_size=world, ep_implementation="mc2"))
    model.eval()
    model.gradient_checkpointing_enable()
    model.train()
    for m in model.modules():  # train mode for checkpointing, no dropout (there is none)
        m.training = True
    mine = ids.chunk(world)[rank]
    loss = model(mine, labels=mine).loss
    loss.backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    generated = model.generate(prompt.chunk(world)[rank], max_new_tokens=3, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
    model.save_pretrained(out)
    ran = sorted({m.mc2_expert_parallel.last_choice for m in model.modules()
                  if hasattr(m, "mc2_expert_parallel")})
    return {"loss": loss.detach(), "grads": grads if rank == 0 else None,
            "generated": generated, "ran": ran}


def counted_step(rank: int, world: int, path: str, ids: torch.Tensor) -> dict:
    """One training step (forward, loss, backward) of a model loaded with
    ``ep_implementation="mc2"``, ranks holding different batches: the host reads of each mc2
    call and of the whole backward (:func:`tests.call_counting.counted_calls`)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import mc2.integrations.hf_expert_parallel as hf_ep
    from tests.call_counting import counted_calls

    os.environ.setdefault("LOCAL_RANK", str(rank))
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, distributed_config=DistributedConfig(
            ep_size=world, fsdp_size=world, ep_implementation="mc2"))
    mine = ids.chunk(world)[rank]
    model(mine, labels=mine).loss.backward()  # warm: groups made, planner settled
    model.zero_grad()
    with counted_calls(hf_ep) as seen:
        model(mine, labels=mine).loss.backward()
    ran = sorted({m.mc2_expert_parallel.last_choice for m in model.modules()
                  if hasattr(m, "mc2_expert_parallel")})
    return {**seen, "ran": ran, "layers": model.config.num_hidden_layers}
