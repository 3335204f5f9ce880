"""enable_mc2 on Hugging Face Mixtral / Qwen3-MoE: logits and every gradient equal the
unpatched model's on one process (2 and 4 ranks; float64 tight, float32 within 1e-4)."""

from __future__ import annotations

import pytest
import torch
import transformers  # noqa: E402  (a dev dependency: make test installs it)

import mc2
from tests.workers_hf import build, patched_step

CONFIGS = {
    "Mixtral": dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                    num_experts_per_tok=2, max_position_embeddings=64,
                    experts_implementation="eager"),
    "Qwen3Moe": dict(vocab_size=64, hidden_size=16, intermediate_size=32,
                     moe_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=4, num_experts=8, num_experts_per_tok=2,
                     decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=64,
                     experts_implementation="eager"),
}
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def reference(kind: str, dtype: torch.dtype):
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{kind}Config")(**CONFIGS[kind])
    model = getattr(transformers, f"{kind}ForCausalLM")(cfg).to(dtype)
    with torch.no_grad():  # larger random experts, so routing and experts matter
        for name, p in model.named_parameters():
            if "experts" in name or "gate" in name:
                p.normal_(0, 0.3)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (4, 12), generator=g)
    grad = torch.randn(4, 12, 64, generator=g, dtype=torch.float64).to(dtype)
    ref = build(kind, CONFIGS[kind], state, dtype)
    logits = ref(ids).logits
    (logits * grad).sum().backward()
    return state, ids, grad, logits.detach(), ref


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    scale = want.abs().max().clamp_min(1e-6)
    err = ((got - want).abs().max() / scale).item()
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("kind", ["Mixtral", "Qwen3Moe"])
@pytest.mark.parametrize("world,dtype", [(2, torch.float64), (4, torch.float64),
                                          (2, torch.float32)])
def test_patched_model_equals_unpatched(kind: str, world: int, dtype: torch.dtype) -> None:
    state, ids, grad, logits, ref = reference(kind, dtype)
    results = mc2.run_local(patched_step, world,
                            args=(kind, CONFIGS[kind], state, ids, grad, dtype, 2))
    assert all(r["replaced"] == 2 for r in results)
    close(torch.cat([r["logits"] for r in results]), logits, dtype, "logits")
    ref_params = dict(ref.named_parameters())
    for name in results[0]["replicated"]:
        total = sum(r["replicated"][name] for r in results)
        close(total, ref_params[name].grad, dtype, f"grad {name}")
    for block in results[0]["experts"]:
        gate_up = ref_params[f"{block}.experts.gate_up_proj"].grad  # [E, 2F, H]
        down = ref_params[f"{block}.experts.down_proj"].grad  # [E, H, F]
        for r in results:
            e = r["experts"][block]
            idx = torch.tensor(e["index"])
            close(e["gate_up_proj"], gate_up[idx], dtype, f"{block} gate_up_proj")
            close(e["down_proj"], down[idx], dtype, f"{block} down_proj")


def test_model_without_moe_blocks_is_refused() -> None:
    from mc2.integrations.transformers import enable_mc2

    with pytest.raises(ValueError, match="no sparse-MoE block"):
        enable_mc2(torch.nn.Linear(2, 2))
