"""FSDP2's gathers for a schedule that runs decoder layers in parts (batch overlap).

``torch.distributed.fsdp.fully_shard`` gathers a unit's parameters in a forward pre-hook and
frees them in a forward post-hook, and gathers them again for the backward from a hook on the
forward's outputs. Batch overlap (:mod:`mc2.integrations.batch_overlap`) never calls a decoder
layer (or its experts module) as a whole: it runs the layer's parts for two micro-batches,
interleaved with the neighbouring layers. So the hooks do not fire, and the parts would meet
sharded parameters. :class:`LayerGathers` does what the hooks do, at the schedule's own points,
with FSDP2's public ``unshard``/``reshard``:

- before a layer's first part runs, its units are gathered (and the next layer's gather is
  issued, to travel under this layer's compute);
- once both micro-batches are through the layer, units built with ``reshard_after_forward``
  are freed again (always under ``no_grad``: nothing will come back for them);
- in the backward, the first gradient that reaches the layer's outputs gathers them again
  (FSDP2 reuses the same unsharded tensors, so what autograd saved is valid again), and issues
  the gather of the layer below, to travel under this layer's backward;
- the gradients are reduce-scattered, and the units resharded, by FSDP2 itself at the end of
  the backward (the root's final callback runs the post-backward of every unit whose own
  hooks did not), not layer by layer: that exchange is not overlapped with the backward.

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


def _frees_after_forward(unit: Any) -> bool:
    """Whether the unit was built with ``reshard_after_forward`` (FSDP2 keeps the setting on
    its parameter group; a unit without one holds nothing to free)."""
    group = getattr(unit._get_fsdp_state(), "_fsdp_param_group", None)
    return group is not None and bool(getattr(group, "_reshard_after_forward", True))


class LayerGathers:
    """The gathers of ``layers`` (each a decoder layer: its FSDP2 units, e.g. the layer and its
    experts module) for one pass of a schedule that runs them in parts, in order.

    Call :meth:`gather` before a layer's first part and :meth:`done` after its last (with the
    layer's outputs, so the backward can gather it again). Empty (``bool(gathers)`` false) when
    no layer is sharded.
    """

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.units = [fsdp_units(layer) for layer in layers]
        self._pending: dict[int, list[Any]] = {}  # forward gathers in flight, by layer
        self._freed: dict[int, list[Any]] = {}  # units freed after their forward, by layer
        self._backward: dict[int, list[Any]] = {}  # backward gathers in flight, by layer

    def __bool__(self) -> bool:
        return any(self.units)

    def _issue(self, index: int) -> None:
        if index < len(self.units) and index not in self._pending:
            self._pending[index] = [unit.unshard(async_op=True) for unit in self.units[index]]

    def gather(self, index: int) -> None:
        """Layer ``index``'s parameters, gathered; the next layer's gather issued."""
        self._issue(index)
        for handle in self._pending.pop(index):
            handle.wait()
        self._issue(index + 1)

    def done(self, index: int, outputs: Sequence[Tensor]) -> None:
        """Layer ``index`` is through its forward with ``outputs``: free what its units free
        after a forward, and gather it again when the backward reaches those outputs (issuing
        the gather of the layer below, the backward's next)."""
        units = self.units[index]
        if not units:
            return
        grad = [t for t in outputs if t.requires_grad]
        freed = [u for u in units if _frees_after_forward(u) or not grad]
        for unit in freed:
            unit.reshard()
        self._freed[index] = freed
        if grad and freed:
            torch.autograd.graph.register_multi_grad_hook(
                grad, partial(self._gather_for_backward, index), mode="any")

    def _gather_for_backward(self, index: int, _grads: Any) -> None:
        for handle in self._backward.pop(index, None) or [u.unshard(async_op=True)
                                                          for u in self._freed[index]]:
            handle.wait()
        below = index - 1
        if below >= 0 and self._freed.get(below) and below not in self._backward:
            self._backward[below] = [u.unshard(async_op=True) for u in self._freed[below]]
