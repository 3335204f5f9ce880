"""Tiny Hugging Face MoE models of every architecture that carries an expert-parallel plan.

transformers names how to shard a model's experts in its config's ``base_model_ep_plan``; the
architectures whose plan has an ``ep_dispatch_experts`` rule are the ones whose tokens reach
their experts through ``EPImplementationInterface`` (and so through ``"mc2"``). This module
finds them and builds each one small enough to check on a laptop: the architecture's own
config with its sizes shrunk (by attribute name, so one table serves every architecture: a
name an architecture does not have is skipped), its experts four per layer, top-2, every layer
a MoE layer where the architecture lets it.
"""

from __future__ import annotations

import inspect
from typing import Any

# sizes by attribute name; an architecture takes the ones its config has
SMALL: dict[str, Any] = dict(
    vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
    shared_expert_intermediate_size=16, expert_ffn_hidden_size=16, ffn_hidden_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    max_position_embeddings=64, max_window_layers=2,
    # experts: four of them, top-2, every layer
    num_local_experts=4, num_experts=4, n_routed_experts=4, moe_num_experts=4,
    num_experts_per_tok=2, moe_k=2, moe_topk=2, n_group=1, topk_group=1,
    first_k_dense_replace=0, decoder_sparse_step=1, moe_layer_freq=1, mlp_only_layers=[],
    n_shared_experts=1, num_shared_experts=1, moe_num_shared_experts=1,
    # multi-head latent attention
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    qk_head_dim=16, index_head_dim=8, index_n_heads=2, index_topk=8,
    # state-space and linear-attention layers of the hybrids
    mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False,
    mamba_num_heads=4, mamba_head_dim=16, mamba_n_heads=4, mamba_d_head=16, ssm_state_size=8,
    n_groups=1, mamba_n_groups=1,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, attn_layer_period=2,
    attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0,
    sliding_window=16, rope_theta=10000.0,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
# what a few architectures need beyond names: patterns that say which layer is which
EXTRA: dict[str, dict[str, Any]] = {
    "nemotron_h": dict(num_hidden_layers=3, hybrid_override_pattern="M*E"),
    "granitemoehybrid": dict(layers_block_type=["mamba", "attention"]),
    "lfm2_moe": dict(num_dense_layers=0, layer_types=["conv", "full_attention"]),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_moe_text": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen4_exp_text": dict(layer_types=["linear_attention", "full_attention"]),
    "dots3_note_text": dict(num_key_value_heads=4),
    "glm5_next_text": dict(num_key_value_heads=4),
    "zaya": dict(num_experts_per_tok=1),
    "gemma4_text": dict(enable_moe_block=True, top_k_experts=2),
    "beam": dict(mlp_layer_types=["sparse", "sparse"]),
    "deepseek_v4": dict(mlp_layer_types=["hash_moe", "moe"]),
}


def ep_architectures() -> list[str]:
    """Every model type whose config's ``base_model_ep_plan`` has an ``ep_dispatch_experts``
    rule, sorted."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    found = []
    for model_type in CONFIG_MAPPING.keys():
        try:
            plan = getattr(CONFIG_MAPPING[model_type], "base_model_ep_plan", None) or {}
        except Exception:  # noqa: BLE001 - an architecture whose module does not import
            continue
        if "ep_dispatch_experts" in plan.values():
            found.append(model_type)
    return sorted(found)


def tiny_config(model_type: str, **changes: Any) -> Any:
    """``model_type``'s config with :data:`SMALL`'s sizes (those it has), :data:`EXTRA`'s and
    ``changes``, float32 eager attention and eager experts."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    names = set(vars(default)) | set(inspect.signature(cls).parameters)
    values = {k: v for k, v in SMALL.items() if k in names}
    if "kv_lora_rank" in names:  # latent attention: every head has its own key and value
        values["num_key_value_heads"] = values["num_attention_heads"]
    values |= EXTRA.get(model_type, {}) | changes
    if "layer_types" in names and "layer_types" not in values:
        values["layer_types"] = None  # derived again from the shrunk sizes
    config = AutoConfig.for_model(model_type, **values)
    config._attn_implementation = "eager"
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"
    return config


def tiny_model(model_type: str, seed: int = 0, **changes: Any) -> Any:
    """A float32 causal LM of ``model_type`` (the base model where the architecture has no
    causal LM head), weights drawn from ``seed``; experts, routers and shared experts drawn
    larger so that routing and experts matter."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    config = tiny_config(model_type, **changes)
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config)
    except ValueError:  # no causal LM head registered for this configuration
        model = AutoModel.from_config(config)
    model = model.float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(part in name for part in ("experts", "gate", "router", "shared")):
                p.normal_(0, 0.3)
        for name, table in model.named_buffers():
            if name.endswith("tid2eid"):  # hash routing: distinct experts per token id
                experts = int(table.max()) + 1 if table.numel() else 0
                experts = max(experts, getattr(config, "n_routed_experts", None)
                              or getattr(config, "num_local_experts", None) or 4)
                table.copy_(torch.stack([torch.randperm(experts)[:table.shape[1]]
                                         for _ in range(table.shape[0])]))
    return model.eval()
