"""Rank functions for Hugging Face's expert parallelism under ep_implementation="mc2"; and
(:func:`check`) Hugging Face's own expert parallelism with ``ep_implementation="mc2"``
checked against the unsharded model, architecture by architecture.

For each architecture: a tiny model (:mod:`tests.hf_tiny`) is saved, loaded again on every
rank of a local world with ``DistributedConfig(ep_size=R, ...)`` in one of Hugging Face's two
layouts, and one training step's logits, loss and every parameter's gradient are compared with
the same step of the unsharded model on one process:

* ``"dp"``: ranks hold different batches (``fsdp_size == ep_size``), each its share of the
  batch; FSDP2 averages the dense gradients over the ranks, and each rank's loss is the mean
  over its tokens, so the gradients equal the whole batch's;
* ``"tp"``: the EP group shares one batch (``tp_size == ep_size``, the model's own TP plan
  for the dense layers); every rank computes the whole batch's loss.

Models run in eval mode (gradients flow all the same): dropout and training-time routing noise
(PhiMoE's sparsemixer samples its top-k in training) draw from each process's own generator,
which no sharded run can reproduce. Every architecture of one layout runs in one world (one
start of the ranks, one import of transformers), so the test and
``benchmarks/hf_architectures.py`` share this code.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from typing import Any

import torch


def _sharded(rank: int, world: int, path: str) -> Any:
    """The model at ``path`` loaded on this rank with ``ep_implementation="mc2"``, ranks
    holding different batches (FSDP2 over them)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import mc2.integrations.hf_expert_parallel  # noqa: F401  registers "mc2"

    os.environ.setdefault("LOCAL_RANK", str(rank))
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, distributed_config=DistributedConfig(
            ep_size=world, fsdp_size=world, ep_implementation="mc2"))


def stack_step(rank: int, world: int, path: str, out: str, ids: torch.Tensor,
               prompt: torch.Tensor) -> dict:
    """Gradient checkpointing, generate and save_pretrained with mc2 as the EP implementation
    (ranks holding different batches, FSDP over them)."""
    from torch.distributed.tensor import DTensor

    model = _sharded(rank, world, path)
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
    import mc2.integrations.hf_expert_parallel as hf_ep
    from tests.call_counting import counted_calls

    model = _sharded(rank, world, path)
    mine = ids.chunk(world)[rank]
    model(mine, labels=mine).loss.backward()  # warm: groups made, planner settled
    model.zero_grad()
    with counted_calls(hf_ep) as seen:
        model(mine, labels=mine).loss.backward()
    ran = sorted({m.mc2_expert_parallel.last_choice for m in model.modules()
                  if hasattr(m, "mc2_expert_parallel")})
    return {**seen, "ran": ran, "layers": model.config.num_hidden_layers}


BATCH, SEQ = 4, 8


def _data(seed: int = 1) -> Any:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 64, (BATCH, SEQ), generator=g)


def _loss(model: Any, ids: Any) -> Any:
    """The causal LM loss; for a base model without a head, a fixed projection of its output."""
    if getattr(model, "lm_head", None) is not None or hasattr(model, "get_output_embeddings") \
            and model.get_output_embeddings() is not None:
        out = model(ids, labels=ids)
        return out.logits, out.loss
    hidden = model(ids).last_hidden_state
    g = torch.Generator().manual_seed(2)
    probe = torch.randn(hidden.shape[-1], generator=g, dtype=hidden.dtype)
    return hidden, (hidden @ probe).square().mean()


def reference(model_type: str, dtype: Any = None) -> dict[str, Any]:
    """The unsharded model's step, and where the model was saved (``path``)."""
    from tests.hf_tiny import tiny_model

    model = tiny_model(model_type)  # eval: no dropout, no routing noise (module docstring)
    if dtype is not None:
        model = model.to(dtype)
    path = tempfile.mkdtemp(prefix=f"mc2-{model_type}-")
    model.save_pretrained(path)
    ids = _data()
    logits, loss = _loss(model, ids)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return {"path": path, "logits": logits.detach(), "loss": loss.detach(), "grads": grads}


def _distributed_config(layout: str, world: int, implementation: str) -> Any:
    from transformers.distributed import DistributedConfig

    if layout == "dp":
        return DistributedConfig(ep_size=world, fsdp_size=world,
                                 ep_implementation=implementation)
    return DistributedConfig(tp_size=world, ep_size=world, ep_implementation=implementation)


