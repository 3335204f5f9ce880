"""One forward and one backward pass of a planned call, over named state.

Every way a call runs (the eager autograd Function, the three staged Functions of batch
overlap, the custom op of ``torch.compile``/``torch.export``) is a thin adapter over this
module. What crosses between them is named, never positional:

* :class:`CallInputs`: the call's tensor inputs (``x``, the combine weights, the shared experts,
  their scale, the routed experts in their layout's order); also used, with booleans, for which
  inputs need a gradient, and, with gradients, for what the backward returns;
* :class:`ForwardState`: what a forward *made* and its backward reads (the expert outputs kept
  for the routing-weight gradient, each micro-batch's activations). It never holds an input,
  so an adapter may keep it anywhere: the custom op keeps it in a table while the graph holds
  the inputs, the eager Function hands its tensors to ``save_for_backward`` where a
  saved-tensor hook wants to see them.

The whole pipeline is one backward on purpose: autograd would run per-primitive backward
functions one after another, serialising the backward's communication. Owning the backward
lets it be pipelined like the forward (the output gradients travel the dispatch routes, the
input gradients come back the combine routes, micro-batch by micro-batch).

The body asks no question of the variant it runs: how rows travel (one row per pair, once per
destination, fixed slabs) is the plan's strategy (:mod:`mc2.engine.passes.travel`), how experts
compute (mc2's SwiGLU, a framework's module) the weights' (``run``/``backward``/``gradients``).
The shared experts are the body's own: they run under the first dispatch (the forward's half of
them under the last combine, :mod:`mc2.engine.passes.shared_experts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

import torch
from torch import Tensor

from mc2.device.clock import Interval, clock_for
from mc2.device import streams
from mc2.engine.compute.experts import (
    ExpertActivations, ExpertWeights, WeightGrads
)
from mc2.engine.compute.module_experts import ModuleExperts
from mc2.engine.decide.call_plan import CallPlan
from mc2.engine.passes.pass_output import PassOutput
from mc2.engine.passes.pipeline import PassSchedule, PipelineSteps
from mc2.engine.passes.shared_experts import SharedForward, shared_backward
from mc2.engine.passes.travel import TRAVELS
from mc2.engine.transport.deadline import deadline
from mc2.observation.timeline import maybe_span

T = TypeVar("T")


@dataclass
class CallInputs(Generic[T]):
    """The call's inputs by name: tensors, or one flag (or gradient) per tensor.

    Attributes:
        x: ``[..., H]`` the tokens.
        combine: ``[T, topk]`` the combine (routing) weights.
        shared_up, shared_gate: ``[1, H, S * Fs]`` the shared experts as one expert, or ``None``.
        shared_down: ``[1, S * Fs, H]``, or ``None``.
        shared_scale: ``[T, 1]`` a per-token factor on the shared output, or ``None`` (1).
        experts: the routed experts in their layout's order
            (:data:`~mc2.engine.compute.experts.PACKED_ORDER` or ``SPLIT_ORDER``).
    """

    x: T
    combine: T
    shared_up: T
    shared_gate: T
    shared_down: T
    shared_scale: T
    experts: tuple[T, ...]

    def as_list(self) -> list[T]:
        """The inputs in the adapters' argument order (as the fields, experts last)."""
        return [self.x, self.combine, self.shared_up, self.shared_gate, self.shared_down,
                self.shared_scale, *self.experts]

    @classmethod
    def of(cls, values: Any) -> "CallInputs[T]":
        """:meth:`as_list` undone."""
        x, combine, up, gate, down, scale, *experts = values
        return cls(x, combine, up, gate, down, scale, tuple(experts))

    def shared_names(self) -> tuple[str, ...]:
        """The shared experts' weight fields this call has (all three or none): the staged
        Functions take them as inputs, and read their flags and gradients, by these names."""
        return SHARED_WEIGHTS if self.shared_up is not None else ()

    def shared_weights(self) -> ExpertWeights | None:
        if self.shared_up is None:
            return None
        return ExpertWeights.split_of(self.shared_up, self.shared_gate, self.shared_down)

    def routed_weights(self, call: CallPlan) -> ExpertWeights | ModuleExperts:
        """The routed experts as the call runs them (:meth:`CallPlan.routed_experts`)."""
        return call.routed_experts(tuple(self.experts))


