"""Hugging Face ``Trainer``'s gradient accumulation with one micro-batch's forward beside
another's backward.

:func:`pair_accumulation` makes ``Trainer.training_step`` a :class:`PairedTrainingStep`: each
call runs Hugging Face's own ``training_step`` as the forward, its ``accelerator.backward`` call
kept and run one call later beside the next forward
(:class:`mc2.engine.autograd.pairing.PairedLoop`); the step's last call also runs its own
backward alone. What pairs are the model's mc2 calls (``ep_implementation="mc2"`` or
``enable_mc2``; tested with the first, loaded with FSDP2: a model ``enable_mc2`` switched in a
multi-rank world is one ``Trainer`` wraps in ``DistributedDataParallel``, which is refused).

See docs/huggingface.md, "Hugging Face's `Trainer` with paired gradient accumulation" (why the
FSDP2 units' gradient sync is overridden, how an unfinished step ends, what is refused and why).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from mc2.parallel.layer_gather import fsdp_units
from mc2.parallel.paired_fsdp import PairedSharding


DDP = ("pair_accumulation: the model is wrapped in DistributedDataParallel, whose hooks "
       "prepare each backward in the forward before it (load it sharded: "
       "DistributedConfig(fsdp_size=...))")


@dataclass
class _MicroBatch:
    """One micro-batch's forward: its loss, ``accelerator.backward``'s keywords for it, and
    what ``training_step`` returned (the detached loss the trainer logs)."""

    loss: Tensor
    backward: dict[str, Any] = field(default_factory=dict)
    logged: Tensor | None = None


class PairedTrainingStep:
    """``Trainer.training_step`` for ``trainer``, each micro-batch's forward beside the
    previous one's backward (module docstring). Built by :func:`pair_accumulation`."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.own = trainer.training_step  # Hugging Face's, for a step of one micro-batch
        self.accelerator_backward = trainer.accelerator.backward
        trainer.accelerator.backward = self._keep  # what the forwards' training_step calls
        self._kept: _MicroBatch | None = None
        self._sharding = PairedSharding(trainer.model)
        self.loop = self._sharding.loop(
            self._backward, unpaired="pair_accumulation: the model made no mc2 call (no mc2 "
                                     "expert implementation), so nothing can be paired")

    def _keep(self, loss: Tensor, **kwargs: Any) -> None:
        """``accelerator.backward`` inside a forward: kept for the pairing to run."""
        self._kept = _MicroBatch(loss, kwargs)

    def _backward(self, micro_batch: _MicroBatch) -> None:
        self.accelerator_backward(micro_batch.loss, **micro_batch.backward)

    def _units_sync(self, on: bool) -> None:
        """The FSDP2 units' gradient sync: on before a step's first forward (what the held
        units return to for the last backward), off while they are held (``Trainer`` turns
        it back on after every call)."""
        for unit in fsdp_units(self.trainer.model):
            unit.set_requires_gradient_sync(on, recurse=False)

    def __call__(self, model: Any, inputs: dict[str, Any],
                 num_items_in_batch: Any = None) -> Tensor:
        trainer = self.trainer
        if isinstance(model, DistributedDataParallel):  # Trainer wraps it in train()
            raise ValueError(DDP)
        if trainer.args.gradient_accumulation_steps == 1:  # nothing to pair
            trainer.accelerator.backward = self.accelerator_backward
            try:
                return self.own(model, inputs, num_items_in_batch)
            finally:
                trainer.accelerator.backward = self._keep
        self.loop.of_step(trainer.state.global_step)  # a step left unfinished
        self._units_sync(not self.loop.taken)
        last = bool(trainer.accelerator.gradient_state.sync_gradients)

        def forward() -> _MicroBatch:  # Hugging Face's training_step, its backward kept
            logged = self.own(model, inputs, num_items_in_batch)
            kept, self._kept = self._kept, None
            if kept is None:
                raise RuntimeError("pair_accumulation: training_step made no "
                                   "accelerator.backward call (a training_step that runs "
                                   "loss.backward() itself cannot be paired)")
            kept.loss, kept.logged = self._sharding.finished(kept.loss), logged
            return kept

        return self.loop.add(forward, last=last).logged


def pair_accumulation(trainer: Any) -> PairedTrainingStep:
    """Make ``trainer``'s (a Hugging Face ``Trainer``) ``training_step`` the paired one;
    returns it.

    Raises:
        ValueError: what docs/huggingface.md lists (see :func:`_unpairable`); a model
            ``Trainer`` wraps in ``DistributedDataParallel`` is refused at the first step.
    """
    if (why := _unpairable(trainer)) is not None:
        raise ValueError(f"pair_accumulation: {why}")
    paired = PairedTrainingStep(trainer)
    trainer.training_step = paired
    trainer.add_callback(_EndsOpenSteps(paired))
    return paired


def _unpairable(trainer: Any) -> str | None:
    """Why ``trainer`` cannot be paired (docs/huggingface.md's refusals), or ``None``."""
    from transformers.trainer import DistributedType, OptimizerNames, is_sagemaker_mp_enabled

    args, accelerator = trainer.args, trainer.accelerator
    if accelerator.distributed_type == DistributedType.DEEPSPEED or is_sagemaker_mp_enabled():
        return "DeepSpeed and SageMaker model parallelism run their own backward"
    if isinstance(trainer.model_wrapped, DistributedDataParallel) or args.n_gpu > 1:
        return DDP.removeprefix("pair_accumulation: ")
    if trainer.is_fsdp_enabled and not getattr(accelerator, "is_fsdp2", False):
        return "FSDP1 prepares each backward in the forward before it (use FSDP2)"
    if trainer.model_init is not None:
        return ("model_init (and hyperparameter search) builds the model again in train(); "
                "pass the model itself")
    if args.optim in (OptimizerNames.LOMO, OptimizerNames.ADALOMO):
        return f"optim={args.optim.value} updates the weights inside the backward"
    parallelism = getattr(accelerator, "parallelism_config", None)
    if getattr(parallelism, "cp_enabled", False):
        return "context parallelism runs the backward inside its context (not paired)"
    config = getattr(trainer.model, "config", None)
    if getattr(getattr(config, "distributed_config", None), "dp_replicate_size", 1) > 1 or \
            getattr(parallelism, "dp_replicate_size", 1) > 1:
        return "replicated FSDP2 (dp_replicate_size above 1) is not paired (not tested)"
    return None


class _EndsOpenSteps(TrainerCallback):
    """A ``TrainerCallback`` that ends a step ``Trainer`` left before its last micro-batch
    (a callback or ``max_steps`` stopped the loop mid-step, or it raised between two calls),
    at the end of ``train()`` and at the start of the next: its units held gathered are
    let go, its pending backward dropped (a new step's first forward would be paired with
    it)."""

    def __init__(self, paired: PairedTrainingStep) -> None:
        super().__init__()
        self.paired = paired

    def _end(self) -> None:
        if self.paired.loop.taken:
            self.paired.loop.abandon("train() ended before the optimizer step's last "
                                     "micro-batch")

    def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
        self._end()

    def on_train_end(self, *args: Any, **kwargs: Any) -> None:
        self._end()