def rank_step(rank: int, world: int, paths: dict[str, str], layout: str,
              implementation: str, dtype: Any = None,
              experts_implementation: str = "eager") -> dict[str, Any]:
    """On each rank of a local world: every architecture in ``paths`` loaded with Hugging
    Face's expert parallelism and stepped once; logits, loss, full gradients (rank 0), or the
    error of an architecture that failed."""
    from torch.distributed.tensor import DTensor
    from transformers import AutoModel, AutoModelForCausalLM

    import mc2.integrations.hf_expert_parallel  # noqa: F401 - registers "mc2"

    os.environ.setdefault("LOCAL_RANK", str(rank))
    ids = _data()
    if layout == "dp":
        ids = ids.chunk(world)[rank]
    results: dict[str, Any] = {}
    for model_type, path in paths.items():
        try:
            config = _distributed_config(layout, world, implementation)
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    path, distributed_config=config, dtype=dtype or torch.float32,
                    experts_implementation=experts_implementation)
            except ValueError:
                model = AutoModel.from_pretrained(
                    path, distributed_config=config, dtype=dtype or torch.float32,
                    experts_implementation=experts_implementation)
            model.eval()
            logits, loss = _loss(model, ids)
            loss.backward()
            grads = {}
            for name, p in model.named_parameters():
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                if grad is not None and rank == 0:
                    grads[name] = grad.detach().clone()
            ran = sorted({m.mc2_expert_parallel.last_choice for m in model.modules()
                          if hasattr(m, "mc2_expert_parallel")})
            results[model_type] = {"logits": logits.detach(), "loss": loss.detach(),
                                   "grads": grads, "ran": ran}
        except Exception:  # noqa: BLE001 - reported per architecture
            results[model_type] = {"error": traceback.format_exc(limit=4)}
    return results


def compare(model_type: str, ref: dict[str, Any], got: list[dict[str, Any]], layout: str,
            implementation: str = "mc2") -> dict[str, float] | str:
    """Relative max errors by what was compared (``logits``, ``loss``, ``grad <name>``), or
    what went wrong."""
    first = got[0][model_type]
    if "error" in first or any("error" in g[model_type] for g in got):
        return next(g[model_type]["error"] for g in got if "error" in g[model_type])
    parts = [g[model_type] for g in got]
    logits = torch.cat([p["logits"] for p in parts]) if layout == "dp" else parts[0]["logits"]
    loss = torch.stack([p["loss"] for p in parts]).mean() if layout == "dp" else parts[0]["loss"]
    errors = {"logits": _err(logits, ref["logits"]), "loss": _err(loss, ref["loss"])}
    missing = set(ref["grads"]) - set(first["grads"])
    if missing:
        return f"no gradient for {sorted(missing)}"
    for name, want in ref["grads"].items():
        errors[f"grad {name}"] = _err(first["grads"][name], want)
    if implementation == "mc2" and first["ran"] != ["mc2"]:
        return f"the experts ran {first['ran']}, not mc2's pipeline"
    return errors


def _err(got: Any, want: Any) -> float:
    if tuple(got.shape) != tuple(want.shape):
        return float("inf")
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


def check(model_types: list[str], layout: str, *, world: int = 2,
          implementation: str = "mc2", dtype: Any = None,
          experts_implementation: str = "eager") -> dict[str, dict[str, float] | str]:
    """For each architecture: its errors against the unsharded model (see :func:`compare`), or
    why it did not build or run. ``experts_implementation``: how the sharded model's experts
    compute (the reference's run ``eager``)."""
    from mc2.tools.launch import run_local

    refs, out = {}, {}
    for model_type in model_types:
        try:
            refs[model_type] = reference(model_type, dtype)
        except Exception as exc:  # noqa: BLE001 - an architecture that does not build
            out[model_type] = f"does not build: {type(exc).__name__}: {exc}"
    paths = {m: r["path"] for m, r in refs.items()}
    got = run_local(rank_step, world, args=(paths, layout, implementation, dtype,
                                            experts_implementation),
                    deadline_s=120 + 60 * len(paths))
    for model_type, ref in refs.items():
        out[model_type] = compare(model_type, ref, got, layout, implementation)
    return out


