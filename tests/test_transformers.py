"""enable_mc2 on Hugging Face Mixtral / Qwen3-MoE / Qwen2-MoE (gated shared expert): logits and
every gradient equal the unpatched model's on one process (2 and 4 ranks; float64 tight, float32
within 1e-4); meta-device initialisation; set_experts_implementation; blocks with parts the
adapter does not know are refused, never replaced without them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers  # noqa: E402  (a dev dependency: make test installs it)

import mc2
from mc2.integrations.transformers import MC2SparseMoeBlock, enable_mc2
from tests.workers_hf import build, meta_init_state, patched_step

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
    "Qwen2Moe": dict(vocab_size=64, hidden_size=16, intermediate_size=32,
                     moe_intermediate_size=24, shared_expert_intermediate_size=20,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                     norm_topk_prob=False, max_position_embeddings=64,
                     experts_implementation="eager"),
}
CASES = [(kind, world, dtype) for kind in ("Mixtral", "Qwen3Moe")
         for world, dtype in [(2, torch.float64), (4, torch.float64), (2, torch.float32)]] + \
    [("Qwen2Moe", 2, torch.float64)]
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def reference(kind: str, dtype: torch.dtype, **changes: Any):
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{kind}Config")(**(CONFIGS[kind] | changes))
    model = getattr(transformers, f"{kind}ForCausalLM")(cfg).to(dtype)
    with torch.no_grad():  # larger random experts, so routing and experts matter
        for name, p in model.named_parameters():
            if "experts" in name or "gate" in name or "shared" in name:
                p.normal_(0, 0.3)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (4, 12), generator=g)
    grad = torch.randn(4, 12, 64, generator=g, dtype=torch.float64).to(dtype)
    ref = build(kind, CONFIGS[kind] | changes, state, dtype)
    logits = ref(ids).logits
    (logits * grad).sum().backward()
    return state, ids, grad, logits.detach(), ref


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    scale = want.abs().max().clamp_min(1e-6)
    err = ((got - want).abs().max() / scale).item()
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("kind,world,dtype", CASES)
def test_patched_model_equals_unpatched(kind: str, world: int, dtype: torch.dtype) -> None:
    _check_patched(kind, world, dtype, micro_batches=2, checkpointing=False)


def test_full_checkpointing_with_the_default_config() -> None:
    """Gradient checkpointing on, ``micro_batches="auto"`` (the default) while its trials
    run: each recompute runs the K its forward ran (a call in a backward counts no trial),
    where PyTorch raised ``CheckpointError`` on the saved shapes before."""
    _check_patched("Mixtral", 2, torch.float64, micro_batches="auto", checkpointing=True,
                   num_hidden_layers=3)


def _check_patched(kind: str, world: int, dtype: torch.dtype, *, micro_batches: int | str,
                   checkpointing: bool, **changes: Any) -> None:
    state, ids, grad, logits, ref = reference(kind, dtype, **changes)
    results = mc2.run_local(patched_step, world,
                            args=(kind, CONFIGS[kind] | changes, state, ids, grad, dtype,
                                  micro_batches, checkpointing))
    layers = (CONFIGS[kind] | changes)["num_hidden_layers"]
    assert all(r["replaced"] == layers for r in results)
    close(torch.cat([r["logits"] for r in results]), logits, dtype, "logits")
    ref_params = dict(ref.named_parameters())
    experts = {n for n in ref_params if ".experts." in n}
    assert set(results[0]["replicated"]) == set(ref_params) - experts  # every other parameter
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
    with pytest.raises(ValueError, match="no sparse-MoE block"):
        enable_mc2(torch.nn.Linear(2, 2))


def test_meta_device_build_initialises_the_experts() -> None:
    """Meta build + enable_mc2 + to_empty + init_weights: experts drawn N(0, initializer_range)
    like the unpatched model's, expert e's values independent of the EP layout (2 ranks hold
    the slices of what one process draws with the same seed), the forward runs."""
    config = dict(CONFIGS["Mixtral"], initializer_range=0.05)
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(2))
    single = meta_init_state(0, 1, "Mixtral", config, ids, 7)
    ranks = mc2.run_local(meta_init_state, 2, args=("Mixtral", config, ids, 7))
    torch.manual_seed(0)
    unpatched = transformers.MixtralForCausalLM(transformers.MixtralConfig(**config))
    for key, value in single["state"].items():
        assert torch.isfinite(value).all(), key
        if ".experts." in key:
            hf_std = dict(unpatched.named_parameters())[key].std()
            assert abs(value.mean()) < 0.05 * 0.1 and abs(value.std() - 0.05) < 0.05 * 0.05
            assert abs(hf_std - 0.05) < 0.05 * 0.05  # the unpatched model's: the same law
    assert all(v == list(range(8)) for v in single["index"].values())
    for rank, r in enumerate(ranks):
        assert all(v == list(range(4 * rank, 4 * rank + 4)) for v in r["index"].values())
        for key, value in r["state"].items():
            want = single["state"][key]
            torch.testing.assert_close(value, want[4 * rank:4 * rank + 4] if ".experts." in key
                                       else want, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([r["logits"] for r in ranks]), single["logits"],
                               rtol=1e-5, atol=1e-6)


def test_init_weights_keeps_experts_that_hold_values() -> None:
    """A model built (and so initialised) normally keeps its experts through enable_mc2 and a
    later init_weights(), as Hugging Face keeps every initialised module."""
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**CONFIGS["Mixtral"]))
    before = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()
    enable_mc2(model)
    model.init_weights()
    torch.testing.assert_close(model.model.layers[0].mlp.experts.gate_up_proj, before,
                               rtol=0, atol=0)


def test_set_experts_implementation_sets_the_gemm_or_is_refused() -> None:
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**CONFIGS["Mixtral"]))
    enable_mc2(model)
    blocks = [m for m in model.modules() if isinstance(m, MC2SparseMoeBlock)]
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        model.set_experts_implementation("eager")
        assert {b.config.gemm for b in blocks} == {"loop"}
        loop = model(ids).logits
        model.set_experts_implementation("grouped_mm")
        assert {b.config.gemm for b in blocks} == {"grouped"}
        assert model.config._experts_implementation == "grouped_mm"
        torch.testing.assert_close(model(ids).logits, loop, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="no equivalent in mc2"):
        model.set_experts_implementation("batched_mm")
    assert {b.config.gemm for b in blocks} == {"grouped"}  # refused before anything changed
    assert model.config._experts_implementation == "grouped_mm"


class FakeRouter(torch.nn.Module):
    """A Mixtral-like router; ``order`` says what it returns."""

    def __init__(self, order: str = "logits,weights,index") -> None:
        super().__init__()
        self.top_k, self.order = 2, order
        self.weight = torch.nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor):
        logits = x @ self.weight.t()
        weights, index = logits.softmax(-1).topk(2, dim=-1)
        parts = {"logits": logits, "weights": weights, "index": index}
        out = tuple(parts[name] for name in self.order.split(","))
        return out[0] if len(out) == 1 else out


class FakeExperts(torch.nn.Module):
    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 12, 8) * 0.3)
        self.down_proj = torch.nn.Parameter(torch.randn(4, 8, 6) * 0.3)
        if bias:
            self.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(4, 12))


class FakeBlock(torch.nn.Module):
    def __init__(self, part: str = "", order: str = "logits,weights,index") -> None:
        super().__init__()
        self.gate, self.experts = FakeRouter(order), FakeExperts(bias=part == "expert bias")
        if part == "shared_experts":
            self.shared_experts = torch.nn.Linear(8, 8)
        if part == "own parameter":
            self.e_score_correction_bias = torch.nn.Parameter(torch.zeros(4))
        if part == "ungated shared_expert":
            self.shared_expert = torch.nn.Linear(8, 8)
        if part == "hook":
            self.register_forward_hook(_doubled)
        if part == "experts hook":
            self.experts.register_forward_pre_hook(lambda module, args: None)


@pytest.mark.parametrize("part,named", [("expert bias", "gate_up_proj_bias"),
                                        ("shared_experts", "'shared_experts'"),
                                        ("own parameter", "e_score_correction_bias"),
                                        ("ungated shared_expert", "shared_expert_gate"),
                                        ("hook", "FakeBlock has hooks (_doubled)"),
                                        ("experts hook", "experts: FakeExperts has hooks")])
def test_block_with_unknown_part_is_refused_and_nothing_replaced(part: str, named: str) -> None:
    model = torch.nn.Sequential(FakeBlock(), FakeBlock(part))
    with pytest.raises(ValueError, match="without losing a part") as err:
        enable_mc2(model)
    assert named in str(err.value) and "1 (FakeBlock)" in str(err.value)
    assert isinstance(model[0], FakeBlock)  # all or nothing


@pytest.mark.parametrize("order", ["logits,index,weights", "logits", "logits,weights"])
def test_router_output_is_checked(order: str) -> None:
    model = torch.nn.Sequential(FakeBlock(order=order))
    enable_mc2(model)
    with pytest.raises(ValueError, match="must return \\(router_logits, top_k_weights"):
        model(torch.randn(5, 8))


def _doubled(module: torch.nn.Module, args: Any, out: Any) -> Any:
    return out * 2


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_a_hook_on_the_experts_sees_the_routed_experts_only() -> None:
    """Qwen2-MoE's block runs its shared expert inside the fused call, as views of its
    weights; a hook on the experts (after ``enable_mc2``, on mc2's experts) must see what the
    model's experts compute, the routed experts' sum, not the shared expert's output added
    in: the shared expert then runs beside the call (said once). Logits equal the unpatched
    model's with the same hook (before: 0.2 apart)."""
    state, ids, _, _, _ = reference("Qwen2Moe", torch.float64)
    want = build("Qwen2Moe", CONFIGS["Qwen2Moe"], state, torch.float64)
    got = build("Qwen2Moe", CONFIGS["Qwen2Moe"], state, torch.float64)
    enable_mc2(got)
    for model in (want, got):
        for layer in model.model.layers:
            layer.mlp.experts.register_forward_hook(_doubled)
    with pytest.warns(UserWarning, match="runs beside the fused call.*has hooks"):
        logits = _logits(got, ids)
    close(logits, _logits(want, ids), torch.float64, "logits")


def test_a_hooked_or_subclassed_silu_is_not_read_as_silu() -> None:
    """mc2 computes SiLU where an MLP's ``act_fn`` is exactly ``nn.SiLU`` or transformers'
    ``SiLUActivation``: a subclass may compute more, a hook changes what it returns."""
    from mc2.integrations.module_stage import is_silu

    class Clamped(torch.nn.SiLU):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x).clamp(max=1.0)

    hooked = torch.nn.SiLU()
    hooked.register_forward_hook(_doubled)
    assert is_silu(None) and is_silu(torch.nn.SiLU())
    assert is_silu(transformers.activations.ACT2FN["silu"])
    assert not is_silu(Clamped()) and not is_silu(hooked)


