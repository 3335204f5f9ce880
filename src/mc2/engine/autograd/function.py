"""The eager adapter: one ``torch.autograd.Function`` over one pass (:mod:`mc2.engine.passes.run`).

Where the forward's state lives decides when its memory goes. With no saved-tensor hook active,
the state stays on the context and the backward drops each micro-batch's activations as soon
as it used them, so the backward's peak holds one micro-batch's activations less at every
step. Where a hook is active (activation offload, non-reentrant activation checkpointing), the
state's tensors go through ``save_for_backward`` so that the hook sees every one of them; the
backward then holds them until it returns, as autograd does for any saved tensor.

Under ``mc2.forward_backward``'s paired schedule (:mod:`mc2.engine.autograd.pairing`) the
pass's three steps are where the pairing happens, for a model that calls mc2 inside its layers
(no layer loop of mc2's): a forward hands back to the backward it is paired with after each
transfer it issued, and a backward gives way to the paired forward where its own transfers
travel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mc2.engine.autograd.pairing import current_pairing
from mc2.engine.decide.call_plan import CallPlan
from mc2.engine.passes.run import CallInputs, ForwardState, run_backward, run_forward


def saved_tensor_hooks_active() -> bool:
    """Whether a saved-tensor hook (offload, checkpointing) would see what is saved."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


class FusedExpertFunction(torch.autograd.Function):
    """``apply(call, x, combine, shared_up, shared_gate, shared_down, shared_scale,
    *experts)``: the inputs in :meth:`CallInputs.as_list` order after the plan."""

    @staticmethod
    def forward(ctx: Any, call: CallPlan, *tensors: Tensor | None) -> Tensor:  # type: ignore[override]
        inputs = CallInputs.of(tensors)
        needs = CallInputs.of(ctx.needs_input_grad[1:])
        pairing = ctx.pairing = current_pairing()
        if pairing is not None:
            pairing.calls += 1
        out, state = run_forward(call, inputs, needs,
                                 pairing.hand_back if pairing is not None else None)
        ctx.needs = needs
        ctx.state = None
        if not call.keep_activations:
            ctx.save_for_backward()
        elif saved_tensor_hooks_active():
            ctx.save_for_backward(*tensors, *state.tensors())
            ctx.state = state.with_tensors([None] * len(state.tensors()))
            ctx.through_hooks = True
        else:
            ctx.save_for_backward(*tensors)
            ctx.state = state
            ctx.through_hooks = False
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        state: ForwardState | None = ctx.state
        if state is None:
            raise RuntimeError("mc2.fused_expert: its backward consumes the saved activations and "
                               "runs once per forward; a second backward through the same graph "
                               "(retain_graph=True) is not supported")
        ctx.state = None  # the only reference left is this frame's: freed as the pass goes
        saved = list(ctx.saved_tensors)
        if ctx.through_hooks:  # the state's tensors follow the inputs
            n = len(saved) - len(state.tensors())
            state, saved = state.with_tensors(saved[n:]), saved[:n]
        inputs = CallInputs.of(saved)
        del saved
        pairing, ctx.pairing = ctx.pairing, None
        grads = run_backward(state, inputs, grad_out, ctx.needs,
                             pairing.give_way if pairing is not None else None)
        return (None, *grads.as_list())