SHARED_WEIGHTS = ("shared_up", "shared_gate", "shared_down")


@dataclass
class ForwardState:
    """What one forward made for its backward (never an input of the call).

    Attributes:
        call: the plan (routes, groups); host data only.
        x_shape: the input's shape, for the input gradient.
        activations: per micro-batch, the rows in expert order and their gate/up projections
            (``None`` once the backward used them, or when no backward follows).
        shared_gate_up: ``[T, 2 * S * Fs]`` the shared experts' projections (their input is
            ``x``, which the adapter brings back).
        expert_out: ``[T * topk, H]`` each (token, slot)'s expert output, kept where the
            combine weights need a gradient.
        shared_out: ``[T, H]`` the shared experts' output, kept where their scale needs one.
        kept: what the way rows travel kept for its backward, where the combine weights need
            a gradient (rows once per destination: per micro-batch, this rank's expert outputs
            in expert order, ``[P_i, H]``: their gradient is computed where the experts are,
            :mod:`~mc2.engine.decide.dedup`).
    """

    call: CallPlan
    x_shape: torch.Size
    activations: list[Any]
    shared_gate_up: Tensor | None = None
    expert_out: Tensor | None = None
    shared_out: Tensor | None = None
    kept: list[Tensor | None] | None = None

    def tensors(self) -> list[Tensor | None]:
        """Every tensor of the state (for ``save_for_backward``), in :meth:`with_tensors`'
        order; each micro-batch's activations give what they keep (``saved()``: a module
        stage's are its own autograd graph and give nothing,
        :mod:`~mc2.engine.compute.module_experts`)."""
        rows = [t for a in self.activations if a is not None for t in a.saved()]
        return [self.shared_gate_up, self.expert_out, self.shared_out, *(self.kept or ()),
                *rows]

    def with_tensors(self, tensors: list[Tensor | None]) -> "ForwardState":
        """The state with :meth:`tensors` replaced (as a saved-tensor hook hands them back)."""
        shared_gate_up, expert_out, shared_out, *rest = tensors
        n = len(self.kept or ())
        kept, rows = (rest[:n] if self.kept is not None else None), iter(rest[n:])
        activations = [None if a is None else a.restored([next(rows) for _ in a.saved()])
                       for a in self.activations]
        return ForwardState(self.call, self.x_shape, activations, shared_gate_up, expert_out,
                            shared_out, kept)


class _PassSteps:
    """One pass of a call as the three plain steps of its schedule
    (:class:`~mc2.engine.passes.pipeline.PassSchedule`): :meth:`begin` issues the first
    dispatch, :meth:`experts` runs up to the first combine's wait, :meth:`end` finishes and
    returns what the pass produced. A caller may run other work between them, where the first
    transfers travel (the staged calls of batch overlap, a paired backward); :meth:`run` runs
    the three back to back (the eager Function, the custom op)."""

    schedule: PassSchedule

    def begin(self) -> None:
        self.schedule.begin()

    def experts(self) -> None:
        self.schedule.experts()

    def end(self) -> Any:
        self.schedule.end()
        return self.finish()

    def finish(self) -> Any:
        raise NotImplementedError

    def run(self, between: Callable[[], None] | None = None) -> Any:
        """The three steps; ``between()`` after each of the first two and before each later
        wait inside them, where this pass's transfers travel (a paired schedule runs another
        micro-batch's work there)."""
        if between is not None:
            self.schedule.between_waits(between)
        self.begin()
        if between is not None:
            self.schedule.between(between)
        self.experts()
        if between is not None:
            self.schedule.between(between)
        return self.end()


