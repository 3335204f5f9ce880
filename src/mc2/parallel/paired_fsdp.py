"""FSDP2 under a paired step: every unit held gathered, its gradients accumulated unsharded,
from the first forward to the last backward; the reduce-scatter once, in the last backward.

FSDP2 keeps one pass's state per unit, so micro-batch n+1's forward inside micro-batch n's
backward meets n's state: a forward in a unit whose backward began is taken for a recompute
(no backward hooks), a post-backward frees parameters the other pass reads, and a
reduce-scatter after each backward would reduce a gradient the paired forward's backward has
not added to yet. So while :meth:`PairedSharding.held`, each parameter group's ``reshard`` does
nothing (a switch such as ``set_reshard_after_forward(False)`` is not enough: a post-forward after
the other pass's end-of-backward callback reshards whatever it says), gradient sync and
``is_last_backward`` are off, and :meth:`PairedSharding.finished` queues FSDP2's end-of-backward
callback for a backward no hook would finish. See docs/forward_backward.md, 'Where it runs,
and what it refuses' (FSDP2: the costs, a failed step's recovery, tied units).

What this reads of FSDP2 beyond its public methods (this torch's ``_fully_shard``): a unit's
state (``_get_fsdp_state``), its lazy initialisation (run here for the units no other unit
contains, as their first forward would: a model handed in that is a submodule of the real root
would make an inner unit the root), its parameter groups (``reshard``, ``reduce_grads``,
``all_reduce_grads``, put back as they were), ``is_last_backward``, its end-of-backward
callback's registration, and after a failed step its recovery (``_reset_iter_state``, what
``reset_iter_state`` runs) and each parameter's unsharded gradients (dropped).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import Tensor, nn

from mc2.engine.autograd.pairing import PairedLoop
from mc2.engine.transport.deadline import CommTimeout
from mc2.parallel.layer_gather import fsdp_units, param_groups


def _kept_gathered() -> None:
    """A parameter group's ``reshard`` while the step holds it gathered."""


def _roots(units: list[Any]) -> list[Any]:
    """The FSDP2 states that run as roots: the units no other unit contains (each lazily
    initialised now, as its first forward would, so that the settings saved are the ones
    the step runs with)."""
    inside = {id(m) for unit in units for m in unit.modules() if m is not unit}
    roots = [unit._get_fsdp_state() for unit in units if id(unit) not in inside]
    for state in roots:
        state._lazy_init()
    return roots


def _groups(units: list[Any]) -> list[Any]:
    """The units' parameter groups, each once, though several modules share it
    (``fully_shard([a, b])``)."""
    return list({id(g): g for unit in units for g in param_groups(unit)}.values())


def _discard_step(roots: list[Any], groups: list[Any]) -> None:
    """After a failed step: FSDP2's own recovery (its roots' ``reset_iter_state``: every
    group resharded, its per-step state cleared; each group's part of it where a unit here
    is not FSDP2's root, the model handed in being inside the real one), and the gradients
    the step accumulated unsharded dropped, which that recovery keeps. Kept, they would join
    the next step's reduce-scatter, silently: a training loop clears the sharded gradients
    its optimizer holds, never these (measured: the next step's gradients off by their
    whole size)."""
    if all(state._is_root for state in roots):
        for state in roots:
            state._reset_iter_state()
    else:
        for group in groups:
            group._reset_iter_state()
    for group in groups:
        for param in group.fsdp_params:
            param.unsharded_accumulated_grad = None
            if hasattr(param, "_unsharded_param"):
                param._unsharded_param.grad = None


class PairedSharding:
    """FSDP2 for one model's paired steps: :meth:`held` around the step (every unit gathered,
    none reducing, from the first forward to the last backward), :meth:`finished` on each
    micro-batch's loss (its backward runs FSDP2's end-of-backward callback). Nothing where
    the model holds no FSDP2 unit."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._roots: list[Any] = []

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Every FSDP2 unit of the model gathered and not reducing while the block runs;
        each unit's settings as they were after it."""
        units = fsdp_units(self.model)
        if not units:
            yield
            return
        self._roots = _roots(units)
        groups = _groups(units)
        saved = [(g, g.reduce_grads, g.all_reduce_grads) for g in groups]
        last = [(state, state._state_ctx.is_last_backward) for state in self._roots]
        try:
            for unit in units:
                unit.set_requires_gradient_sync(False, recurse=False)
            for group in groups:  # no reshard at all, whichever pass's hook asks (docstring)
                group.reshard = _kept_gathered
            for state in self._roots:
                state._state_ctx.is_last_backward = False
            yield
        finally:
            for group, reduce, all_reduce in saved:
                group.__dict__.pop("reshard", None)
                group.reduce_grads, group.all_reduce_grads = reduce, all_reduce
            for state, was in last:
                state._state_ctx.is_last_backward = was

    def loop(self, backward: Any, unpaired: str) -> PairedLoop:
        """A framework's paired loop over this model: each step inside :meth:`held`, what a
        failed step left discarded (:meth:`discard`)."""
        return PairedLoop(backward, around=self.held, failed=self.discard, unpaired=unpaired)

    def discard(self, failure: BaseException) -> None:
        """After a failed step (wherever it failed, the last backward included): what it
        left (:func:`_discard_step`). A step whose group timed out or lost a peer is left
        as it is: FSDP2's recovery would wait for a gather that peer never joins."""
        units = fsdp_units(self.model)
        if not units or isinstance(failure, CommTimeout):
            return
        _discard_step(self._roots, _groups(units))

    def finished(self, loss: Tensor) -> Tensor:
        """``loss``, whose backward runs FSDP2's end-of-backward callback of each root
        whatever the forward registered (queued once per backward, as FSDP2's own
        pre-backward hook does: where one did, this adds nothing)."""
        roots = self._roots
        if roots and loss.requires_grad:
            def queue(grad: Tensor) -> Tensor:
                for state in roots:
                    state._register_root_post_backward_final_callback()
                return grad

            loss.register_hook(queue)
        return loss
