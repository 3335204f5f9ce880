"""mc2.fused_expert_module: any experts module as the pipeline's experts stage (biases, GELU, a
clamp: nothing mc2's SwiGLU computes), on 2 and 4 ranks and hostile routings, with rows once
per destination too, forward and backward against the unsharded module on one process
(float64, 1e-12)."""

from __future__ import annotations

import pytest
import torch

import mc2
from tests.problems import ROUTINGS, make_problem
from tests.workers_module import BiasedGeluExperts, dense, module_step

KS = [1, 3, (3, True)]  # (K, dedup): rows once per destination


@pytest.mark.parametrize("world", [2, 4])
def test_module_stage_equals_the_unsharded_module(world: int) -> None:
    problems = [make_problem(world, routing, seed=i) for i, routing in enumerate(ROUTINGS)]
    results = mc2.run_local(module_step, world, args=(problems, KS))
    for p_index, problem in enumerate(problems):
        want = dense(problem)
        L = problem.local_experts
        for k_index, k in enumerate(KS):
            got = [r[p_index * len(KS) + k_index] for r in results]
            what = f"{ROUTINGS[p_index]} K={k}"  # (K, dedup) for rows once per destination
            for rank in range(world):
                for key in ("out", "grad_x", "grad_rw"):
                    torch.testing.assert_close(got[rank][key], want[key][rank], atol=1e-12,
                                               rtol=0, msg=f"{what} rank {rank} {key}")
                for name, grad in want["params"].items():
                    torch.testing.assert_close(got[rank]["params"][name],
                                               grad[rank * L:(rank + 1) * L], atol=1e-12,
                                               rtol=0, msg=f"{what} rank {rank} grad {name}")


def test_module_stage_on_one_process_and_its_errors() -> None:
    problem = make_problem(1, "uniform")
    experts = BiasedGeluExperts(problem.w_up.clone(), problem.w_down.clone(),
                                problem.w_down.sum(1) * 0.1)
    out = mc2.fused_expert_module(problem.xs[0], experts, problem.ids[0], problem.rws[0])
    torch.testing.assert_close(out, dense(problem)["out"][0], atol=1e-12, rtol=0)
    experts.num_experts = None  # a module that does not say how many experts it holds
    with pytest.raises(ValueError, match="local_experts"):
        mc2.fused_expert_module(problem.xs[0], experts, problem.ids[0], problem.rws[0])
    experts.num_experts = 2
    with pytest.raises(ValueError, match="fails on a row of width 8"):
        mc2.fused_expert_module(problem.xs[0][:, :8], experts, problem.ids[0],
                                problem.rws[0], local_experts=2)


@pytest.mark.parametrize("model_type,shared_inside", [("gpt_oss", False), ("deepseek_v3", True),
                                                     ("glm4_moe", True)])
def test_enable_mc2_runs_blocks_it_does_not_compute_through_their_own_experts(
        model_type: str, shared_inside: bool) -> None:
    """gpt-oss (expert biases, clamped activation), DeepSeek-V3 and GLM-4-MoE (correction bias,
    shared experts) were refused; now each block's experts module runs as the pipeline's stage,
    with the block's own router, and DeepSeek-V3's and GLM-4-MoE's shared MLP inside the
    experts' call: logits and every gradient (the shared MLP's included) equal the unpatched
    model's (float32)."""
    from tests.hf_tiny import tiny_model
    from tests.workers_module import enable_step

    model = tiny_model(model_type)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 64, (4, 8), generator=g)
    grad = torch.randn(4, 8, 64, generator=g)
    logits = model(ids).logits
    (logits * grad).sum().backward()
    ref = dict(model.named_parameters())
    results = mc2.run_local(enable_step, 2, args=(model_type, ids, grad))
    assert all(r["staged"] == r["replaced"] >= 1 for r in results)
    assert all(r["shared_inside"] == (r["staged"] if shared_inside else 0) for r in results)

    def close(got, want, what):
        err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
        assert err <= 1e-5, f"{model_type} {what}: {err:.2e}"

    close(torch.cat([r["logits"] for r in results]), logits.detach(), "logits")
    for name in results[0]["replicated"]:
        close(sum(r["replicated"][name] for r in results), ref[name].grad, name)
    for name, (first, grad_local) in results[0]["experts"].items():
        for r in results:
            first, grad_local = r["experts"][name]
            close(grad_local, ref[name].grad[first:first + grad_local.shape[0]], name)


def test_experts_that_hold_tensors_outside_their_parameters_are_not_split() -> None:
    """Only parameters are split by expert over the ranks: an experts module holding a
    buffer, or its weights as plain attributes (transformers' MXFP4 loading keeps them as
    kernel tensors outside the parameters), would keep every expert's while its local
    expert count shrinks, and local ids would run other experts' weights: not split."""
    from mc2.integrations.module_stage import experts_problem

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = 4
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 8, 6))

    assert experts_problem(Experts()) is None
    buffered = Experts()
    buffered.register_buffer("scales", torch.ones(4, 8))
    loaded = Experts()
    del loaded.gate_up_proj
    loaded.gate_up_proj = torch.zeros(4, 8, 6)  # a plain attribute now, not a parameter
    for module, named in ((buffered, "scales"), (loaded, "gate_up_proj")):
        problem = experts_problem(module)
        assert problem is not None and named in problem and "outside its parameters" in problem