def test_batch_overlap_runs_a_forward_unsplit_where_a_layer_part_has_a_hook() -> None:
    """Batch overlap calls a decoder layer's parts and its MoE block's staged call, not the
    layer, the block or its experts: a forward where one of them has a forward hook runs
    unsplit (said once), equal to the unpatched model with the same hook; FSDP2's and Hugging
    Face's own recording hooks do not count."""
    state, ids, _, _, _ = reference("Mixtral", torch.float64)
    for where in ("layer", "mlp", "experts"):
        want = build("Mixtral", CONFIGS["Mixtral"], state, torch.float64)
        got = build("Mixtral", CONFIGS["Mixtral"], state, torch.float64)
        enable_mc2(got, batch_overlap=True, min_tokens=1)
        for model in (want, got):
            layer = model.model.layers[1]
            part = {"layer": layer, "mlp": layer.mlp, "experts": layer.mlp.experts}[where]
            part.register_forward_hook(_doubled)
        with pytest.warns(UserWarning, match="which batch overlap would not call"):
            logits = _logits(got, ids)
        close(logits, _logits(want, ids), torch.float64, f"logits, a hook on the {where}")
    assert got.model.layers.decision.chosen is True  # overlap was on: only that forward ran whole


def test_wrapped_experts_are_refused_by_the_expert_parallel_tools() -> None:
    """An adapter wrapping a block's experts after ``enable_mc2`` (PEFT's
    ``target_parameters`` puts a ``ParamWrapper`` there): its factors belong to this rank's
    experts, so gradient sync, clipping, checkpoints and ``fully_shard`` refuse them with a
    ``ValueError`` naming the wrapper (before: a bare ``AttributeError``)."""
    class Wrapper(torch.nn.Module):
        def __init__(self, base: torch.nn.Module) -> None:
            super().__init__()
            self.base_layer = base

    state, _, _, _, _ = reference("Mixtral", torch.float64)
    model = build("Mixtral", CONFIGS["Mixtral"], state, torch.float64)
    enable_mc2(model)
    block = model.model.layers[0].mlp
    block.experts = Wrapper(block.experts)
    with pytest.raises(ValueError, match="wrapped in Wrapper"):
        mc2.clip_grad_norm_(model, 1.0)

