"""The fused call as one opaque operator, ``torch.ops.mc2.fused_expert``, for graph capture.

Why an operator: ``torch.compile`` and ``torch.export`` trace Python into graphs of operators
with fake tensors. The fused call cannot be traced through (its split sizes are read from the
device, its collectives run on process groups, its deadline lives in a ``ContextVar``), but
its *result* has a shape known in advance: the input's. Registered with
``torch.library.custom_op``, the whole call is one node of the graph, with a fake
implementation for tracing and its backward registered as a second operator
(``mc2::fused_expert_backward``). Dynamo makes no graph break around it, AOTAutograd puts the
backward node in the backward graph, and ``torch.export`` keeps it as a call.

What crosses from the forward to the backward: the operator returns, beside the output, a
one-element CPU token that names the forward's saved state (the routes, which are host data,
and the activations the call made; its inputs come back from the graph) in a process-local
table. The backward operator takes the state by its token; the table forgets a state when its
backward ran or when the token's storage is gone (a forward whose graph is dropped). Because
the state is not a graph value, activation-offload hooks do not see the activations of a
compiled call (the eager path, :mod:`mc2.engine.autograd.function`, saves them through
``save_for_backward``), and a saved-tensor hook that *copies* the token (``save_on_cpu`` with
pinned memory) loses the state: do not offload around a compiled mc2 model.

Eager calls do not go through the operator; :mod:`mc2.engine.autograd.recompute` uses its name as the
handle that checkpoint policies refer to.
"""

from __future__ import annotations

import itertools
import json
import weakref
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from mc2.engine.autograd.function import ForwardResult, run_backward

_STATES: dict[int, ForwardResult] = {}
_KEYS = itertools.count()
NO_STATE = -1


def _group_of(name: str) -> Any:
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def group_name(group: Any) -> str:
    """The name a process group travels under through the operator (``""``: the default)."""
    return "" if group is None else group.group_name


@torch.library.custom_op("mc2::fused_expert", mutates_args=())
def fused_expert_op(x: Tensor, combine_weights: Tensor, expert_ids: Tensor,
                    experts: list[Tensor], shared_up: Tensor | None, shared_gate: Tensor | None,
                    shared_down: Tensor | None, shared_scale: Tensor | None, packed: bool,
                    group: str, config: str, num_experts: int, needs: list[bool]
                    ) -> tuple[Tensor, Tensor]:
    """``(output, token)``: one planned and run fused call (arguments as
    :func:`mc2.engine.autograd.ops.fused_expert`'s, already in the autograd Function's layout: combine
    weights ``[T, topk]``, shared experts as one expert, the scale ``[T, 1]``; the config as
    :meth:`MC2Config.to_dict` JSON, the group by name, ``num_experts`` ``-1`` for none;
    ``needs``: which tensor inputs (all but the ids, in order) the backward differentiates,
    decided while tracing, as the compiled forward runs without autograd)."""
    from mc2.engine.decide.config import MC2Config
    from mc2.engine.autograd.ops import run_for_operator

    shared = (shared_up, shared_gate, shared_down, shared_scale)
    result = run_for_operator(x, experts, expert_ids, combine_weights, shared,
                              MC2Config.from_dict(json.loads(config)), packed=packed,
                              group=_group_of(group),
                              num_experts=None if num_experts < 0 else num_experts,
                              needs=(*needs[:2], False, *needs[2:]))
    call = result.call
    out = result.out
    if not call.keep_activations:
        return out, torch.tensor([NO_STATE])
    key = next(_KEYS)
    _STATES[key] = _without_inputs(result)
    token = torch.tensor([key])
    weakref.finalize(token.untyped_storage(), _STATES.pop, key, None)
    return out, token


@fused_expert_op.register_fake
def _(x, combine_weights, expert_ids, experts, shared_up, shared_gate, shared_down, shared_scale,
      packed, group, config, num_experts, needs):
    return torch.empty_like(x), torch.empty(1, dtype=torch.int64, device="cpu")


@torch.library.custom_op("mc2::fused_expert_backward", mutates_args=())
def fused_expert_backward_op(grad_out: Tensor, token: Tensor, inputs: list[Tensor | None],
                             needed: list[bool]) -> list[Tensor]:
    """The gradients of a :func:`fused_expert_op` call w.r.t. ``inputs`` (its tensor inputs
    but the ids, in order); an empty tensor where ``needed`` is false."""
    result = _STATES.pop(int(token.item()), None)  # a CPU tensor: no device synchronisation
    if result is None:
        raise RuntimeError("mc2.fused_expert: the forward state of this backward is gone (a "
                           "second backward through one graph is not supported)")
    grads = run_backward(result, _with_inputs(result, inputs), grad_out,
                         (*needed[:2], False, *needed[2:]))
    grads = (*grads[:2], *grads[3:])  # the plan's slot
    # exactly what the fake says: a gradient where needed, an empty tensor elsewhere
    return [g if g is not None and need else _empty_like(t)
            for g, t, need in zip(grads, inputs, needed)]


# ForwardResult.saved: routing weights, expert_out, shared_out, the shared experts (3) and
# scale, the experts, then each micro-batch's (rows, gate_up) and the shared experts' (x, gate_up)
_INPUT_SLOTS = (0, 3, 4, 5, 6)  # combine weights, shared up/gate/down, scale


def _without_inputs(result: ForwardResult) -> ForwardResult:
    """The state to keep: only what the call made. Inputs come back from the graph in the
    backward (the graph saved them); a reference kept here could see its buffer reused by
    the compiled code once the graph thinks it dead."""
    saved = list(result.saved)
    for i in (*_INPUT_SLOTS, *range(7, 7 + result.num_experts_tensors)):
        saved[i] = None
    if result.activation_layout[1]:  # the shared experts' input is x
        saved[-2] = None
    return replace(result, out=None, saved=saved)


def _with_inputs(result: ForwardResult, inputs: list[Tensor | None]) -> list[Tensor | None]:
    """``result.saved`` with the graph's inputs back in their slots."""
    x, combine, s_up, s_gate, s_down, s_scale, *experts = inputs
    saved = list(result.saved)
    saved[0], saved[3:7] = combine, [s_up, s_gate, s_down, s_scale]
    saved[7:7 + len(experts)] = experts
    if result.activation_layout[1]:
        saved[-2] = x
    return saved


def _empty_like(t: Tensor | None) -> Tensor:
    return torch.empty(0) if t is None else t.new_empty(0)


@fused_expert_backward_op.register_fake
def _(grad_out, token, inputs, needed):
    return [torch.empty_like(t) if t is not None and need else _empty_like(t)
            for t, need in zip(inputs, needed)]


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, combine_weights, _, experts, s_up, s_gate, s_down, s_scale = inputs[:8]
    tensors = [x, combine_weights, s_up, s_gate, s_down, s_scale, *experts]
    ctx.needed = list(inputs[12])
    ctx.save_for_backward(output[1], *tensors)


def _backward(ctx: Any, grad_out: Tensor, _grad_token: Tensor) -> tuple:
    token, *tensors = ctx.saved_tensors
    grads = fused_expert_backward_op(grad_out, token, tensors, ctx.needed)
    grads = [g if need else None for g, need in zip(grads, ctx.needed)]
    x, weights, s_up, s_gate, s_down, s_scale, *experts = grads
    return (x, weights, None, experts, s_up, s_gate, s_down, s_scale, None, None, None, None,
            None)


fused_expert_op.register_autograd(_backward, setup_context=_setup_context)

FUSED_EXPERT = torch.ops.mc2.fused_expert.default  # what checkpoint policies compare against
