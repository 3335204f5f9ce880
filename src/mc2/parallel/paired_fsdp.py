"""FSDP2 under a paired step: every unit held gathered, its gradients accumulated unsharded,
from the first forward to the last backward; the reduce-scatter once, in the last backward.

``mc2.forward_backward`` runs micro-batch n+1's forward inside micro-batch n's backward. FSDP2
(``fully_shard``) keeps one pass's state per unit, so the two passes meet in it:

- a unit whose backward began is in ``PRE_BACKWARD`` until the backward's final callback, and
  FSDP2 takes a forward it then sees for an activation-checkpoint recompute: it gathers the
  parameters if they are not, but registers no backward hooks for it;
- a unit's post-backward frees its parameters (``reshard_after_backward``) while the other
  pass may still read them, and its post-forward frees them (``reshard_after_forward``) for
  a backward that already ran;
- the reduce-scatter after each backward would reduce a gradient the paired forward's
  backward has not added to yet.

So, between the first forward and the last backward (:meth:`PairedSharding.held`), no unit frees
its parameters and none reduces its gradients (FSDP2's own switches,
``set_reshard_after_forward``, ``set_reshard_after_backward``, ``set_requires_gradient_sync``,
``set_is_last_backward``); each backward folds its gradients into the units' unsharded
accumulation, as FSDP2 does under ``set_requires_gradient_sync(False)``; the last backward,
run with the unit's own settings back, reduce-scatters the sum. A backward whose forward
registered no FSDP2 hook (a one-unit model, every unit already in its backward) still gets
FSDP2's end-of-backward callback (:meth:`PairedSharding.finished`), which runs the units'
post-backward: without it, the last micro-batch's gradients would never be reduced.

What this reads of FSDP2 beyond its public methods (this torch's ``_fully_shard``): a unit's
state (``_get_fsdp_state``), its lazy initialisation, its parameter groups' settings (saved
and put back as they were, the root's included), and its end-of-backward callback's
registration. A unit stays gathered for the whole step: its parameters take their unsharded
size until the last backward.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import Tensor, nn

from mc2.parallel.layer_gather import fsdp_units


def _roots(units: list[Any]) -> list[Any]:
    """The FSDP2 states that run as roots: the units no other unit contains (each lazily
    initialised now, as its first forward would, so that the settings saved are the ones
    the step runs with)."""
    inside = {id(m) for unit in units for m in unit.modules() if m is not unit}
    roots = [unit._get_fsdp_state() for unit in units if id(unit) not in inside]
    for state in roots:
        state._lazy_init()
    return roots


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
        states = list({id(s): s for s in (u._get_fsdp_state() for u in units)}.values())
        saved = [(state, state._auto_reshard_after_forward,
                  [(g, g.post_forward_mesh_info, g.reshard_after_backward, g.reduce_grads,
                    g.all_reduce_grads) for g in state._fsdp_param_groups])
                 for state in states]
        last = [(state, state._state_ctx.is_last_backward) for state in self._roots]
        try:
            for unit in units:
                unit.set_reshard_after_forward(False, recurse=False)
                unit.set_reshard_after_backward(False, recurse=False)
                unit.set_requires_gradient_sync(False, recurse=False)
            for state in self._roots:
                state._state_ctx.is_last_backward = False
            yield
        finally:
            for state, auto, groups in saved:
                state._auto_reshard_after_forward = auto
                for group, mesh, after_backward, reduce, all_reduce in groups:
                    group.post_forward_mesh_info = mesh
                    group.reshard_after_backward = after_backward
                    group.reduce_grads, group.all_reduce_grads = reduce, all_reduce
            for state, was in last:
                state._state_ctx.is_last_backward = was

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
