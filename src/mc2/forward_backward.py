"""``mc2.forward_backward``: gradient accumulation with one micro-batch's forward beside
another's backward.

Micro-batch n+1's forward runs inside micro-batch n's backward, layer by layer (the first
forward and the last backward alone), so the forward's exchanges hide under the backward's
compute and the other way round; how: :mod:`mc2.engine.autograd.pairing`. What pairs is the
model's eager mc2 calls. An FSDP2-sharded model pairs only with ``overlap=True``
(:mod:`mc2.parallel.paired_fsdp`): holding every unit gathered is a memory cost the caller
must ask for.

See docs/forward_backward.md, 'Where it runs, and what it refuses', and 'Measured'.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, TypeVar

import torch
from torch import Tensor, nn

from mc2.device.clock import clock_for
from mc2.engine.autograd.pairing import run_pairs, traced_step
from mc2.engine.autograd.staged import micro_batch_label
from mc2.engine.decide.batch_split import (
    MODE_CODES, BatchOverlapDecision, check_mode, mode_name, say_once)
from mc2.engine.transport.comm import group_key, host_ranges
from mc2.parallel.layer_gather import fsdp_units
from mc2.parallel.paired_fsdp import PairedSharding

__all__ = ["forward_backward"]

_DECISION = "_mc2_forward_backward"  # the model's "auto" decision, kept on the model
_UNPAIRABLE = "_mc2_unpairable"  # why a step of this model ran unpaired, kept on the model
T = TypeVar("T")


def forward_backward(model: nn.Module, micro_batches: Iterable[Any],
                     loss_fn: Callable[[nn.Module, Any], Tensor], *,
                     overlap: bool | str = "auto", group: Any = None) -> list[Tensor]:
    """Forward and backward of every micro-batch, gradients accumulated in each parameter's
    ``.grad`` as ``for mb in micro_batches: loss_fn(model, mb).backward()`` leaves them (to
    rounding); the detached losses, in order.

    Args:
        model: a model whose forward makes mc2 calls (docs/forward_backward.md: what pairs).
        micro_batches: what ``loss_fn`` takes, one per micro-batch.
        loss_fn: ``loss_fn(model, micro_batch)``, a scalar loss that requires a gradient.
        overlap: ``True`` (pair every forward after the first with the previous backward),
            ``False`` (the sequential loop), ``"auto"`` (measure both on the first calls, as
            batch overlap's ``"auto"`` does, and keep the faster: one call per step).
        group: where each step's micro-batch count and ``overlap`` are agreed, and
            ``"auto"``'s measurements (default: every rank; every rank of it must call).

    Raises:
        ValueError: a bad ``overlap``; a loss that is no scalar needing a gradient; with
            ``overlap=True``, a model that makes no mc2 call, or that FSDP (the first one,
            ``FullyShardedDataParallel``) or DistributedDataParallel wraps (every rank alike:
            every rank runs the same model). ``"auto"`` runs the sequential loop for those, and says so once.
    """
    check_mode(overlap, "overlap", "forward_backward")
    batches = list(micro_batches)
    if not torch.is_grad_enabled():
        raise ValueError("forward_backward: gradients are disabled (torch.no_grad); it runs "
                         "backwards")
    if overlap is not False and (why := _unpairable(model)) is not None:
        if overlap is True:
            raise ValueError(f"forward_backward(overlap=True): {why}; use overlap=False")
        say_once(why, "pairing one micro-batch's forward with another's backward")
        overlap = False
    if overlap == "auto" and fsdp_units(model):
        say_once("the model is sharded by FSDP2: a paired step holds every unit gathered from "
                 "its first forward to its last backward (mc2.parallel.paired_fsdp), which "
                 "'auto' does not try on its own; pass overlap=True to pair",
                 "pairing one micro-batch's forward with another's backward")
        overlap = False
    return decided_schedule(model, overlap, group, len(batches),
                            paired=lambda: _paired(model, batches, loss_fn, strict=overlap is True,
                                                   group=group),
                            sequential=lambda: _sequential(model, batches, loss_fn))


def _unpairable(model: nn.Module) -> str | None:
    """Why ``model`` cannot run one micro-batch's forward beside another's backward, or
    ``None``: wrappers whose hooks hold one pass's state at a time, a tracing mode, or a
    forward an earlier step found running autograd itself (kept on the model: its later
    steps run the sequential loop from the start)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if (why := traced_step()) is not None:
        return why
    if (why := model.__dict__.get(_UNPAIRABLE)) is not None:  # seen in an earlier step
        return why
    from torch.distributed._composable import replicate

    for kind, name in ((FullyShardedDataParallel, "FSDP (FullyShardedDataParallel)"),
                       (DistributedDataParallel, "DistributedDataParallel")):
        if any(isinstance(m, kind) for m in model.modules()):
            return (f"the model is wrapped by {name}, whose hooks prepare each backward in "
                    "the forward before it: the paired forward would run inside the other's "
                    "backward")
    if any(replicate.state(m) is not None for m in model.modules()):  # DDP kept on a state
        return ("the model is under torch's composable replicate() (DistributedDataParallel "
                "in its hooks), which prepares each backward in the forward before it: the "
                "paired forward would run inside the other's backward")
    return None


def decided_schedule(model: nn.Module, overlap: bool | str, group: Any, count: int, *,
                     paired: Callable[[], T], sequential: Callable[[], T],
                     agreed: bool = False) -> T:
    """``paired()`` or ``sequential()`` (one step of ``count`` micro-batches), as the model's
    decision for ``overlap`` says: ``True`` pairs, ``False`` does not, ``"auto"`` times its
    first steps both ways (agreed on ``group``) and keeps the faster. A framework's own
    accumulation loop (Megatron's) decides through this too.

    First every rank of ``group`` agrees ``count`` and ``overlap`` (host numbers, one
    ``all_reduce``): a rank with another count (an epoch's last step, shorter on some ranks)
    or another mode issues other collectives than its peers, so the step hung until the
    group's timeout paired, or, sequential, one rank's micro-batches silently joined another
    step. A ``ValueError`` on every rank names the difference instead (``agreed``: the
    caller agreed them already, :func:`agree_step`)."""
    if not agreed:
        agree_step(count, overlap, group)
    decision = _decision(model, overlap, group)
    pairs = count > 1 and decision.wanted(2, 1)
    run, trials = paired if pairs else sequential, decision.now()
    if trials.chosen is not None or trials.warming:
        return run()
    clock = clock_for(_device(model))
    start = clock.stamp()
    out = run()
    decision.measured(pairs, clock.elapsed(start, clock.stamp()), trials)
    return out


def agree_step(count: int, overlap: bool | str, group: Any) -> None:
    """Raise on every rank of ``group`` where its ranks differ in ``count`` or ``overlap``."""
    (fewest, most), (low, high) = host_ranges([count, MODE_CODES[overlap]], group, "pairing")
    if fewest != most:
        raise ValueError(f"forward_backward: ranks disagree on the number of micro-batches "
                         f"(between {int(fewest)} and {int(most)}); every rank must run "
                         "the same number in a step")
    if low != high:
        raise ValueError(f"forward_backward: ranks disagree on overlap (between "
                         f"{mode_name(low)} and {mode_name(high)}); every rank must "
                         "pass the same")


def _decision(model: nn.Module, overlap: bool | str, group: Any) -> BatchOverlapDecision:
    """The model's decision for ``overlap`` on ``group``, kept on the model per mode and
    group: ``"auto"`` measures across calls, and a call with ``overlap=True`` between them (a
    script that pairs one step by hand) must not restart its trials (it did: a Megatron
    benchmark that alternated the two re-ran the paired trials every round). Per group: a
    decision agrees on its own group, and one kept from a step on the world then met ranks
    outside a later step's group (a hang; found by a review)."""
    kept = model.__dict__.setdefault(_DECISION, {})
    key = (overlap, group_key(group))
    if key not in kept:
        kept[key] = BatchOverlapDecision(
            overlap, min_tokens=0, group=group, unit="step",
            what="pairing one micro-batch's forward with another's backward")
    return kept[key]


def kept_decision(model: nn.Module, overlap: bool | str, group: Any = None
                  ) -> BatchOverlapDecision | None:
    """What the model's steps decided for ``overlap`` on ``group`` (``None``: no step yet),
    for benchmarks and tests that report what ``"auto"`` chose."""
    return model.__dict__.get(_DECISION, {}).get((overlap, group_key(group)))


def _device(model: nn.Module) -> torch.device:
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def _loss(loss_fn: Callable[[nn.Module, Any], Tensor], model: nn.Module, batch: Any) -> Tensor:
    loss = loss_fn(model, batch)
    if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise ValueError("forward_backward: loss_fn(model, micro_batch) must return a scalar "
                         "tensor that requires a gradient")
    return loss


def _sequential(model: nn.Module, batches: list[Any], loss_fn: Any) -> list[Tensor]:
    losses = []
    for batch in batches:
        loss = _loss(loss_fn, model, batch)
        loss.backward()
        losses.append(loss.detach())
    return losses


def _paired(model: nn.Module, batches: list[Any], loss_fn: Any, *, strict: bool,
            group: Any) -> list[Tensor]:
    """Micro-batch n+1's forward beside n's backward (:func:`run_pairs`; ``strict``: a
    forward that cannot be paired is refused, not run unpaired, agreed on ``group``)."""
    sharding = PairedSharding(model)  # FSDP2's units: gathered for the step

    def forward(i: int) -> Tensor:
        with micro_batch_label(i):  # its calls' spans, under its micro-batch in a trace
            return sharding.finished(_loss(loss_fn, model, batches[i]))

    return run_pairs(len(batches), forward, lambda loss: loss.backward(), around=sharding.held,
                     kept=lambda loss: loss.detach(), failed=sharding.discard, strict=strict,
                     group=group, alone=lambda why: model.__dict__.__setitem__(_UNPAIRABLE, why),
                     unpaired="forward_backward(overlap=True): the model's forward made no "
                              "mc2 call, so nothing can be paired; switch mc2 on in the model "
                              "(enable_mc2, mc2.MoELayer, ep_implementation='mc2') or pass "
                              "overlap=False")
