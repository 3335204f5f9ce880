"""TorchTitan's gradient accumulation with one micro-batch's forward beside another's backward.

:func:`pair_accumulation` makes a built ``Trainer``'s ``fwd_bwd_fn`` a :class:`PairedFwdBwd`:
each call runs its micro-batch's forward beside the previous one's backward
(:class:`mc2.engine.autograd.pairing.PairedLoop`), and the step's last call also runs its own
backward alone, so the gradients are complete when ``train_step`` reads them. The
``mc2_paired_accumulation`` override reaches the trainer through the checkpoint manager
(:class:`PairedCheckpointManager`), the one configured component TorchTitan hands it, whose
``load`` is where ``train()`` begins: refusals raise there, on every rank, before the first step.

Each call returns its loss detached (the trainer only logs it); a step of one micro-batch runs
TorchTitan's own function. Context parallelism is refused only because it is untested.

See docs/torchtitan.md, 'Gradient accumulation: one micro-batch's forward beside another's
backward' (switching it on, what pairs, what is refused and why), and docs/forward_backward.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager
from torchtitan.config import derive, override

from mc2.parallel.paired_fsdp import PairedSharding


class PairedFwdBwd:
    """TorchTitan's ``fwd_bwd_fn`` for ``trainer``, each micro-batch's forward beside the
    previous one's backward (module docstring). Built by :func:`pair_accumulation`."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.alone = trainer.fwd_bwd_fn  # TorchTitan's own, for a step of one micro-batch
        self.model = trainer.model_parts[0]
        self._sharding = PairedSharding(self.model)
        self._step_tokens: Tensor | None = None  # train_step's global_valid_tokens of the step
        self.loop = self._sharding.loop(
            self._backward, unpaired="pair_accumulation: the model made no mc2 call (no mc2 "
                                     "override on its routed experts), so nothing can be paired")

    def _backward(self, loss: Tensor) -> None:
        import spmd_types

        # as TorchTitan's own backward: type-checking the backward only conflicts
        with self.trainer.train_context(), spmd_types.no_typecheck():
            loss.backward()

    def __call__(self, inputs: Tensor, labels: Tensor, global_valid_tokens: Tensor,
                 extra_kwargs: dict[str, Any]) -> Tensor:
        if self.trainer.gradient_accumulation_steps == 1:  # nothing to pair
            return self.alone(inputs, labels, global_valid_tokens, extra_kwargs)
        # a step left unfinished: by the step count, or by train_step's token count, made
        # once per step (a step retried under the same count, after a checkpoint load, is
        # another step: taken for the old one's rest, it trained on a mix, silently)
        tokens, self._step_tokens = self._step_tokens, global_valid_tokens
        if self.loop.taken and tokens is not global_valid_tokens:
            self.loop.abandon("a new step began (train_step's token count) after "
                              f"{self.loop.taken} micro-batches of the last")
        self.loop.of_step(getattr(self.trainer, "step", None))
        # the step's micro-batches so far (a step that failed ended: this begins another)
        last = self.loop.taken == self.trainer.gradient_accumulation_steps - 1

        def forward() -> Tensor:  # TorchTitan's _forward_backward_body up to its backward
            with self.trainer.train_context():
                pred = self.model(inputs, **extra_kwargs)
                loss_kwargs = ({"positions": extra_kwargs["positions"]}
                               if "positions" in extra_kwargs else {})
                loss, _ = self.trainer.loss_fn(pred, labels, global_valid_tokens, **loss_kwargs)
            return self._sharding.finished(loss)

        return self.loop.add(forward, last=last).detach()


