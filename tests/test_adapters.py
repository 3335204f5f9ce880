"""mc2 computes what the user's modules compute: PEFT's LoRA on the shared MLPs (Qwen2-MoE,
DeepSeek-V3, GLM-4-MoE) and on the routed experts (Mixtral, DeepSeek-V3), a quantised-layer
stand-in on a shared projection, each added before and after ``enable_mc2``, on 2 ranks in
float64: the logits, the adapters' gradients and the adapters after 5 SGD steps equal the
unpatched model's with the same adapters, or the case is refused with a ``ValueError`` on every
rank. None is silently different (an adapter mc2 read past used to be skipped), none crashes
inside mc2."""

from __future__ import annotations

import pytest
import torch

import mc2
from tests.workers_adapters import reference, step_adapters


# (model type, adapter, order) -> what must happen: "equal", or a refusal matching the text
CASES = {
    ("qwen2_moe", "shared", "before"): "equal",
    ("qwen2_moe", "shared", "after"): "equal",
    ("qwen2_moe", "scaled", "after"): "equal",
    ("deepseek_v3", "shared", "before"): "equal",
    ("deepseek_v3", "shared", "after"): "equal",
    ("glm4_moe", "shared", "before"): "equal",
    ("glm4_moe", "shared", "after"): "equal",
    ("glm4_moe", "scaled", "after"): "equal",
    ("mixtral", "routed", "after"): "equal",
    ("mixtral", "routed", "before"): "an adapter on the experts' tensors",
    ("deepseek_v3", "routed", "before"): "an adapter on the experts' tensors",
    ("deepseek_v3", "routed", "after"): "parametrization of",
}
WORLD = 2
RANK = 4  # the adapters' rank (tests/workers_adapters.lora_config)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
    assert err <= 1e-10, f"{what}: relative error {err:.2e}"


def _local(name: str, want: torch.Tensor, rank: int, got: torch.Tensor) -> torch.Tensor:
    """The reference adapter's part on ``rank``: a routed adapter's rows (A, ``[r * E, in]``
    expert-major) or columns (B, ``[out, r * E]`` viewed ``[out, r, E]``) of this rank's
    experts; a replicated one whole."""
    if got.shape == want.shape:
        return want
    if ".lora_A." in name:
        rows = got.shape[0]
        return want[rank * rows:(rank + 1) * rows]
    experts, local = want.shape[1] // RANK, got.shape[1] // RANK
    return want.view(want.shape[0], RANK, experts)[:, :, rank * local:(rank + 1) * local] \
        .reshape(want.shape[0], -1)


def test_adapters_are_computed_or_refused_on_every_rank() -> None:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 64, (4, 8), generator=g)
    grad = torch.randn(4, 8, 64, generator=g, dtype=torch.float64)
    cases = list(CASES)
    results = mc2.run_local(step_adapters, WORLD, args=(cases, ids, grad), timeout_s=120)
    for index, case in enumerate(cases):
        got = [r[index] for r in results]
        expected = CASES[case]
        if expected != "equal":
            for rank, result in enumerate(got):
                assert isinstance(result, str) and expected in result, \
                    f"{case} rank {rank}: {result if isinstance(result, str) else 'ran'}"
            continue
        assert all(isinstance(r, dict) for r in got), f"{case}: {got}"
        want = reference(*case[:2], ids, grad)
        _close(torch.cat([r["logits"] for r in got]), want["logits"], f"{case} logits")
        assert set(got[0]["grads"]) == set(want["grads"]) and want["grads"], case
        for rank, result in enumerate(got):
            for key in ("grads", "trained"):
                for name, tensor in result[key].items():
                    _close(tensor, _local(name, want[key][name], rank, tensor),
                           f"{case} rank {rank} {key} {name}")


def test_adapters_under_hugging_faces_expert_parallelism() -> None:
    """The second way in, ``ep_implementation="mc2"``: the model's own block calls its shared
    MLP, so an adapter there runs, equal to the unpatched model's, and its gradients arrive.
    (PEFT's adapter on the routed experts' tensors fails inside PEFT itself under Hugging
    Face's EP, mixing its DTensor parameters with plain tensors, whatever the EP
    implementation; mc2's own refusal of it is the next test.)"""
    from tests.workers_adapters import ep_reference, ep_step

    ids = torch.randint(3, 64, (4, 8), generator=torch.Generator().manual_seed(6))
    path, want = ep_reference("qwen2_moe", "shared", ids)
    results = mc2.run_local(ep_step, WORLD, args=({"qwen2_moe": path}, [("qwen2_moe", "shared")],
                                                  ids), timeout_s=120)
    shared = [r[0] for r in results]
    assert all(isinstance(r, dict) and r["adapter_grads"] for r in shared), shared
    logits = torch.cat([r["logits"] for r in shared])
    assert ((logits - want).abs().max() / want.abs().max()).item() <= 1e-5


def test_parametrized_experts_are_refused_by_the_experts_stage() -> None:
    """An experts module with a parametrization (PEFT registers one on an experts tensor while
    its forward runs) would run on stand-ins that bypass it, losing the adapter's gradients:
    ``fused_expert_module`` refuses it, naming the tensor, before any exchange."""
    from torch.nn.utils import parametrize

    from tests.problems import make_problem
    from tests.workers_module import BiasedGeluExperts

    class Doubled(torch.nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return 2 * w

    problem = make_problem(1, "uniform")
    experts = BiasedGeluExperts(problem.w_up.clone(), problem.w_down.clone(),
                                problem.w_down.sum(1) * 0.1)
    name = next(n for n, _ in experts.named_parameters())
    parametrize.register_parametrization(experts, name, Doubled())
    with pytest.raises(ValueError, match=f"parametrization of \\['{name}'\\]"):
        mc2.fused_expert_module(problem.xs[0], experts, problem.ids[0], problem.rws[0])