class ForwardPass(_PassSteps):
    """Dispatch, experts and combine of every micro-batch (and the shared experts under the
    first dispatch); :meth:`end` returns the :class:`PassOutput`. How rows travel is the plan's
    (:data:`~mc2.engine.passes.travel.TRAVELS`), how experts compute ``weights``'. ``needs``:
    which inputs need a gradient (a module stage records only the experts' that do; the
    experts' side keeps its outputs where the combine weights do)."""

    def __init__(self, x: Tensor, weights: ExpertWeights | ModuleExperts,
                 shared: ExpertWeights | None, call: CallPlan, needs: CallInputs[bool]) -> None:
        self.result = PassOutput(None, [None] * call.handle.num_micro_batches)
        self._rows = TRAVELS[call.travel].forward(x, weights, call, needs, self.result)
        local = SharedForward(x, shared, call, self.result) if shared is not None else None
        self.schedule = PassSchedule(call, PipelineSteps(
            gather=self._rows.gather, compute=self._rows.compute, scatter=self._rows.scatter,
            local=local and local.fill, drain=local and local.drain,
        ), "forward", x.device)

    def finish(self) -> PassOutput:
        self._rows.finish()
        return self.result


def weighted_sum(forward: PassOutput, combine: Tensor, call: CallPlan, like: Tensor,
                 shape: torch.Size, shared_scale: Tensor | None) -> Tensor:
    """Each token's top-k expert outputs weighted, plus the shared experts (times their
    ``[T, 1]`` scale, if any), in ``shape`` (the caller's ``[..., H]``: written in place, so the
    output is no view, which FSDP2 and in-place edits of the output would have to treat with
    care)."""
    tokens, topk, hidden = call.handle.num_tokens, call.handle.topk, like.shape[-1]
    with maybe_span(call.timeline, "compute", "weighted_sum", "forward"):
        out = call.workspace.empty(tuple(shape), like.dtype, like.device)
        forward.weighted(out.view(tokens, hidden), combine.view(tokens, topk))
        if forward.shared_out is not None and shared_scale is not None:
            out.view(tokens, hidden).addcmul_(shared_scale, forward.shared_out)
        elif forward.shared_out is not None:
            out.view(tokens, hidden).add_(forward.shared_out)
    return out


class BackwardPass(_PassSteps):
    """The output gradients out along the dispatch routes, the input gradients back along the
    combine routes; the weight gradients while those travel. The shared experts see the output
    gradient times their ``[T, 1]`` scale, if any. Each micro-batch's activations are dropped
    from ``state`` once used (freed as the pass goes, where nothing else holds them).
    :meth:`end` returns the gradients by input (``x``'s as ``[T, H]``; ``None`` where not
    needed; the shared scale's is :func:`scale_grad`'s, not this pass's)."""

    def __init__(self, grad_out: Tensor, inputs: CallInputs[Tensor], state: ForwardState,
                 needs: CallInputs[bool]) -> None:
        call = state.call
        ws, hidden = call.workspace, grad_out.shape[-1]
        self._rows = rows = TRAVELS[call.travel].backward(grad_out, inputs, state, needs)
        shared = inputs.shared_weights()
        self._shared_grads = local = None
        if shared is not None and state.shared_gate_up is not None:
            self._shared_grads = WeightGrads(
                shared, (needs.shared_up, needs.shared_gate, needs.shared_down), ws)
            saved = ExpertActivations(inputs.x.reshape(-1, hidden), state.shared_gate_up)
            state.shared_gate_up = None
            local = shared_backward(grad_out, inputs.shared_scale, saved, shared, call,
                                    lambda grad_in: rows.grad_x.add_(grad_in),
                                    self._shared_grads)
        self.schedule = PassSchedule(call, PipelineSteps(
            gather=rows.gather, compute=rows.compute, scatter=rows.scatter,
            deferred=rows.deferred, local=local,
        ), "backward", grad_out.device)

    def finish(self) -> CallInputs[Tensor | None]:
        grad_x, expert_grads, grad_combine = self._rows.finish()
        up, gate, down = self._shared_grads.finish() if self._shared_grads is not None else \
            (None, None, None)
        return CallInputs(grad_x, grad_combine, up, gate, down, None, tuple(expert_grads))


