"""FSDP2's gathers for a schedule that runs decoder layers in parts (batch overlap).

``torch.distributed.fsdp.fully_shard`` gathers a unit's parameters in a forward pre-hook and
frees them in a forward post-hook, gathers them again for the backward from a hook on the
forward's outputs, and reduce-scatters the unit's gradients (and frees its parameters again)
from a hook on the forward's inputs, once the backward through the unit is done. Batch overlap
(:mod:`mc2.integrations.batch_overlap`) never calls a decoder layer (or its experts module) as
a whole: it runs the layer's parts for two micro-batches, interleaved with the neighbouring
layers. So the hooks do not fire, and the parts would meet sharded parameters.
:class:`LayerGathers` does what the hooks do, at the schedule's own points, with FSDP2's
``unshard``/``reshard`` and its parameter groups' ``post_backward``:

- before a layer's first part runs, its units are gathered; the next layer's gather is issued
  once the layer below is freed (so at most two layers hold gathered parameters, the one
  running and the one whose gather travels under it);
- once both micro-batches are through the layer, units built with ``reshard_after_forward``
  are freed again (always under ``no_grad``: nothing will come back for them);
- in the backward, the first gradient that reaches the layer's outputs gathers them again
  (FSDP2 reuses the same unsharded tensors, so what autograd saved is valid again);
- once the gradients of every micro-batch's outputs of a layer are complete, the backward of
  the layer above is done for both micro-batches: that layer's units run FSDP2's
  post-backward (gradients reduce-scattered, or accumulated under
  ``set_requires_gradient_sync(False)``; parameters resharded unless
  ``set_reshard_after_backward(False)``), and the gather of the layer below this one is
  issued, to travel under this layer's backward. So the backward too holds at most two layers
  gathered, and each reduce-scatter travels under the backward of the layers below;
- the first layer's inputs are not the runner's to give, so its post-backward is FSDP2's own
  end-of-backward callback (with the root's), right after the embedding's backward: as late
  as plain FSDP2 runs it, give or take that backward.

Nothing here communicates by hand: every collective is FSDP2's own all-gather or
reduce-scatter, issued in the same order on every rank (the schedule is the same everywhere).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Sequence

import torch
from torch import Tensor, nn


def fsdp_units(module: nn.Module) -> list[Any]:
    """The FSDP2 units in ``module`` (itself included), outermost first."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def param_groups(unit: Any) -> list[Any]:
    """The unit's FSDP2 parameter groups (one, unless it mixes meshes)."""
    return list(getattr(unit._get_fsdp_state(), "_fsdp_param_groups", ()))


def _frees_after_forward(unit: Any) -> bool:
    """Whether the unit was built with ``reshard_after_forward`` (FSDP2 keeps the setting on
    its parameter group; a unit without one holds nothing to free)."""
    groups = param_groups(unit)
    return bool(groups) and all(bool(getattr(g, "_reshard_after_forward", True))
                                for g in groups)


class LayerGathers:
    """The gathers of ``layers`` (each a decoder layer: its FSDP2 units, e.g. the layer and its
    experts module) for one pass of a schedule that runs them in parts, in order.

    Call :meth:`gather` before a layer's first part and :meth:`done` after its last (with the
    layer's outputs, so the backward can gather it again and finish the layer above). Empty
    (``bool(gathers)`` false) when no layer is sharded.
    """

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.units = [fsdp_units(layer) for layer in layers]
        self._pending: dict[int, list[Any]] = {}  # forward gathers in flight, by layer
        self._held: set[int] = set()  # gathered in the forward, not yet done
        self._backward: dict[int, list[Any]] = {}  # backward gathers in flight, by layer

    def __bool__(self) -> bool:
        return any(self.units)

    def _issue(self, index: int) -> None:
        if index < len(self.units) and index not in self._pending:
            self._pending[index] = [unit.unshard(async_op=True) for unit in self.units[index]]

    def gather(self, index: int) -> None:
        """Layer ``index``'s parameters, gathered; the next layer's gather issued if the layer
        below is done (else :meth:`done` issues it)."""
        self._issue(index)
        for handle in self._pending.pop(index):
            handle.wait()
        self._held.add(index)
        if index - 1 not in self._held:
            self._issue(index + 1)

    def done(self, index: int, outputs: Sequence[Tensor]) -> None:
        """Layer ``index`` is through its forward with ``outputs``: free what its units free
        after a forward (and issue the gather of the layer after next, if the next one is
        gathered); in the backward, gather it again when the first gradient reaches those
        outputs, and finish the layer above once all of them have theirs."""
        self._held.discard(index)
        grad = [t for t in outputs if t.requires_grad]
        for unit in self.units[index]:
            if _frees_after_forward(unit) or not grad:
                unit.reshard()
        if index + 1 in self._held:
            self._issue(index + 2)
        if not grad:
            return
        if self.units[index]:
            torch.autograd.graph.register_multi_grad_hook(
                grad, partial(self._backward_reaches, index), mode="any")
        if index + 1 < len(self.units) and self.units[index + 1]:
            torch.autograd.graph.register_multi_grad_hook(
                grad, partial(self._backward_through, index + 1), mode="all")

    def _prefetch(self, index: int) -> None:
        if index >= 0 and self.units[index] and index not in self._backward:
            self._backward[index] = [u.unshard(async_op=True) for u in self.units[index]]

    def _backward_reaches(self, index: int, _grad: Any) -> None:
        """The first gradient reached layer ``index``'s outputs: gather it (the top layer
        also issues the gather of the one below; the others leave that to the layer above
        being done)."""
        for handle in self._backward.pop(index, None) or \
                [u.unshard(async_op=True) for u in self.units[index]]:
            handle.wait()
        if index + 1 == len(self.units):
            self._prefetch(index - 1)

    def _backward_through(self, index: int, _grads: Any) -> None:
        """Every micro-batch's backward through layer ``index`` is done (the gradients of
        the layer below's outputs are complete): FSDP2's post-backward of its units (outermost
        first, the same order on every rank), then the gather of the layer two below."""
        for unit in self.units[index]:
            for group in reversed(param_groups(unit)):  # as FSDP2's final callback
                group.post_backward()
        self._prefetch(index - 2)
