"""The shared experts of a call, where the pipeline has nothing else to compute.

Shared experts (DeepSeek, Qwen2-MoE) need no communication, so they are the one work that can
run where the pipeline would wait: before the first dispatch arrives (the fill) and while the
last combine travels (the drain).

* The forward computes the shared experts of the first half of the tokens under the fill and
  of the second half under the drain, into one output and one activation buffer: the forward's
  drain has nothing else to hide it. Measured at 200 Mbit (2 ranks, 2048 tokens, hidden 1024,
  ffn 2048, K = 2, ``benchmarks/shared_fill_drain.py``): the forward 0.09 s shorter than with
  all of them under the fill.
* The backward computes all of them under the fill: its drain already carries the routed
  experts' last weight gradients. Its weight gradients moved to the drain were measured 0.13 s
  past the last combine's arrival, while the fill waited 0.28 s with nothing to do.

Serial passes run the same parts at the same ends, so the arithmetic is the same in every
schedule.
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
        self.gate_up = ws.empty((tokens, 2 * weights.ffn), x.dtype, x.device)

    def _rows(self, start: int, stop: int) -> None:
        swiglu_forward(self.x[start:stop], [stop - start], self.weights,
                       strategy=self.call.strategy, keep_activations=False,
                       workspace=self.call.workspace,
                       out=(self.out[start:stop], self.gate_up[start:stop]))

    def fill(self) -> None:
        self._rows(0, self.cut)

    def drain(self) -> None:
        self._rows(self.cut, self.x.shape[0])
        self.result.shared_out = self.out
        if self.call.keep_activations:
            self.result.shared_activations = ExpertActivations(self.x, self.gate_up)


class SharedBackward:
    """The shared experts' input gradient (added into the call's ``grad x``) and their weight
    gradients, all under the fill (:meth:`fill`; see the module docstring).

    Args:
        grad_out: ``[T, H]`` the gradient of the call's output.
        scale: their ``[T, 1]`` per-token factor, or ``None``.
        saved: their forward activations (consumed).
        add_grad_x: adds ``[T, H]`` to the call's input gradient.
        grads: where the weight gradients go.
    """

    def __init__(self, grad_out: Tensor, scale: Tensor | None, saved: ExpertActivations,
                 weights: ExpertWeights, call: Any, add_grad_x: Callable[[Tensor], Any],
                 grads: WeightGrads) -> None:
        self.grad_out, self.scale, self.saved, self.weights = grad_out, scale, saved, weights
        self.call, self.add_grad_x, self.grads = call, add_grad_x, grads

    def fill(self) -> None:
        grad_y = self.grad_out
        if self.scale is not None:
            grad_y = torch.mul(grad_y, self.scale, out=self.call.workspace.empty(
                tuple(grad_y.shape), grad_y.dtype, grad_y.device))
        grad_in, work = swiglu_backward_input(
            grad_y, self.saved, [grad_y.shape[0]], self.weights, strategy=self.call.strategy,
            workspace=self.call.workspace)
        self.add_grad_x(grad_in)
        self.grads.add(work, strategy=self.call.strategy)
