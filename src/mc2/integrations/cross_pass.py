"""Cross-pass overlap: each micro-batch's forward runs inside the previous one's backward.

Every schedule whose backward begins after its forward has ended (``model(...).loss.backward()``
with or without batch overlap) is bounded by the *pass bound*, ``max(fwd comp, fwd comm) +
max(bwd comp, bwd comm)``: a forward with more communication than compute (a slow link: the
forward has a third of the compute and half of the All-to-All) leaves its excess exposed,
since no backward compute exists yet to hide it behind. :func:`train_step` runs the forward and
backward of a training step together, micro-batch by micro-batch::

    F0             the first micro-batch's forward alone (MC2 inside each layer)
    B0 | F1        F1 runs in stages at B0's stops: while B0's gradients travel, F1 computes
                   its attention and experts; while F1's dispatch and combine travel, B0
                   computes
    B1 | F2
    ...
    B(n-1)         the last backward alone (its calls split their rows in two, as MC2 inside
                   a layer does)

so one micro-batch's forward communication hides behind another's backward compute, across
the pass boundary (as 1F1B and DualPipe schedules do). The forward's stages are spread over
the backward's stops (:class:`_Pace`). Measured on the benchmark's 2-layer model it is not
shown faster than MC2 inside the layers (1.032 of it at 200 Mbit, 0.997 at 500 Mbit, in the
last sitting; 0.992 at 4 layers, where batch overlap is 0.916, ``docs/batch_overlap.md``).

Exact: the loss is the sum of the micro-batches' losses, each Hugging Face's causal-LM loss
over the *whole batch's* count of labelled tokens (``num_items_in_batch``), which is the
unsplit batch's mean; the gradients are those of ``model(ids, labels=labels).loss.backward()``
up to the order of the sums.

Refused, with the reason: the router's auxiliary loss (it couples every token's routing over
the whole batch, so no micro-batch's backward could begin before the last forward ended),
FSDP2 units on the decoder layers, and a step without autograd. Where a rank cannot split its
batch (fewer sequences than ``splits``, fewer tokens than ``min_tokens``), every rank runs the
plain step instead and says so once (:class:`~mc2.integrations.batch_overlap.BatchOverlapWarning`).
"""

from __future__ import annotations

from contextlib import nullcontext
import weakref
from typing import Any, Callable, ContextManager, Generator

import torch
from torch import Tensor, nn

from ..engine.fill import filling
from ..engine.staged import auto_micro_batches, micro_batch_label
from ..parallel.layer_gather import LayerGathers
from . import batch_overlap as bo

IGNORE_INDEX = -100  # Hugging Face's label of a token without a loss
# The last micro-batch's backward runs alone: its calls split their rows in two, as MC2 inside
# a layer does (measured at 200 Mbit, docs/batch_overlap.md: with one, cross-pass overlap was
# 17.51 s a step against in-layer MC2's 14.87 s; with two, 16.38 s against 17.14 s)
LAST_MICRO_BATCHES = 2


