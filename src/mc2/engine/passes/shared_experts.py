"""The shared experts of a call, where the pipeline has nothing else to compute.

Shared experts (DeepSeek, Qwen2-MoE) need no communication, so they are the one work that can
run where the pipeline would wait: before the first dispatch arrives (the fill) and while the
last combine travels (the drain).

* The forward computes the shared experts of the first half of the tokens under the fill and
  of the second half under the drain, into one output and one activation buffer: the forward's
  drain has nothing else to hide it.
* The backward computes all of them under the fill: its drain already carries the routed
  experts' last weight gradients, so weight gradients moved there ran past the last combine's
  arrival while the fill waited with nothing to do.

See docs/batch_overlap.md, 'Shared experts under the fill and the drain' (measured there).

Serial passes run the same parts at the same ends, so the arithmetic is the same in every
schedule. (Two GEMMs of half the rows each may round differently from one of all of them, as
any change of a GEMM's shape may: the results are deterministic, not bit-equal to an unsplit
shared MLP.)
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from mc2.engine.compute.experts import (
    ExpertActivations, ExpertWeights, WeightGrads, swiglu_backward_input,
    swiglu_forward
)
from mc2.engine.passes.pass_output import PassOutput


class SharedForward:
    """Writes ``result.shared_out [T, H]`` (and, kept for the backward, the activations): the
    first half of the tokens in :meth:`fill`, the second in :meth:`drain`."""

    def __init__(self, x: Tensor, weights: ExpertWeights, call: Any, result: PassOutput
                 ) -> None:
        self.x, self.weights, self.call, self.result = x, weights, call, result
        tokens, ws = x.shape[0], call.workspace
        self.cut = tokens // 2
        self.out = ws.empty((tokens, weights.hidden), x.dtype, x.device)
        # kept for the backward, so one buffer for both halves; without one, each half's own
        self.gate_up = ws.empty((tokens, 2 * weights.ffn), x.dtype, x.device) \
            if call.keep_activations else None

    def _rows(self, start: int, stop: int) -> None:
        gate_up = self.gate_up[start:stop] if self.gate_up is not None else None
        swiglu_forward(self.x[start:stop], [stop - start], self.weights,
                       strategy=self.call.strategy, keep_activations=False,
                       workspace=self.call.workspace, out=(self.out[start:stop], gate_up))

    def fill(self) -> None:
        self._rows(0, self.cut)

    def drain(self) -> None:
        self._rows(self.cut, self.x.shape[0])
        self.result.shared_out = self.out
        if self.gate_up is not None:
            self.result.shared_activations = ExpertActivations(self.x, self.gate_up)


def shared_backward(grad_out: Tensor, scale: Tensor | None, saved: ExpertActivations,
                    weights: ExpertWeights, call: Any, add_grad_x: Callable[[Tensor], Any],
                    grads: WeightGrads) -> Callable[[], None]:
    """The shared experts' input gradient (added into the call's ``grad x``) and their weight
    gradients, as the work to run under the fill (see the module docstring).

    Args:
        grad_out: ``[T, H]`` the gradient of the call's output.
        scale: their ``[T, 1]`` per-token factor, or ``None``.
        saved: their forward activations (consumed).
        add_grad_x: adds ``[T, H]`` to the call's input gradient.
        grads: where the weight gradients go.
    """
    def fill() -> None:
        grad_y = grad_out
        if scale is not None:
            grad_y = torch.mul(grad_y, scale, out=call.workspace.empty(
                tuple(grad_y.shape), grad_y.dtype, grad_y.device))
        grad_in, work = swiglu_backward_input(grad_y, saved, [grad_y.shape[0]], weights,
                                              strategy=call.strategy, workspace=call.workspace)
        add_grad_x(grad_in)
        grads.add(work, strategy=call.strategy)
    return fill
