"""Rank functions for the adapter tests: PEFT's LoRA (and a quantised-layer stand-in) on the
parts of a tiny Hugging Face model that mc2 reads as weights, added before or after
``enable_mc2`` (import transformers and peft lazily)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

LR = 0.05
STEPS = 5


class ScaledLinear(nn.Linear):
    """A stand-in for a quantised linear (transformers' ``FP8Linear`` is an ``nn.Linear``
    whose forward dequantises): its forward computes more than ``x @ weight.T``."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * 1.5


def lora_config(**changes: Any) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **changes)


def _fill(model: nn.Module) -> None:
    """The same nonzero A and B for every expert, whatever the number of experts the adapter
    sees (all of them before ``enable_mc2``, this rank's after): equal adapters on both sides."""
    from peft.tuners.lora.layer import ParamWrapper

    with torch.no_grad():
        for m in model.modules():
            experts = m.num_experts if isinstance(m, ParamWrapper) else 1
            for side in ("lora_A", "lora_B"):
                table = getattr(m, side, None)
                if not isinstance(table, nn.ModuleDict) or "default" not in table:
                    continue
                w = table["default"].weight
                if side == "lora_A":  # [r * E, in]: expert-major blocks of [r, in]
                    r = w.shape[0] // experts
                    w.copy_(torch.linspace(-0.5, 0.5, r * w.shape[1]).reshape(r, -1)
                            .repeat(experts, 1))
                else:  # [out, r * E] viewed [out, r, E]
                    r = w.shape[1] // experts
                    w.copy_(torch.linspace(-0.4, 0.6, w.shape[0] * r).reshape(w.shape[0], r, 1)
                            .expand(-1, -1, experts).reshape(w.shape[0], -1))


