"""A fused call in three stages, so that other work can run at its two waits.

Batch overlap (:mod:`mc2.integrations.batch_overlap`) splits a batch into two micro-batches and
runs the decoder layers stage by stage: while micro-batch A's dispatch travels, B computes its
attention; while B's dispatch travels, A computes its experts; and so on. The fused call of one
micro-batch must then stop where it would wait. Here it is three autograd Functions over one
state, each running the pass (:func:`~mc2.engine.autograd.function.forward_stages`) up to its next wait:

====================  ==================================  =========================================
stage                 forward                             backward
====================  ==================================  =========================================
``begin`` (dispatch)  plan, gather, issue the dispatch,   the weight gradients (while the other
                      shared experts under it             micro-batch's transfers travel), wait
                                                          for the gradients' combine, scatter
                                                          them into ``grad x``
``experts``           wait, experts, issue the combine    wait for the gradients' dispatch, expert
                                                          backward, issue their combine
``end`` (combine)     wait, scatter, weighted top-k sum   routing-weight gradient, gather, issue
                                                          the gradients' dispatch, shared experts
====================  ==================================  =========================================

The three are chained by empty tensors, so autograd runs their backwards in reverse; between
them it runs whatever else is ready, by the order the forward created it: with two micro-batches
interleaved stage by stage, the backward interleaves too, and each gradient exchange travels
while the other micro-batch computes. A call runs ``K = 1`` by default (``micro_batches="auto"``):
the other micro-batch of the batch provides the overlap. An explicit ``K`` splits each half
again: the experts stage then runs every micro-batch's experts up to the first combine wait,
so the first dispatch and the last combine of a pass (batch overlap's fill and drain) carry a
K-th of the rows, for K times the messages (an earlier sitting measured it no faster at
200 Mbit). ``"auto"``'s trials time whole passes, which a staged call never
runs alone, so they do not apply here.

The activations stay in the state between forward and backward (not ``save_for_backward``).
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generator, Iterator

import torch
from torch import Tensor

from mc2.observation.profiler import active_timeline
from mc2.engine.decide.call_plan import plan_call
from mc2.engine.decide.config import MC2Config
from mc2.engine.transport.deadline import deadline, resolve_timeout
from mc2.engine.compute.experts import ExpertWeights
from mc2.engine.autograd.function import (
    CallPlan,
    _Forward,
    _shared_weights,
    _weighted_sum,
    backward_stages,
    combine_grads,
    forward_stages,
)
from mc2.engine.autograd.ops import function_inputs, guarded


def _advance(stages: Generator[str, None, Any]) -> tuple[str | None, Any]:
    """Run to the next stop: ``(its name, None)``, or ``(None, the pass's result)`` at the
    end."""
    try:
        return next(stages), None
    except StopIteration as stop:
        return None, stop.value


@dataclass
class _State:
    """One staged call, from its plan to its last backward stage."""

    call: CallPlan
    weights: ExpertWeights
    shared: ExpertWeights | None
    shape: torch.Size
    seconds: float | None
    needs_experts: tuple[bool, ...] = ()
    needs_shared: tuple[bool, ...] = ()
    forward: Generator[str, None, _Forward] | None = None
    forward_result: _Forward | None = None
    backward: Generator[str, None, Any] | None = None
    backward_result: Any = None
    saved: dict[str, Any] = field(default_factory=dict)

    def step_forward(self, through: str | None = None) -> None:
        """Run the forward pass to its next stop (or its end); with ``through``, on past
        every stop of that name."""
        while self.forward_result is None:
            stop, self.forward_result = self._advanced(self.forward)
            if stop != through:
                return

    def step_backward(self, through: str | None = None) -> None:
        """Run the backward pass to its next stop (or its end), as :meth:`step_forward`."""
        while self.backward_result is None:
            stop, self.backward_result = self._advanced(self.backward)
            if stop != through:
                return

    def _advanced(self, stages: Generator[str, None, Any] | None) -> tuple[str | None, Any]:
        """:func:`_advance` under the call's deadline, autocast off (its GEMMs write into
        buffers of the call's dtype)."""
        if stages is None:  # a stage run out of order: a bug, never a silent loop
            raise RuntimeError("mc2 staged call: a stage ran before the one it follows")
        with deadline(self.seconds), torch.autocast(self.weights.device.type, enabled=False):
            return _advance(stages)


def _token(like: Tensor) -> Tensor:
    return like.new_empty(0)


class _Begin(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, state: _State, *weights: Tensor) -> Tensor:  # type: ignore[override]
        ctx.state = state
        state.needs_shared = tuple(ctx.needs_input_grad[2:5]) if state.shared is not None \
            else ()
        state.needs_experts = tuple(ctx.needs_input_grad[2 + 3 * (state.shared is not None):])
        flat = x.reshape(-1, x.shape[-1])
        state.forward = forward_stages(flat, state.weights, state.shared, state.call)
        state.saved["x"] = flat
        state.step_forward()
        return _token(x)

    @staticmethod
    def backward(ctx: Any, _: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        state: _State = ctx.state
        while state.backward_result is None:
            state.step_backward()
        grad_x, expert_grads, shared_grads = state.backward_result
        state.call.workspace.tick()
        ctx.state = None
        shared = tuple(shared_grads) if state.shared is not None else ()
        return (grad_x.view(state.shape), None, *shared, *expert_grads)


class _Experts(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, token: Tensor, state: _State) -> Tensor:  # type: ignore[override]
        ctx.state = state
        state.step_forward(through="dispatch")  # every micro-batch's experts, up to a combine
        return _token(token)

    @staticmethod
    def backward(ctx: Any, _: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        ctx.state.step_backward(through="dispatch")
        return _token(_), None


class _End(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, token: Tensor, routing_weights: Tensor, s_scale: Tensor | None,
                state: _State) -> Tensor:  # type: ignore[override]
        ctx.state = state
        while state.forward_result is None:
            state.step_forward()
        result = state.forward_result
        flat = state.saved["x"]
        out = _weighted_sum(result, routing_weights, state.call, flat, state.shape, s_scale)
        if state.call.keep_activations:
            state.saved.update(routing_weights=routing_weights, scale=s_scale)
        else:
            state.saved.clear()
            state.forward_result = None
            state.call.workspace.tick()
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        state: _State = ctx.state
        call, result = state.call, state.forward_result
        grad_out = grad_out.contiguous().view(-1, grad_out.shape[-1])
        routing_weights, scale = state.saved["routing_weights"], state.saved["scale"]
        grad_weights, grad_scale = combine_grads(call, grad_out, result.expert_out,
                                                 result.shared_out, *ctx.needs_input_grad[1:3])
        state.backward = backward_stages(
            grad_out, routing_weights, state.weights, state.shared, result.activations,
            result.shared_activations, call, state.needs_experts, state.needs_shared, scale)
        state.forward_result, state.saved = None, {}
        state.step_backward()
        return _token(grad_out), grad_weights, grad_scale, None


class StagedCall:
    """A fused call of one micro-batch, run as :meth:`experts` and :meth:`end` after its
    :func:`begin`; call them in that order, once each."""

    def __init__(self, token: Tensor, state: _State, combine: Tensor,
                 scale: Tensor | None) -> None:
        self._token, self._state, self._combine, self._scale = token, state, combine, scale

    def experts(self) -> None:
        """Wait for the dispatch, run the experts, issue the combine."""
        self._token = _Experts.apply(self._token, self._state)

    def end(self) -> Tensor:
        """Wait for the combine; the output, shaped like the input."""
        return _End.apply(self._token, self._combine, self._scale, self._state)


_LABEL: contextvars.ContextVar[int] = contextvars.ContextVar("mc2_staged_micro_batch", default=0)


@contextmanager
def micro_batch_label(label: int) -> Iterator[None]:
    """Calls begun inside file their spans under micro-batch ``label`` (batch overlap's two
    micro-batches are 0 and 1, so a trace shows both of every layer)."""
    token = _LABEL.set(label)
    try:
        yield
    finally:
        _LABEL.reset(token)


class _Labelled:
    """A timeline that files every span under one micro-batch label."""

    def __init__(self, timeline: Any, label: int) -> None:
        self._timeline, self._label = timeline, label

    def __getattr__(self, name: str) -> Any:
        return getattr(self._timeline, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:  # e.g. sync_fallback: the timeline's, not the label's
            setattr(self._timeline, name, value)

    def span(self, kind: Any, name: str, phase: str, micro_batch: int = -1) -> Any:
        return self._timeline.span(kind, name, phase, self._label)

    def add(self, kind: Any, name: str, phase: str, micro_batch: int, start: Any,
            end: Any) -> None:
        self._timeline.add(kind, name, phase, self._label, start, end)

    def mark(self, kind: Any, name: str, phase: str, micro_batch: int = -1) -> None:
        self._timeline.mark(kind, name, phase, self._label)


def begin_packed(x: Tensor, gate_up: Tensor, down: Tensor, expert_ids: Tensor,
                 routing_weights: Tensor, *, group: Any, config: MC2Config,
                 shared: tuple[Tensor | None, Tensor | None, Tensor | None] = (None, None, None),
                 shared_scale: Tensor | None = None) -> StagedCall:
    """Plan a :func:`mc2.fused_expert_packed` call and issue its dispatch (``K = 1`` unless
    ``config`` sets it); see the module docstring. Planning runs the handshake and the counts exchange
    now, as every call does."""
    if any(type(t).__name__ == "DTensor" for t in (gate_up, down)):
        raise ValueError("mc2 staged call: the experts' parameters are FSDP2 shards; gather "
                         "them first (batch overlap does, for the decoder layers it runs: "
                         "mc2.parallel.layer_gather.LayerGathers)")
    if config.micro_batches == "auto":  # the other micro-batch of the batch gives the overlap
        config = config.replace(micro_batches=1)
    seconds = resolve_timeout(config.timeout)
    named = {"weights_gate_up": gate_up, "weights_down": down}
    full_shared = (*shared, shared_scale)
    timeline = active_timeline()
    if timeline is not None:
        timeline = _Labelled(timeline, _LABEL.get())
    call, weights, combine = guarded(
        lambda: plan_call(x, named, expert_ids, routing_weights, config=config, packed=True,
                          group=group, shared=full_shared, timeout=seconds, timeline=timeline),
        config, x)
    _, (s_up, s_gate, s_down, s_scale) = function_inputs(x, expert_ids, None, full_shared)
    state = _State(call, weights, _shared_weights(s_up, s_gate, s_down), x.shape, seconds)
    shared_tensors = (s_up, s_gate, s_down) if s_up is not None else ()
    token = _Begin.apply(x, state, *shared_tensors, *weights.tensors())
    return StagedCall(token, state, combine, s_scale)
