"""mc2 computes what the unpatched Hugging Face model computes, whatever the user changed on the
modules mc2 reads instead of calling: each case below differed silently before (found by a
review). One process, float64: the logits and every gradient equal the unpatched model's with
the same change, or ``enable_mc2`` refuses, naming it."""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mc2.integrations.transformers import enable_mc2
from tests.hf_tiny import tiny_model

SHARED = {"qwen2_moe": "shared_expert", "deepseek_v3": "shared_experts"}


def _ids() -> torch.Tensor:
    return torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(1))


def _run(model: nn.Module, seed: int = 123) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)  # the same draws for dropout on both sides
    out = model(_ids()).logits
    grad = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(3))
    (out * grad).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


def _assert_same(model: nn.Module, ref: nn.Module) -> None:
    (got, got_grads), (want, want_grads) = _run(model), _run(ref)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-10), float((got - want).abs().max())
    assert set(got_grads) == set(want_grads)
    for name, g in want_grads.items():
        assert torch.allclose(got_grads[name], g, rtol=1e-10, atol=1e-10), name


def _linear_forward(mlp: nn.Module) -> None:
    lin = mlp.down_proj
    lin.forward = types.MethodType(lambda self, x: F.linear(x, self.weight) * 2.0, lin)


def _mlp_forward(mlp: nn.Module) -> None:
    own = mlp.forward
    mlp.forward = lambda x: own(x) * 0.5


def _act_forward(mlp: nn.Module) -> None:
    act = mlp.act_fn
    act.forward = types.MethodType(lambda self, x: F.silu(x).clamp(max=0.1), act)


def _subclass(mlp: nn.Module) -> None:
    mlp.__class__ = type("Gelu" + type(mlp).__name__, (type(mlp),), {
        "forward": lambda self, x: self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))})


def _backward_hook(mlp: nn.Module) -> None:
    mlp.down_proj.register_full_backward_hook(lambda module, gi, go: (gi[0] * 3.0,))


def _backward_pre_hook(mlp: nn.Module) -> None:
    mlp.up_proj.register_full_backward_pre_hook(lambda module, go: (go[0] * 3.0,))


def _mlp_backward_hook(mlp: nn.Module) -> None:
    mlp.register_full_backward_hook(lambda module, gi, go: (gi[0] * 3.0,))