def scale_grad(state: ForwardState, grad_out: Tensor, needs: CallInputs[bool]) -> Tensor | None:
    """The shared experts' scale's ``[T, 1]`` gradient (the shared output dotted with
    ``grad_out [T, H]``), or ``None`` where not wanted. (The combine weights' gradient comes
    from the backward pass: where rows travel decides where it is computed.)"""
    if not needs.shared_scale:
        return None
    tokens, hidden = state.call.handle.num_tokens, grad_out.shape[-1]
    return torch.bmm(grad_out.view(tokens, 1, hidden),
                     state.shared_out.view(tokens, hidden, 1)).view(tokens, 1)


def state_of(output: PassOutput, call: CallPlan, shape: torch.Size, needs: CallInputs[bool]
             ) -> ForwardState:
    """The part of a forward pass's output its backward reads."""
    shared = output.shared_activations
    return ForwardState(call, shape, output.activations,
                        shared.gate_up if shared is not None else None,
                        output.expert_out if needs.combine else None,
                        output.shared_out if needs.shared_scale else None,
                        output.kept if needs.combine else None)


def _timed(call: CallPlan, phase: str, device: torch.device) -> Callable[[], None]:
    """Start timing a pass for ``"auto"``'s trials; the returned function reports it. Not
    inside a graph capture: its stamps would time the capture, not a replay."""
    if call.on_pass_done is None or streams.capturing(device):
        return lambda: None
    clock = clock_for(device)
    started = clock.stamp()
    report = call.on_pass_done
    return lambda: report(phase, Interval(clock, started, clock.stamp()))


def run_forward(call: CallPlan, inputs: CallInputs[Tensor], needs: CallInputs[bool],
                between: Callable[[], None] | None = None) -> tuple[Tensor, ForwardState]:
    """The forward of one planned call: its output (``x``-shaped) and its state.
    ``between``: see :meth:`_PassSteps.run`."""
    done = _timed(call, "forward", inputs.x.device)
    flat = inputs.x.reshape(-1, inputs.x.shape[-1])
    output = ForwardPass(flat, inputs.routed_weights(call), inputs.shared_weights(), call,
                         needs).run(between)
    out, state = forward_result(output, call, inputs, needs)
    done()
    return out, state


def forward_result(output: PassOutput, call: CallPlan, inputs: CallInputs[Tensor],
                   needs: CallInputs[bool]) -> tuple[Tensor, ForwardState]:
    """The end of every forward, whoever ran its steps: the output (``inputs.x``-shaped) and
    the state its backward reads; the workspace's buffers released where no backward reads
    them."""
    x = inputs.x
    out = weighted_sum(output, inputs.combine, call, x.reshape(-1, x.shape[-1]), x.shape,
                       inputs.shared_scale)
    state = state_of(output, call, x.shape, needs)
    if not call.keep_activations:
        call.workspace.tick()
    return out, state


def backward_pass(state: ForwardState, inputs: CallInputs[Tensor], grad_out: Tensor,
                  needs: CallInputs[bool]) -> tuple[BackwardPass, Tensor | None]:
    """The start of every backward, whoever runs its steps: the pass over ``grad_out``
    (flattened to ``[T, H]``) and the shared scale's gradient (:func:`scale_grad`)."""
    grad_out = grad_out.contiguous().view(-1, grad_out.shape[-1])
    return BackwardPass(grad_out, inputs, state, needs), scale_grad(state, grad_out, needs)


def run_backward(state: ForwardState, inputs: CallInputs[Tensor], grad_out: Tensor,
                 needs: CallInputs[bool], between: Callable[[], None] | None = None
                 ) -> CallInputs[Tensor | None]:
    """The gradients of one call, by input (``None`` where not needed). Consumes ``state``'s
    activations. ``between``: see :meth:`_PassSteps.run`."""
    call = state.call
    # autograd runs this outside the call's context: its deadline, and no autocast (the
    # forward ran in one dtype; its GEMMs write into buffers of that dtype)
    with deadline(call.timeout), torch.autocast(grad_out.device.type, enabled=False):
        done = _timed(call, "backward", grad_out.device)
        steps, grad_scale = backward_pass(state, inputs, grad_out, needs)
        grads = steps.run(between)
        call.workspace.tick()
        done()
    grads.x, grads.shared_scale = grads.x.view(state.x_shape), grad_scale
    return grads