def pair_accumulation(trainer: Any) -> PairedFwdBwd:
    """Make ``trainer``'s (a built TorchTitan ``Trainer``) ``fwd_bwd_fn`` the paired one;
    returns it.

    Raises:
        ValueError: pipeline parallelism, several model parts, CUDA graphs, a compiled
            model, memory-budget activation checkpointing, or ``ChunkedLossWrapper`` (why:
            docs/torchtitan.md).
    """
    from torchtitan.components.loss import ChunkedLossWrapper

    if trainer.parallel_dims.pp_enabled or len(trainer.model_parts) != 1:
        raise ValueError("pair_accumulation: pipeline parallelism runs its own micro-batch "
                         "schedule (parallelism.pipeline_parallel_degree must be 1)")
    if trainer.parallel_dims.cp_enabled:
        raise ValueError("pair_accumulation: context parallelism is not paired (untested: "
                         "parallelism.context_parallel_degree must be 1)")
    if not trainer.config.training.disable_cuda_graphs:
        raise ValueError("pair_accumulation: training.disable_cuda_graphs must be True (a "
                         "CUDA graph replays one whole forward and backward)")
    if (why := _runs_calls_whole(trainer.config)) is not None:
        raise ValueError(f"pair_accumulation: {why}, where each of mc2's calls runs whole as "
                         "one operator and cannot give way to another micro-batch: nothing "
                         "could be paired")
    if isinstance(trainer.loss_fn, ChunkedLossWrapper):
        raise ValueError("pair_accumulation: the loss is ChunkedLossWrapper, which runs "
                         "backwards inside the forward; use the plain cross-entropy loss")
    paired = PairedFwdBwd(trainer)
    trainer.fwd_bwd_fn = paired
    return paired


def _runs_calls_whole(config: Any) -> str | None:
    """Which field of a TorchTitan trainer's ``config`` makes the model's mc2 calls run whole,
    as the operator inside a compiled graph (:mod:`mc2.engine.autograd.operator`): a
    compiled model, or the memory-budget checkpointing policy (which compiles); ``None``
    where the calls run eagerly (selective checkpointing, TorchTitan's default, runs them
    as the operator too, but eagerly: they pair)."""
    from torchtitan.distributed.activation_checkpoint import MemoryBudgetAC

    ac = getattr(config, "activation_checkpoint", None)
    if isinstance(ac, MemoryBudgetAC.Config):
        return ("activation_checkpoint is MemoryBudgetAC.Config, which compiles the model "
                "(set 'selective', 'full' or 'none')")
    compile_config = getattr(config, "compile", None)
    if compile_config is not None and compile_config.enable and \
            "model" in compile_config.components:
        return "compile.enable compiles the model (leave 'model' out of compile.components)"
    return None


class PairedCheckpointManager(CheckpointManager):
    """TorchTitan's DCP checkpoint manager, unchanged, that also pairs its trainer's gradient
    accumulation: it keeps the trainer TorchTitan hands it (``states["train_state"]``, the
    only way a configured component reaches the trainer) and, at the first :meth:`load`
    (where ``Trainer.train`` begins, after ``fwd_bwd_fn`` is set), calls
    :func:`pair_accumulation` on it."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def __init__(self, config: Config, *, states: dict[str, Any], **kwargs: Any) -> None:
        self.trainer_to_pair = states.get("train_state")
        if self.trainer_to_pair is None:
            raise ValueError("mc2_paired_accumulation: the checkpoint manager was built without "
                             "the trainer (states['train_state']), as TorchTitan's Trainer "
                             "builds it; call pair_accumulation(trainer) instead")
        super().__init__(config, states=states, **kwargs)

    def load(self, step: int = -1) -> bool:
        trainer, self.trainer_to_pair = self.trainer_to_pair, None
        if trainer is not None:
            self._paired = pair_accumulation(trainer)
        paired = getattr(self, "_paired", None)
        if paired is not None:  # the model changes: a step still open cannot go on
            paired.loop.abandon("a checkpoint was loaded")
        return super().load(step)


@override(target=BaseCheckpointManager.Config,
          description="mc2: each micro-batch's forward beside the previous one's backward")
def mc2_paired_accumulation(cfg: BaseCheckpointManager.Config) -> PairedCheckpointManager.Config:
    """TorchTitan override factory: the checkpoint manager becomes
    :class:`PairedCheckpointManager`, its fields carried over by ``derive``. Another manager
    than TorchTitan's DCP one is refused (its behaviour would be lost), naming it."""
    if type(cfg) is not CheckpointManager.Config:
        raise ValueError(f"mc2_paired_accumulation: the checkpoint manager's config is "
                         f"{type(cfg).__qualname__}, not TorchTitan's CheckpointManager.Config "
                         f"this override extends; call pair_accumulation(trainer) instead")
    return derive(cfg, PairedCheckpointManager.Config)