CHANGES = {"a projection's forward replaced": _linear_forward,
           "the MLP's forward replaced": _mlp_forward,
           "act_fn's forward replaced": _act_forward,
           "a subclass with a forward of its own": _subclass,
           "a backward hook on a projection": _backward_hook,
           "a backward pre-hook on a projection": _backward_pre_hook,
           "a backward hook on the MLP": _mlp_backward_hook}


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("model_type", sorted(SHARED))
def test_a_changed_shared_mlp_is_run_as_the_model_runs_it(model_type: str, change: str) -> None:
    """Changed after ``enable_mc2`` and a first step: the shared MLP's views were read as
    before, so the change was skipped (logits 0.04-0.33 apart, gradients up to 97 apart)."""
    model = tiny_model(model_type).double()
    ref = copy.deepcopy(model)
    enable_mc2(model)
    _run(model)
    for m in (model, ref):
        CHANGES[change](getattr(m.model.layers[0].mlp, SHARED[model_type]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "runs beside", said once
        _assert_same(model, ref)


def test_a_hook_on_every_module_is_run_as_the_model_runs_it() -> None:
    """``register_module_forward_hook`` changes every module's output, the shared MLP's
    projections' too: it was skipped where mc2 read their weights."""
    def halved_up(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        return out * 0.5 if getattr(module, "_halved", False) else None

    model = tiny_model("qwen2_moe").double()
    ref = copy.deepcopy(model)
    enable_mc2(model)
    for m in (model, ref):
        m.model.layers[0].mlp.shared_expert.up_proj._halved = True
    handle = nn.modules.module.register_module_forward_hook(halved_up)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _assert_same(model, ref)
    finally:
        handle.remove()


def test_an_eval_model_stays_in_eval() -> None:
    """The new blocks took ``nn.Module``'s training mode in an eval model: Mixtral's router
    jitter ran at inference (logits 0.32 apart)."""
    model = tiny_model("mixtral", router_jitter_noise=0.5).double().eval()
    ref = copy.deepcopy(model)
    enable_mc2(model)
    assert not any(m.training for m in model.modules())
    _assert_same(model, ref)


def test_the_shared_mlps_dropout_draws_where_the_model_draws_it() -> None:
    """A LoRA adapter with dropout on the shared MLP and on its gate, in training: the MLP
    ran after the router, so a same-seed step drew other masks (logits 0.29 apart)."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model("qwen2_moe").double()
    ref = copy.deepcopy(model)
    enable_mc2(model)
    config = dict(r=4, lora_alpha=8, init_lora_weights=False, lora_dropout=0.3,
                  target_modules=r".*shared_expert\.down_proj|.*shared_expert_gate")
    model, ref = (get_peft_model(m, LoraConfig(**config)) for m in (model, ref))
    for m in (model, ref):
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.linspace(-0.5, 0.5, p.numel()).reshape(p.shape))
        m.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _assert_same(model, ref)


def test_experts_tied_across_layers_are_refused() -> None:
    """mc2 copies each layer's experts: tied ones came apart, each layer's gradient went to
    its own copy, and one optimizer step made the layers differ (0.33)."""
    model = tiny_model("mixtral").double()
    layers = model.model.layers
    layers[1].mlp.experts.gate_up_proj = layers[0].mlp.experts.gate_up_proj
    with pytest.raises(ValueError, match="layers.1.mlp.experts.gate_up_proj shares its storage"):
        enable_mc2(model)


def test_a_kernel_chosen_after_the_first_call_is_tried_before_the_handshake() -> None:
    """``set_experts_implementation`` after a call: the experts module was tried once per
    width and dtype, so the new kernel failed inside the pipeline, on the ranks that got rows
    only (a peer timed out). Tried again: a ``ValueError`` naming it, before any exchange."""
    model = tiny_model("deepseek_v3").double()
    enable_mc2(model)
    model(_ids())
    model.set_experts_implementation("grouped_mm")  # no float64 kernel on a CPU
    with pytest.raises(ValueError, match="fails on a row of width"):
        model(_ids())


class _RunningMaxSiLU(nn.Module):
    """A SiLU that keeps a running maximum of its output in a buffer (quantisation-aware
    training's delayed scaling keeps one so)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("amax", torch.ones((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.silu(x)
        if self.training:
            with torch.no_grad():
                self.amax.mul_(0.9).add_(0.1 * y.abs().max())
        return y * (self.amax / self.amax.detach())


def test_an_experts_module_that_keeps_state_is_refused() -> None:
    """mc2 calls a model's experts module once per micro-batch and expert, and once more to
    try it: a running statistic inside it was updated more often than the model updates it
    (logits 0.004 apart after a step, 33 gradients off; found by a review). Seen when the
    try changes a buffer: a ``ValueError`` before any exchange."""
    model = tiny_model("deepseek_v3").double().train()
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts.act_fn = _RunningMaxSiLU()
    enable_mc2(model, micro_batches=2)
    with pytest.raises(ValueError, match="changes its buffers when called"):
        model(_ids())


def test_a_hook_on_the_experts_sees_what_hugging_faces_experts_see() -> None:
    """Hugging Face's block calls its experts ``experts(x, ids, weights)``; mc2's passed ids
    and weights by name, so a pre-hook written for the model (here squaring the routing
    weights) raised ``IndexError`` (found by a review). By position, it computes the same."""
    model = tiny_model("mixtral").double()
    ref = copy.deepcopy(model)
    enable_mc2(model)
    for m in (model, ref):
        for layer in m.model.layers:
            layer.mlp.experts.register_forward_pre_hook(lambda mod, a: (a[0], a[1], a[2] ** 2))
    _assert_same(model, ref)


def test_a_flop_counter_leaves_the_shared_mlp_inside_the_call() -> None:
    """torch's ``FlopCounterMode`` puts hooks on every module (its ``ModuleTracker``), which
    only record: the shared MLP stays inside mc2's call, no warning, the same logits."""
    from torch.utils.flop_counter import FlopCounterMode

    from mc2.integrations.weight_reads import WeightReadWarning

    model = tiny_model("qwen2_moe").double()
    ref = copy.deepcopy(model)
    enable_mc2(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", WeightReadWarning)
        with FlopCounterMode(display=False):
            got = model(_ids()).logits
    assert torch.allclose(got, ref(_ids()).logits, rtol=1e-10, atol=1e-10)
