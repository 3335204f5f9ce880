"""``DistributedConfig(ep_size=2, ep_implementation="mc2")``: Hugging Face's own expert
parallelism running mc2's pipeline, on ten architectures (mixtral, qwen3_moe, qwen2_moe, olmoe,
deepseek_v3, gpt_oss, glm4_moe, granitemoe, phimoe, jamba), in both of Hugging Face's layouts,
float32: logits, loss and every gradient equal to the unsharded model within 1e-5. One world
per layout runs all ten (tests.workers_hf_ep)."""

from __future__ import annotations

import pytest
import torch

import mc2
from tests.workers_hf_ep import check

ARCHITECTURES = ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss",
                 "glm4_moe", "granitemoe", "phimoe", "jamba"]


@pytest.mark.parametrize("layout", ["dp", "tp"])
def test_ten_architectures_equal_the_unsharded_model(layout: str) -> None:
    results = check(ARCHITECTURES, layout)
    for model_type, errors in results.items():
        assert not isinstance(errors, str), f"{model_type}: {errors}"
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 1e-5, f"{model_type} ({layout}): {worst} off by {errors[worst]:.2e}"
        assert any(k.startswith("grad ") and ".experts." in k for k in errors), model_type


@pytest.mark.parametrize("experts_implementation", ["grouped_mm", "batched_mm"])
def test_the_models_own_experts_implementation_runs_on_each_micro_batch(
        experts_implementation: str) -> None:
    """The experts forward mc2 runs per micro-batch is the model's, whichever kernel it is set
    to: Mixtral and gpt-oss with grouped_mm and batched_mm equal the unsharded eager model."""
    results = check(["mixtral", "gpt_oss"], "dp", experts_implementation=experts_implementation)
    for model_type, errors in results.items():
        assert not isinstance(errors, str), f"{model_type}: {errors}"
        assert max(errors.values()) <= 1e-5, (model_type, max(errors, key=errors.get))


def _shared_batch_choices(rank: int, world: int, path: str, implementation: str | None) -> dict:
    import os

    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import mc2.integrations.hf_expert_parallel  # noqa: F401

    os.environ.setdefault("LOCAL_RANK", str(rank))
    extra = {} if implementation is None else {"experts_implementation": implementation}
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32,
        distributed_config=DistributedConfig(tp_size=world, ep_size=world,
                                             ep_implementation="mc2"), **extra)
    model.eval()
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    impl = [m.mc2_expert_parallel for m in model.modules() if hasattr(m, "mc2_expert_parallel")]
    with torch.no_grad():
        no_grad = model(ids).logits
    choices = {"no_grad": sorted({i.last_choice for i in impl})}
    grad = model(ids).logits
    choices["grad"] = sorted({i.last_choice for i in impl})
    return {"choices": choices, "no_grad": no_grad, "grad": grad.detach()}


# what a no-grad call on a shared batch runs: the all-reduce where the experts forward takes
# its masked routes (Hugging Face's kernels; Mixtral's eager forward counts a class for them),
# mc2's pipeline where it cannot (gpt-oss's eager forward one-hots over the experts alone, and
# Hugging Face's own all-reduce fails on it)
NO_GRAD_CHOICE = [("mixtral", None, "all_reduce"), ("mixtral", "eager", "all_reduce"),
                  ("gpt_oss", "eager", "mc2"), ("gpt_oss", None, "all_reduce")]


@pytest.mark.parametrize("model_type,implementation,choice", NO_GRAD_CHOICE)
def test_no_grad_on_a_shared_batch_runs_what_the_experts_can_take_and_says_so(
        tmp_path, model_type: str, implementation: str | None, choice: str) -> None:
    from tests.hf_tiny import tiny_model

    model = tiny_model(model_type)
    if implementation is not None:
        model.config._experts_implementation = implementation
    model.save_pretrained(tmp_path)
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
    for r in mc2.run_local(_shared_batch_choices, 2, args=(str(tmp_path), implementation)):
        assert r["choices"] == {"no_grad": [choice], "grad": ["mc2"]}
        torch.testing.assert_close(r["no_grad"], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r["grad"], want, atol=1e-5, rtol=1e-5)