def adapt(model: nn.Module, case: str) -> nn.Module:
    """``model`` (a tiny model, or one under ``enable_mc2``) with the adapter of ``case``:

    - ``shared``: PEFT LoRA on the shared MLP's three projections (Qwen2-MoE through
      ``get_peft_model``; DeepSeek-V3 and GLM-4-MoE by PEFT's own ``lora.Linear`` put in place,
      since ``get_peft_model`` turns their projection names into the routed experts' tensors);
    - ``routed``: PEFT LoRA on the routed experts' tensors (``target_parameters``);
    - ``scaled``: the shared MLP's up projection swapped for :class:`ScaledLinear`.
    Returns the model to run (PEFT's wrapper for ``get_peft_model``)."""
    from peft import get_peft_model
    from peft.tuners.lora.layer import Linear as LoraLinear

    if case == "routed":
        model = get_peft_model(model, lora_config(
            target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
    elif case == "shared" and getattr(model.config, "model_type", "") == "qwen2_moe":
        model = get_peft_model(model, lora_config(
            target_modules=r".*shared_expert\.(gate|up|down)_proj"))
    else:
        for name, mlp in list(model.named_modules()):
            if not name.endswith(("shared_experts", "shared_expert")):
                continue
            for proj in ("gate_proj", "up_proj", "down_proj"):
                base = getattr(mlp, proj)
                if case == "scaled":
                    if proj == "up_proj":
                        swapped = ScaledLinear(base.in_features, base.out_features, bias=False)
                        swapped = swapped.to(base.weight.dtype)
                        with torch.no_grad():
                            swapped.weight.copy_(base.weight)
                        mlp.up_proj = swapped
                else:
                    setattr(mlp, proj, LoraLinear(base, "default", lora_config(), r=4,
                                                  lora_alpha=8, init_lora_weights=False))
        for n, p in model.named_parameters():  # trained: the adapters, or the stand-in
            p.requires_grad_("lora_" in n or (case == "scaled" and "up_proj" in n
                                              and "shared" in n))
    _fill(model)
    return model


def adapters(model: nn.Module) -> dict[str, Tensor]:
    """The trained tensors (the adapters; PEFT freezes the rest) by name, without PEFT's
    prefix: both sides alike."""
    return {n.replace("base_model.model.", ""): p for n, p in model.named_parameters()
            if p.requires_grad}


def inner(model: nn.Module) -> nn.Module:
    """The transformers model under PEFT's wrapper, if any."""
    return model.base_model.model if hasattr(model, "base_model") and hasattr(
        model.base_model, "model") else model


def step_adapters(rank: int, world: int, cases: list[tuple[str, str, str]], ids: Tensor,
                  grad: Tensor) -> list[Any]:
    """Per case ``(model_type, adapter case, "before" | "after")``: this rank's logits and
    adapter gradients of one step, and the adapter tensors after :data:`STEPS` SGD steps
    (replicated adapters' gradients summed over the ranks); or the error it raised."""
    from mc2.integrations.transformers import enable_mc2
    from tests.hf_tiny import tiny_model

    out: list[Any] = []
    mine, g = ids.chunk(world)[rank], grad.chunk(world)[rank]
    for model_type, case, order in cases:
        model = tiny_model(model_type).double()
        try:
            if order == "before":
                model = adapt(model, case)
                enable_mc2(inner(model))
            else:
                enable_mc2(model)
                model = adapt(model, case)
            out.append(train(model, mine, g, summed=_summed_replicated))
        except ValueError as exc:
            out.append(f"ValueError: {exc}")
    return out


def reference(model_type: str, case: str, ids: Tensor, grad: Tensor) -> dict[str, Any]:
    """The unpatched model with the same adapter on one process: the first step's logits and
    adapter gradients, and the adapters after :data:`STEPS` SGD steps."""
    from tests.hf_tiny import tiny_model

    return train(adapt(tiny_model(model_type).double(), case), ids, grad)


def train(model: nn.Module, ids: Tensor, grad: Tensor, summed: Any = None) -> dict[str, Any]:
    """:data:`STEPS` SGD steps of ``(logits * grad).sum()`` on the trained tensors
    (``summed(params)``: makes each gradient the whole batch's, on a rank); the first step's
    logits and gradients, and the tensors after the steps."""
    first: dict[str, Any] = {}
    for i in range(STEPS):
        logits = model(ids).logits
        (logits * grad).sum().backward()
        params = adapters(model)
        if summed is not None:
            summed(params)
        if i == 0:
            first = {"logits": logits.detach(),
                     "grads": {n: p.grad.clone() for n, p in params.items()}}
        with torch.no_grad():
            for p in params.values():
                p -= LR * p.grad
                p.grad = None
    first["trained"] = {n: p.detach().clone() for n, p in adapters(model).items()}
    return first


def _summed_replicated(params: dict[str, Tensor]) -> None:
    """A replicated tensor's gradient summed over the ranks (each saw its share of the
    batch); an expert's is already whole (its rows came from every rank)."""
    import torch.distributed as dist

    for name, p in params.items():
        if ".experts." not in name:
            dist.all_reduce(p.grad)


def ep_step(rank: int, world: int, paths: dict[str, str], cases: list[tuple[str, str]],
            ids: Tensor) -> list[Any]:
    """Per case ``(model_type, adapter case)``: the model loaded with Hugging Face's expert
    parallelism and ``ep_implementation="mc2"`` (ranks holding different batches), the
    adapter added, this rank's logits and whether every adapter got a gradient; or the error."""
    import os

    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import mc2.integrations.hf_expert_parallel  # noqa: F401 - registers "mc2"

    os.environ.setdefault("LOCAL_RANK", str(rank))
    out: list[Any] = []
    for model_type, case in cases:
        model = AutoModelForCausalLM.from_pretrained(
            paths[model_type], dtype=torch.float32, distributed_config=DistributedConfig(
                ep_size=world, fsdp_size=world, ep_implementation="mc2"))
        model.eval()
        model = adapt(model, case)
        try:
            logits = model(ids.chunk(world)[rank]).logits
            logits.square().mean().backward()
            out.append({"logits": logits.detach(), "adapter_grads": all(
                p.grad is not None for p in adapters(model).values())})
        except ValueError as exc:
            out.append(f"ValueError: {exc}")
    return out


def ep_reference(model_type: str, case: str, ids: Tensor) -> tuple[str, Tensor]:
    """The tiny model saved (its path), and its logits with the adapter of ``case``."""
    import tempfile

    from tests.hf_tiny import tiny_model

    model = tiny_model(model_type)
    path = tempfile.mkdtemp(prefix=f"mc2-adapter-{model_type}-")
    model.save_pretrained(path)
    with torch.no_grad():
        return path, adapt(model, case)(ids).logits
