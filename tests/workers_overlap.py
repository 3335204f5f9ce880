"""Rank functions for batch overlap: the same model with and without it, gradients included."""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

from tests.workers_mesh import CONFIG


class OneExpertRouter(MixtralTopKRouter):
    """A hostile router: every token to experts 0 and 1 (both on rank 0), weights from a real
    softmax so gradients still flow; a Mixtral router class, so Hugging Face records its
    logits for the auxiliary loss."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = torch.nn.functional.linear(x, self.weight)
        probs = logits.float().softmax(-1)
        ids = torch.arange(self.top_k, device=x.device).expand(x.shape[0], self.top_k)
        return logits, probs.gather(1, ids).to(x.dtype), ids


QWEN2_MOE = dict(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=24,
                 shared_expert_intermediate_size=20, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                 decoder_sparse_step=1, norm_topk_prob=False, max_position_embeddings=64,
                 experts_implementation="eager")


def _model(dtype: torch.dtype, hostile: bool, kind: str = "Mixtral", aux: bool = True,
           **mc2_options: Any):
    import transformers

    from mc2.integrations.transformers import enable_mc2

    torch.manual_seed(0)
    if kind == "Qwen2Moe":  # a gated shared expert in every block
        config = transformers.Qwen2MoeConfig(**QWEN2_MOE, output_router_logits=True)
        model = transformers.Qwen2MoeForCausalLM(config).to(dtype)
    else:
        config = transformers.MixtralConfig(**CONFIG, output_router_logits=aux,
                                            router_aux_loss_coef=0.02)
        model = transformers.MixtralForCausalLM(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or "gate" in name:
                p.normal_(0, 0.3)
    if hostile:
        for layer in model.model.layers:
            router = OneExpertRouter(config).to(dtype)
            router.load_state_dict(layer.mlp.gate.state_dict())
            layer.mlp.gate = router
    enable_mc2(model, micro_batches=2, **mc2_options)
    return model


def _step(model, ids: torch.Tensor, sync: bool) -> dict[str, Any]:
    import mc2

    gradient_sync = mc2.GradientSync(model) if sync else None
    with mc2.profile() as prof:
        # the default use_cache=True (a prefill's cache too), and padding: the auxiliary loss
        # lines the router logits of every layer up against the mask
        mask = torch.ones_like(ids)
        mask[-1, :3] = 0
        out = model(ids, labels=ids, attention_mask=mask)
        out.loss.backward()
    if gradient_sync is not None:
        gradient_sync.wait()
    backward = sorted((s for s in prof.spans if s.phase == "backward" and s.kind == "compute"
                       and s.name in ("experts", "deferred")), key=lambda s: s.start)
    return {"labels": sorted({s.micro_batch for s in prof.spans}),
            "backward_order": [(s.name, s.micro_batch) for s in backward],
            "logits": out.logits.detach(), "loss": out.loss.detach(),
            "aux": None if out.aux_loss is None else out.aux_loss.detach(),
            "router_logits": [r.detach() for r in out.router_logits or ()],
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None}}


def with_and_without(rank: int, world: int, dtype_name: str, hostile: bool,
                     options: dict[str, Any], stack: dict[str, bool]) -> dict[str, Any]:
    """One step of the same model and batch, without and with batch overlap; ``stack``:
    ``checkpointing`` (Hugging Face's, non-reentrant) and ``sync`` (``mc2.GradientSync``) on
    both."""
    import os

    if stack.get("nodes"):  # ranks per node: a 2-D exchange across emulated nodes
        os.environ["LOCAL_WORLD_SIZE"] = str(world // stack["nodes"])
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, CONFIG["vocab_size"], (4, 12), generator=g)
    kind = stack.get("kind", "Mixtral")
    models = [_model(dtype, hostile, kind, **options),
              _model(dtype, hostile, kind, batch_overlap=True, min_tokens=1, **options)]
    if stack.get("checkpointing"):
        for m in models:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    plain = _step(models[0], ids, stack.get("sync", False))
    model = models[1]
    overlapped = _step(model, ids, stack.get("sync", False))
    return {"plain": plain, "overlapped": overlapped,
            "prefill": [_prefill_and_decode(m, ids) for m in models],
            "chosen": model.model.layers.decision.chosen}


def _prefill_and_decode(model, ids: torch.Tensor) -> dict[str, Any]:
    """A no-grad prefill with a KV cache (split under batch overlap), then one decoding step
    on that cache (never split: one token per sequence): logits and the cache's contents."""
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = out.cache
        keys = [torch.cat([layer.keys, layer.values]) for layer in cache.layers]
        step = model(ids[:, -1:], cache=cache, use_cache=True).logits
        # every layer's hidden states: recorded by hooks on the layers, so not split (said)
        hidden = torch.stack(model(ids, output_hidden_states=True, use_cache=False).hidden_states)
    return {"logits": out.logits, "cache": keys, "decode": step, "hidden": hidden}


def capacity_step_reads(rank: int, world: int) -> dict[str, Any]:
    """The host reads of one training step (forward and backward, after a first one) of a
    capacity-mode model, in-layer and with batch overlap (``True`` and a decided
    ``"auto"``), with where each read was made."""
    from mc2.observation.host_syncs import HostSyncCounter

    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, CONFIG["vocab_size"], (4, 12), generator=g)
    found: dict[str, Any] = {}
    for name, options in (("in-layer", {}), ("batch overlap", {"batch_overlap": True}),
                          ("auto", {"batch_overlap": "auto"})):
        model = _model(torch.float64, False, aux=False, capacity=256, min_tokens=1,
                       **options) if options else _model(torch.float64, False, aux=False,
                                                         capacity=256)
        steps = 1 if name != "auto" else 12  # "auto": 3 timed steps a side, each after a switch
        for _ in range(steps):
            model(ids).logits.sum().backward()
        with HostSyncCounter() as syncs:
            model(ids).logits.sum().backward()
        decision = getattr(model.model.layers, "decision", None)
        found[name] = {"reads": syncs.reads, "where": syncs.where,
                       "chosen": None if decision is None else decision.chosen}
    return found