def test_gradient_checkpointing_generate_and_save_pretrained(tmp_path) -> None:
    """The rest of Hugging Face's stack around ep_implementation="mc2": full gradient
    checkpointing (the recompute runs the call again with its forward's K) gives the
    unsharded gradients; greedy generate gives the unsharded tokens; save_pretrained writes a
    model that loads unsharded with the same weights."""
    from transformers import AutoModelForCausalLM

    from tests.hf_tiny import tiny_model
    from tests.workers_hf_ep import stack_step

    model = tiny_model("mixtral")
    model.save_pretrained(tmp_path / "in")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 64, (4, 8), generator=g)
    prompt = torch.randint(3, 64, (2, 5), generator=g)
    model(ids, labels=ids).loss.backward()
    with torch.no_grad():
        want_tokens = model.generate(prompt, max_new_tokens=3, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
    results = mc2.run_local(stack_step, 2, args=(str(tmp_path / "in"), str(tmp_path / "out"),
                                                 ids, prompt))
    assert results[0]["ran"] == ["mc2"]
    for name, p in model.named_parameters():
        got = results[0]["grads"][name]
        err = ((got - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-6)).item()
        assert err <= 1e-5, f"{name}: {err:.2e}"
    assert torch.equal(torch.cat([r["generated"] for r in results]), want_tokens)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    for (name, p), (_, q) in zip(model.named_parameters(), saved.named_parameters()):
        assert torch.equal(p.detach(), q.detach()), name


def test_a_training_step_reads_the_host_no_more_than_fused_expert(tmp_path) -> None:
    """One forward and backward of a tiny Mixtral (2 MoE layers) loaded with
    ``ep_implementation="mc2"``: each layer's call reads the host at most twice (the
    handshake and the counts: ``fused_expert``'s own; the module's experts stage reads
    nothing), and the whole backward reads nothing."""
    from tests.hf_tiny import tiny_model
    from tests.workers_hf_ep import counted_step

    tiny_model("mixtral").save_pretrained(tmp_path / "in")
    ids = torch.randint(3, 64, (4, 8), generator=torch.Generator().manual_seed(5))
    for r in mc2.run_local(counted_step, 2, args=(str(tmp_path / "in"), ids)):
        assert r["ran"] == ["mc2"] and r["calls"] == r["layers"] >= 2, r
        assert r["forward_reads"] <= 2, r["forward_read_ops"]
        assert r["backward_reads"] == 0, r


def test_hugging_faces_trainer_pairs_its_accumulation_as_its_own_loop(tmp_path) -> None:
    """Hugging Face's own ``Trainer`` (3 micro-batches an optimizer step, AdamW, 3 steps, the
    last of an epoch's two micro-batches) on a Mixtral loaded with ``ep_implementation="mc2"``
    and FSDP2 over 2 ranks, as it is and with ``pair_accumulation``: the paired forwards ran
    in the partner thread (2 of each 3-micro-batch step's and 1 of the 2-micro-batch step's,
    2 layers), and the logged losses and the final weights are ``Trainer``'s own to float32
    rounding. ``Trainer`` turns the units' gradient sync on after every call; without the
    pairing's override of it the last micro-batch's gradients were never reduced (seen: the
    second loss off by 3e-3 and weights by 55 %). In the same world, a step a callback stops
    mid-way is ended with ``train()``."""
    from tests.hf_tiny import tiny_model
    from tests.workers_hf_ep import trainer_paired

    tiny_model("mixtral").save_pretrained(tmp_path)
    results = mc2.run_local(trainer_paired, 2, args=(str(tmp_path),), timeout_s=300)
    for r in results:
        own, paired = r[False], r[True]
        assert paired["training_step"] == "PairedTrainingStep"
        assert paired["partner"] == (2 + 1 + 2) * 2 and own["partner"] == 0, paired["partner"]
        assert len(own["losses"]) == 3
        assert paired["losses"] == pytest.approx(own["losses"], rel=1e-6)
    own, paired = results[0][False]["weights"], results[0][True]["weights"]
    for name, weight in own.items():
        err = ((paired[name] - weight).abs().max() / weight.abs().max()).item()
        assert err <= 1e-4, f"{name}: {err:.2e}"
    start = tiny_model("mixtral")
    moved = max(((own[n] - p.detach()).abs().max() / p.detach().abs().max()).item()
                for n, p in start.named_parameters())
    assert moved > 1e-2  # the weights trained, far beyond the tolerance
    # a callback stopped the loop after the second of a step's three micro-batches: train()
    # returned with that step ended (no micro-batch pending for the next train() to pair
    # with its first forward) and the FSDP2 units let go (before: held, reshard off)
    for r in results:
        stopped = r["stopped"]
        assert stopped["global_step"] == 0, stopped  # stopped inside the first step
        assert stopped["open"] == 0 and stopped["held_groups"] == 0, stopped


def test_hugging_faces_trainer_refuses_pairing_a_ddp_model_on_every_rank(tmp_path) -> None:
    """A model loaded whole, which ``Trainer`` wraps in ``DistributedDataParallel`` (whose
    hooks prepare each backward in the forward before it): the first step raises on every
    rank, naming it and the sharded loading to use instead."""
    from tests.hf_tiny import tiny_model
    from tests.workers_hf_ep import trainer_refusals

    tiny_model("mixtral").save_pretrained(tmp_path)
    for r in mc2.run_local(trainer_refusals, 2, args=(str(tmp_path),), timeout_s=120):
        assert r["wrapped"] == "DistributedDataParallel", r
        assert r["refused"] is not None and "DistributedDataParallel" in r["refused"], r
        assert "fsdp_size" in r["refused"], r
        assert "model_init" in r["model_init"], r
        assert "updates the weights inside the backward" in r["lomo"], r
