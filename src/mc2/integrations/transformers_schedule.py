"""Hugging Face ``Trainer``'s gradient accumulation with one micro-batch's forward beside
another's backward.

``Trainer`` calls ``self.training_step(model, inputs, num_items_in_batch)`` once per
micro-batch (``gradient_accumulation_steps`` calls an optimizer step), and reads the
gradients only after the last, to clip them and step the optimizer; before each call it
tells the accelerator whether this is the step's last (``gradient_state.sync_gradients``).
:func:`pair_accumulation` makes ``training_step`` a :class:`PairedTrainingStep`: each call
runs Hugging Face's own ``training_step`` as the micro-batch's forward, its
``accelerator.backward`` call kept instead of run, beside the previous micro-batch's kept
backward (:class:`mc2.engine.autograd.pairing.PairedLoop`); the step's last call also runs its
own backward alone, so the gradients are complete when the loop reads them::

    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    pair_accumulation(trainer)  # from mc2.integrations.transformers_schedule
    trainer.train()

What pairs are the model's mc2 calls (``ep_implementation="mc2"``, or ``enable_mc2``).
A model sharded at load time with FSDP2 (``DistributedConfig(fsdp_size=...)``) has its units
held gathered from the step's first forward to its last backward, which alone
reduce-scatters (:mod:`mc2.parallel.paired_fsdp`); ``Trainer`` turns the units' gradient sync
off around each call but the last and on after it, which the pairing overrides while it
holds them (a backward runs one call later than ``Trainer`` expects).

**Refused** (``ValueError``, every rank alike): a model ``Trainer`` wraps in
``DistributedDataParallel`` (its hooks prepare each backward in the forward before it; raised
at the first step, where ``Trainer`` has wrapped it), and from :func:`pair_accumulation`
DeepSpeed and SageMaker model parallelism (their own backward), and
replicated FSDP2 (``dp_replicate_size`` above 1: not tested).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from mc2.engine.autograd.pairing import PairedLoop
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
        self._step: Any = None  # the optimizer step the open micro-batches belong to
        self._sharding = PairedSharding(trainer.model)
        self.loop = PairedLoop(self._backward, around=self._sharding.held,
                               failed=self._sharding.discard,
                               unpaired="pair_accumulation: the model made no mc2 call (no "
                                        "mc2 expert implementation), so nothing can be paired")

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
        step = trainer.state.global_step
        if self.loop.taken and step != self._step:
            self.loop.abandon(f"optimizer step {self._step} was left after {self.loop.taken} "
                              "micro-batches")
        if not self.loop.taken:
            self._step = step
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
        ValueError: DeepSpeed, SageMaker model parallelism, or replicated FSDP2 (module
            docstring); a model ``Trainer`` wraps in ``DistributedDataParallel`` is refused at
            the first step.
    """
    from transformers.trainer import DistributedType, is_sagemaker_mp_enabled

    if trainer.accelerator.distributed_type == DistributedType.DEEPSPEED or \
            is_sagemaker_mp_enabled():
        raise ValueError("pair_accumulation: DeepSpeed and SageMaker model parallelism run "
                         "their own backward")
    if isinstance(trainer.model_wrapped, DistributedDataParallel):
        raise ValueError(DDP)
    distributed = getattr(trainer.model.config, "distributed_config", None)
    if getattr(distributed, "dp_replicate_size", 1) > 1:
        raise ValueError("pair_accumulation: replicated FSDP2 (dp_replicate_size above 1) is "
                         "not paired (not tested)")
    paired = PairedTrainingStep(trainer)
    trainer.training_step = paired
    return paired