def train_step(model: nn.Module, input_ids: Tensor, *, labels: Tensor,
               attention_mask: Tensor | None = None, splits: int = 2,
               gradient_sync: Any = None, **model_kwargs: Any) -> Tensor:
    """One training step's forward and backward of a Hugging Face causal LM, with cross-pass
    overlap (module docstring); the step's loss, detached. The gradients are accumulated into
    the parameters' ``.grad`` as ``model(input_ids, labels=labels, ...).loss.backward()``
    would; the optimizer step is the caller's.

    Args:
        model: a model given ``enable_mc2(model, batch_overlap=True)`` (or ``"auto"``): its
            decoder layers are an :class:`~mc2.integrations.batch_overlap.OverlappedLayers`.
        input_ids, labels: ``[batch, seq]``; ``labels`` as for the model's own loss
            (``-100``: no loss).
        attention_mask: ``[batch, seq]`` or ``None``.
        splits: micro-batches (whole sequences, as even as they go).
        gradient_sync: your :class:`mc2.GradientSync`, if any: every micro-batch's backward
            but the last runs in its ``no_sync()``, so the gradients are averaged once, over
            the whole batch (call its ``wait()`` afterwards, as after a backward).
        model_kwargs: passed to every micro-batch's forward (tensors whose first dimension is
            the batch are split with it).

    Raises:
        ValueError: the model is not set up for it, or asks for what it cannot do (above).
    """
    layers = _overlapped_layers(model)
    _check(model, layers, input_ids, labels, attention_mask, model_kwargs)
    batch, seq = input_ids.shape[0], input_ids.shape[1]
    decision = bo.Decision(True, min_tokens=layers.decision.min_tokens,
                           group=layers.decision.group, splits=splits)
    if not decision.wanted(batch, batch * seq, input_ids.device):
        loss = model(input_ids, labels=labels, attention_mask=attention_mask, use_cache=False,
                     **model_kwargs).loss
        loss.backward()
        return loss.detach()
    sizes = bo.split_sizes(batch, splits)
    labelled = (labels[..., 1:] != IGNORE_INDEX).sum()  # the whole batch's, on the device
    pieces: dict[str, list[Any]] = {
        name: bo.split_value(value, batch, sizes)
        for name, value in {"input_ids": input_ids, "labels": labels,
                            "attention_mask": attention_mask, **model_kwargs}.items()}
    step = _Step(layers, input_ids.device.type, gradient_sync)
    total: Tensor | None = None
    with bo.running_layers(step.run_layers):
        for i in range(len(sizes)):
            step.label, step.last = i, i == len(sizes) - 1
            loss = model(**{name: values[i] for name, values in pieces.items()},
                         use_cache=False, num_items_in_batch=labelled).loss
            total = loss.detach() if total is None else total + loss.detach()
            step.pending = loss  # its backward runs inside the next forward's layers
    last, step.pending = step.pending, None
    assert last is not None and total is not None
    last.backward()
    return total


def _overlapped_layers(model: nn.Module) -> "bo.OverlappedLayers":
    found = [m for m in model.modules() if isinstance(m, bo.OverlappedLayers)]
    if len(found) != 1:
        raise ValueError("train_step: the model's decoder layers are not set up for it; call "
                         "enable_mc2(model, ..., batch_overlap=True) (or 'auto') first")
    return found[0]


def _check(model: nn.Module, layers: "bo.OverlappedLayers", input_ids: Tensor, labels: Tensor,
           attention_mask: Tensor | None, model_kwargs: dict[str, Any]) -> None:
    """Everything cross-pass overlap cannot do, refused alike on every rank (the model and the
    arguments' shapes are the same everywhere)."""
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False) or model_kwargs.get("output_router_logits"):
        raise ValueError(
            "train_step: the router's auxiliary loss (output_router_logits) couples every "
            "token's routing over the whole batch, so no micro-batch's backward could begin "
            "before the last forward ended; train with model(...).loss.backward() (batch "
            "overlap keeps it exact), or without the auxiliary loss")
    if LayerGathers(layers):
        raise ValueError("train_step: the decoder layers are FSDP2 units; cross-pass overlap "
                         "does not gather them (use model(...).loss.backward())")
    if not torch.is_grad_enabled():
        raise ValueError("train_step: gradients are disabled (torch.no_grad); it runs the "
                         "backward")
    if input_ids.dim() != 2 or labels.shape != input_ids.shape or (
            attention_mask is not None and attention_mask.shape != input_ids.shape):
        raise ValueError(f"train_step: input_ids, labels and attention_mask must be "
                         f"[batch, seq] alike, got {tuple(input_ids.shape)}, "
                         f"{tuple(labels.shape)} and "
                         f"{None if attention_mask is None else tuple(attention_mask.shape)}")
    for name in ("past_key_values", "cache", "use_cache", "num_items_in_batch"):
        if name in model_kwargs:
            raise ValueError(f"train_step: {name} is train_step's own to set (a training "
                             "step has no KV cache; the labelled tokens are counted over the "
                             "whole batch)")


