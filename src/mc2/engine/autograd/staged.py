"""A fused call in three stages, so that other work can run at its two waits.

Batch overlap (:mod:`mc2.integrations.batch_overlap`) splits a batch into two micro-batches and
runs the decoder layers stage by stage: while micro-batch A's dispatch travels, B computes its
attention; while B's dispatch travels, A computes its experts; and so on. The fused call of one
micro-batch must then stop where it would wait. Here the call is an object of six plain steps
(:class:`_Steps`: each runs its pass, :class:`~mc2.engine.passes.run.ForwardPass` or
:class:`~mc2.engine.passes.run.BackwardPass`, up to its next wait), which three autograd
Functions adapt:

====================  ==================================  =========================================
stage                 forward                             backward
====================  ==================================  =========================================
``begin`` (dispatch)  plan, gather, issue the dispatch,   the weight gradients (while the other
                      shared experts' first half under it micro-batch's transfers travel), wait
                                                          for the gradients' combine, scatter
                                                          them into ``grad x``
``experts``           wait, experts, issue the combine,   wait for the gradients' dispatch, expert
                      shared experts' second half         backward, issue their combine
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
K-th of the rows (and with K above 2 the shared experts' second half runs in the ``end`` stage),
for K times the messages (an earlier sitting measured it no faster at
200 Mbit). ``"auto"``'s trials time whole passes, which a staged call never
runs alone, so they do not apply here.

The activations stay in the state between forward and backward (not ``save_for_backward``).
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import Tensor

from mc2.observation.profiler import active_timeline
from mc2.engine.autograd.pairing import current_pairing
from mc2.engine.autograd.prepare import autocast_inputs, guarded, shared_inputs
from mc2.engine.autograd.recompute import selective_region
from mc2.engine.compute.module_experts import ModuleExperts
from mc2.engine.decide.call_plan import CallPlan, plan_call
from mc2.engine.decide.config import MC2Config
from mc2.engine.passes.run import (
    BackwardPass, CallInputs, ForwardPass, ForwardState, backward_pass, forward_result
)
from mc2.engine.transport.deadline import deadline, resolve_timeout


@dataclass
class _Steps:
    """One staged call from its plan to its last backward step: its state and its six steps
    (module docstring). ``inputs``: what :func:`begin_packed` was given (the combine weights
    and the scale arrive with :meth:`end`); ``needs``: which need a gradient, filled in by the
    steps that take them."""

    call: CallPlan
    inputs: CallInputs[Any]
    needs: CallInputs[bool]
    seconds: float | None
    forward: ForwardPass | None = None
    state: ForwardState | None = None
    backward: BackwardPass | None = None

    @staticmethod
    def begun(step: Any) -> Any:
        """A pass a step continues: a step run before the one it follows is a bug, raised
        as such, never a silent loop or an attribute error."""
        if step is None:
            raise RuntimeError("mc2 staged call: a stage ran before the one it follows")
        return step

    @contextmanager
    def running(self) -> Iterator[None]:
        """A step of the call runs under its deadline, autocast off (its GEMMs write into
        buffers of the call's dtype)."""
        with deadline(self.seconds), torch.autocast(self.inputs.x.device.type, enabled=False):
            yield

    def begin(self, needs_x: bool, needs_combine: bool, needs_weights: tuple[bool, ...]
              ) -> None:
        """``needs_weights``: autograd's flags for the weights, the shared ones first."""
        shared = self.inputs.shared_names()
        self.needs.x, self.needs.combine = needs_x, needs_combine
        for name, needed in zip(shared, needs_weights):
            setattr(self.needs, name, needed)
        self.needs.experts = tuple(needs_weights[len(shared):])
        x = self.inputs.x
        with self.running():
            self.forward = ForwardPass(x.reshape(-1, x.shape[-1]),
                                       self.inputs.routed_weights(self.call),
                                       self.inputs.shared_weights(), self.call, self.needs)
            self.forward.begin()

    def experts(self) -> None:
        with self.running():
            self.begun(self.forward).experts()

    def end(self, combine: Tensor, scale: Tensor | None, needs: tuple[bool, bool]) -> Tensor:
        with self.running():
            output = self.begun(self.forward).end()
        self.forward = None
        self.needs.combine, self.needs.shared_scale = needs
        self.inputs.combine, self.inputs.shared_scale = combine, scale
        out, self.state = forward_result(output, self.call, self.inputs, self.needs)
        if not self.call.keep_activations:  # no backward follows: nothing kept
            self.state, self.inputs = None, CallInputs.of([None] * len(self.inputs.as_list()))
        return out

    def backward_begin(self, grad_out: Tensor) -> Tensor | None:
        """The forward's ``end`` mirrored; the shared scale's gradient."""
        with self.running():  # the pass's setup computes too (the combine weights' gradient)
            self.backward, grad_scale = backward_pass(self.begun(self.state), self.inputs,
                                                      grad_out, self.needs)
            self.state = None
            self.backward.begin()
        return grad_scale

    def backward_experts(self) -> None:
        with self.running():
            self.begun(self.backward).experts()

    def backward_end(self) -> CallInputs[Tensor | None]:
        with self.running():
            grads: CallInputs[Tensor | None] = self.begun(self.backward).end()
        self.backward = None
        self.call.workspace.tick()
        grads.x = grads.x.view(self.inputs.x.shape)
        return grads


def _token(like: Tensor) -> Tensor:
    return like.new_empty(0)


class _Begin(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, combine: Tensor, steps: _Steps,  # type: ignore[override]
                *weights: Tensor) -> Tensor:
        """``combine``: an input here too, for where rows travel once per destination: the
        routing weights are used by the dispatching ranks' experts, and their gradient comes
        back with this stage's backward (``None`` from :class:`_End` then)."""
        ctx.steps = steps
        needs_x, needs_combine, _, *needs_weights = ctx.needs_input_grad
        steps.begin(needs_x, needs_combine, tuple(needs_weights))
        return _token(x)

    @staticmethod
    def backward(ctx: Any, _: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        steps, ctx.steps = ctx.steps, None
        grads = steps.backward_end()
        shared = tuple(getattr(grads, name) for name in steps.inputs.shared_names())
        return (grads.x, grads.combine, None, *shared, *grads.experts)


class _Experts(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, token: Tensor, steps: _Steps) -> Tensor:  # type: ignore[override]
        ctx.steps = steps
        steps.experts()
        return _token(token)

    @staticmethod
    def backward(ctx: Any, _: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        ctx.steps.backward_experts()
        return _token(_), None


class _End(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, token: Tensor, combine: Tensor, s_scale: Tensor | None,
                steps: _Steps) -> Tensor:  # type: ignore[override]
        ctx.steps = steps
        return steps.end(combine, s_scale, ctx.needs_input_grad[1:3])

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grad_scale = ctx.steps.backward_begin(grad_out)
        return _token(grad_out), None, grad_scale, None  # combine's: _Begin's


class StagedCall:
    """A fused call of one micro-batch, run as :meth:`experts` and :meth:`end` after its
    :func:`begin`; call them in that order, once each."""

    def __init__(self, token: Tensor, steps: _Steps, combine: Tensor,
                 scale: Tensor | None) -> None:
        self._token, self._steps, self._combine, self._scale = token, steps, combine, scale

    def experts(self) -> None:
        """Wait for the dispatch, run the experts, issue the combine."""
        self._token = _Experts.apply(self._token, self._steps)

    def end(self) -> Tensor:
        """Wait for the combine; the output, shaped like the input."""
        return _End.apply(self._token, self._combine, self._scale, self._steps)


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


def begin_packed(x: Tensor, gate_up: Tensor, down: Tensor, expert_ids: Tensor,
                 routing_weights: Tensor, *, group: Any, config: MC2Config,
                 shared: tuple[Tensor | None, Tensor | None, Tensor | None] = (None, None, None),
                 shared_scale: Tensor | None = None) -> StagedCall:
    """Plan a :func:`mc2.fused_expert_packed` call and issue its dispatch (``K = 1`` unless
    ``config`` sets it); see the module docstring. Planning runs the handshake and the counts exchange
    now, as every call does."""
    return _begin(x, {"weights_gate_up": gate_up, "weights_down": down}, expert_ids,
                  routing_weights, (*shared, shared_scale), group=group, config=config)


def begin_split(x: Tensor, up: Tensor, gate: Tensor, down: Tensor, expert_ids: Tensor,
                routing_weights: Tensor, *, group: Any, config: MC2Config,
                shared: tuple[Tensor | None, Tensor | None, Tensor | None] = (None, None, None),
                shared_scale: Tensor | None = None) -> StagedCall:
    """:func:`begin_packed` for :func:`mc2.fused_expert`'s layout (up, gate ``[E, H, F]``,
    down ``[E, F, H]``: TorchTitan's ``GroupedExperts`` as transposed views)."""
    return _begin(x, {"weights_up": up, "weights_gate": gate, "weights_down": down},
                  expert_ids, routing_weights, (*shared, shared_scale), group=group,
                  config=config, packed=False)


def begin_module(x: Tensor, experts: ModuleExperts, expert_ids: Tensor, routing_weights: Tensor,
                 *, group: Any, config: MC2Config, num_experts: int | None = None,
                 shared: tuple[Tensor | None, Tensor | None, Tensor | None] = (None, None, None),
                 shared_scale: Tensor | None = None) -> StagedCall:
    """:func:`begin_packed` for :func:`mc2.fused_expert_module`'s experts: a framework's own
    experts module (Megatron's) as each micro-batch's experts stage."""
    return _begin(x, dict(zip(experts.names, experts.params)), expert_ids, routing_weights,
                  (*shared, shared_scale), group=group, config=config, packed=False,
                  module=experts, num_experts=num_experts)


def _begin(x: Tensor, named: dict[str, Tensor], expert_ids: Tensor, routing_weights: Tensor,
           shared: tuple[Tensor | None, ...], *, group: Any, config: MC2Config,
           packed: bool = True, module: ModuleExperts | None = None,
           num_experts: int | None = None) -> StagedCall:
    """The staged call's begin, for either experts: plan under the deadline, issue the
    dispatch (the pass's first stop)."""
    if any(type(t).__name__ == "DTensor" for t in (x, *named.values())):
        raise ValueError("mc2 staged call: the tokens or the experts' parameters are DTensors "
                         "(FSDP2 shards, or tensor-parallel activations); gather them first "
                         "(batch overlap does, for the decoder layers it runs: "
                         "mc2.parallel.layer_gather.LayerGathers)")
    if torch.compiler.is_compiling() or selective_region():
        raise ValueError("mc2 staged call: not traceable by torch.compile, and not inside a "
                         "selective activation checkpointing region (batch overlap runs the "
                         "layers' parts eagerly)")
    if config.micro_batches == "auto":  # the other micro-batch of the batch gives the overlap
        config = config.replace(micro_batches=1)
    seconds = resolve_timeout(config.timeout)
    # under autocast, in the autocast dtype, as the plain call (the pass itself runs with
    # autocast off: its GEMMs write into buffers of the call's dtype)
    x, named, routing_weights, full_shared = autocast_inputs(x, named, routing_weights, shared)
    timeline = active_timeline()
    if timeline is not None:
        timeline = timeline.labelled(_LABEL.get())
    call, weights, combine = guarded(
        lambda: plan_call(x, named, expert_ids, routing_weights, config=config,
                          packed=packed, group=group, shared=full_shared,
                          num_experts=num_experts, timeout=seconds, timeline=timeline,
                          module=module, paired=current_pairing() is not None),
        config, x)
    s_up, s_gate, s_down, s_scale = shared_inputs(x, full_shared)
    experts = weights.tensors()
    steps = _Steps(call, CallInputs(x, None, s_up, s_gate, s_down, None, experts),
                   CallInputs(False, False, False, False, False, False, ()), seconds)
    shared_tensors = [getattr(steps.inputs, name) for name in steps.inputs.shared_names()]
    token = _Begin.apply(x, combine, steps, *shared_tensors, *experts)
    return StagedCall(token, steps, combine, s_scale)