def trainer_paired(rank: int, world: int, path: str) -> dict:
    """Hugging Face's ``Trainer`` on a model loaded with ``ep_implementation="mc2"`` (ranks
    holding different batches, FSDP2 over them), 3 micro-batches an optimizer step, 3 steps,
    twice from the same weights and data: as it is, and with ``pair_accumulation``. Each run's
    logged losses, its final weights, and how many MoE forwards ran in the partner thread;
    and, in the same world, :func:`_stopped_mid_step`."""
    import threading

    from torch.distributed.tensor import DTensor
    from transformers import Trainer, TrainingArguments

    from mc2.integrations.transformers_schedule import pair_accumulation

    found: dict[str, Any] = {}
    for paired in (False, True):
        model = _sharded(rank, world, path)
        threads: list[str] = []
        for module in model.modules():
            if hasattr(module, "mc2_expert_parallel"):
                module.register_forward_pre_hook(
                    lambda *_, threads=threads: threads.append(threading.current_thread().name))
        g = torch.Generator().manual_seed(100 + rank)
        data = [{"input_ids": (ids := torch.randint(3, 64, (8,), generator=g)),
                 "labels": ids} for _ in range(18)]
        args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2,
                                 gradient_accumulation_steps=3, max_steps=3, logging_steps=1,
                                 report_to=[], use_cpu=True, save_strategy="no",
                                 learning_rate=1e-2, dataloader_num_workers=0, seed=0,
                                 disable_tqdm=True)
        class Kept(Trainer):
            losses: list[float]

            def log(self, logs: dict, *args: Any, **kwargs: Any) -> None:
                if "loss" in logs:
                    self.losses.append(float(logs["loss"]))
                return super().log(logs, *args, **kwargs)

        trainer = Kept(model=model, args=args, train_dataset=data)
        trainer.losses = losses = []
        if paired:
            pair_accumulation(trainer)
        trainer.train()
        weights = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                   for n, p in model.named_parameters()}
        found[paired] = {"losses": losses, "weights": weights if rank == 0 else None,
                         "partner": threads.count("mc2-paired-forward"),
                         "training_step": type(trainer.training_step).__name__}
    found["stopped"] = _stopped_mid_step(rank, world, path)
    return found


def trainer_refusals(rank: int, world: int, path: str) -> dict:
    """What ``pair_accumulation`` refuses, on each rank: a model ``Trainer`` wraps in
    ``DistributedDataParallel`` (loaded whole, not sharded), at the first step."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from mc2.integrations.transformers_schedule import pair_accumulation

    os.environ.setdefault("LOCAL_RANK", str(rank))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(3, 64, (8,))
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=1, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True)
    data = [{"input_ids": ids, "labels": ids}] * 8
    trainer = Trainer(model=model, args=args, train_dataset=data)
    pair_accumulation(trainer)
    found: dict[str, Any] = {}
    try:
        trainer.train()
        found["refused"] = None
    except ValueError as exc:
        found["refused"] = str(exc)
    found["wrapped"] = type(trainer.model_wrapped).__name__
    for name, changes in (("model_init", {"model_init": lambda: model, "model": None}),
                          ("lomo", {"args": TrainingArguments(
                              output_dir=tempfile.mkdtemp(), optim="lomo", report_to=[],
                              use_cpu=True, gradient_accumulation_steps=2)})):
        kwargs = {"model": model, "args": args, "train_dataset": data} | changes
        try:
            pair_accumulation(Trainer(**kwargs))
            found[name] = None
        except ValueError as exc:
            found[name] = str(exc)
    return found


def _stopped_mid_step(rank: int, world: int, path: str) -> dict:
    """A paired ``Trainer`` (``ep_implementation="mc2"``, FSDP2 over the ranks, 3
    micro-batches a step) whose callback stops the loop after the first step's second
    micro-batch: whether a step was left open after ``train()``, and whether the FSDP2 units
    were let go (no parameter group's ``reshard`` left switched off)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from mc2.integrations.transformers_schedule import pair_accumulation
    from mc2.parallel.layer_gather import fsdp_units, param_groups

    model = _sharded(rank, world, path)

    class StopMidStep(TrainerCallback):
        substeps = 0

        def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.substeps += 1
            if self.substeps == 2:
                control.should_training_stop = True

    ids = torch.randint(3, 64, (8,), generator=torch.Generator().manual_seed(rank))
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2,
                             gradient_accumulation_steps=3, max_steps=2, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, callbacks=[StopMidStep()],
                      train_dataset=[{"input_ids": ids, "labels": ids}] * 24)
    paired = pair_accumulation(trainer)
    trainer.train()
    held = sum("reshard" in group.__dict__ for unit in fsdp_units(model)
               for group in param_groups(unit))
    return {"open": paired.loop.taken, "held_groups": held,
            "global_step": trainer.state.global_step}