class _Step:
    """The micro-batches of one step: the one whose backward is still to run, and how the
    next one's layers run."""

    def __init__(self, layers: nn.Module, device_type: str, gradient_sync: Any = None) -> None:
        self.layers = layers  # whose paces (_Pace) carry over from step to step
        self.pending: Tensor | None = None
        self.gradient_sync = gradient_sync
        self.label = 0
        self.last = False  # the step's last micro-batch: its backward runs alone
        # the caller's autocast, for forward stages run inside a backward (which runs none)
        self.autocast = (device_type, torch.is_autocast_enabled(device_type),
                         torch.get_autocast_dtype(device_type))

    def run_layers(self, layers: list[nn.Module], hidden_states: Tensor,
                   calls: list[tuple[tuple, dict[str, Any]]]) -> Tensor:
        """One micro-batch through the decoder layers (:func:`bo.running_layers`)."""
        if self.pending is None:  # the first: nothing to overlap with but itself
            return bo.run_in_turn(layers, hidden_states, calls)
        stages = _forward_stages(layers, calls, hidden_states, self.label, self.last)
        result: list[Tensor] = []
        device_type, enabled, dtype = self.autocast
        pace = _Pace.of(self.layers, self.label)

        def advance() -> bool:  # one stage of this forward, at a stop of the backward
            if result:
                return False
            with torch.enable_grad(), torch.autocast(device_type, dtype=dtype,
                                                     enabled=enabled):
                try:
                    next(stages)
                except StopIteration as stop:
                    result.append(stop.value)
            return True

        pending, self.pending = self.pending, None
        with filling(pace.spaced(advance)), self._accumulating():
            pending.backward()
        pace.finish(advance)
        return result[0]

    def _accumulating(self) -> ContextManager[None]:
        """An early micro-batch's backward: accumulated, not yet averaged over the ranks."""
        return self.gradient_sync.no_sync() if self.gradient_sync is not None else nullcontext()


class _Pace:
    """How many of a backward's stops to let pass between two stages of the forward filling it.

    A stage that follows an issue waits for that transfer; run at the very next stop, it waits
    for it in earnest, since the transfer is queued on the link behind the backward's own
    (measured in a trace at 200 Mbit: 1.54 s of a 16.2 s step, with every stage run in the
    first third of the backward and nothing to fill the rest). So the stages are spread over
    the backward's stops: one every ``stops // stages`` of the previous step's backward at the
    same place, every stop on the first. The count depends only on the call plans and the
    shapes, which every rank shares, so every rank issues its collectives in the same order.
    """

    _known: "weakref.WeakKeyDictionary[nn.Module, dict[int, _Pace]]" = \
        weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self.every = 1  # run a stage at every ``every``-th stop
        self.stops = 0  # this step's: the backward's stops
        self.stages = 0  # and the forward's stages

    @classmethod
    def of(cls, layers: nn.Module, label: int) -> "_Pace":
        """The pace of micro-batch ``label``'s forward in ``layers``, as last learned."""
        pace = cls._known.setdefault(layers, {}).setdefault(label, cls())
        pace.stops = pace.stages = 0
        return pace

    def spaced(self, advance: Callable[[], bool]) -> Callable[[], None]:
        """``advance`` (which says whether it ran a stage) at one stop of a backward in
        ``every``."""
        def at_stop() -> None:
            self.stops += 1
            if (self.stops - 1) % self.every == 0 and advance():
                self.stages += 1
        return at_stop

    def finish(self, advance: Callable[[], bool]) -> None:
        """After the backward: the stages it left, run now, then the pace for the next step
        learned from this one's counts."""
        while advance():
            self.stages += 1
        self.learn()

    def learn(self) -> None:
        """The pace for the next step: this one's stops over its stages."""
        self.every = max(1, self.stops // max(1, self.stages))


def _forward_stages(layers: list[nn.Module], calls: list[tuple[tuple, dict[str, Any]]],
                    h: Tensor, label: int, last: bool) -> Generator[None, None, Tensor]:
    """One micro-batch's forward through the layers, stopping after each issue (its dispatch,
    its combine) so that the backward it fills runs while they travel; the layers' output.
    ``last``: the step's last micro-batch, whose backward runs alone, so its calls overlap
    inside themselves (``LAST_MICRO_BATCHES``)."""
    for layer, (_, kwargs) in zip(layers, calls):
        rows = auto_micro_batches(LAST_MICRO_BATCHES) if last else nullcontext()
        with micro_batch_label(label), rows:
            stages = bo.hf_layer_stages(layer, h, kwargs=kwargs)
            call, done = bo.start_stages(stages)
        if call is None:
            h = done
            continue
        yield  # the dispatch travels
        call.experts()
        yield  # the combine travels
        with micro_batch_label(label):
            h = bo.finish_stages(stages, call)
    return h

