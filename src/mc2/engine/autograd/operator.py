"""The fused call as one opaque operator, ``torch.ops.mc2.fused_expert``.

Why an operator: ``torch.compile`` and ``torch.export`` trace Python into graphs of operators
with fake tensors. The fused call cannot be traced through (its split sizes are read from the
device, its collectives run on process groups, its deadline lives in a ``ContextVar``), but
its *result* has a shape known in advance: the input's. Registered with
``torch.library.custom_op``, the whole call is one node of the graph, with a fake
implementation for tracing and its backward registered as a second operator
(``mc2::fused_expert_backward``). Dynamo makes no graph break around it, AOTAutograd puts the
backward node in the backward graph, and ``torch.export`` keeps it as a call.

Eager calls go through it too while selective activation checkpointing runs
(:mod:`.recompute`): to PyTorch's caching dispatch mode the call is then one operator, which
a policy saves or recomputes whole, and the operators the call runs inside stay invisible to
the policy (counted op by op, they would shift the cache of the region's own operators).
Such a call still runs eagerly inside the operator, so under ``mc2.forward_backward``'s
pairing it gives way between its steps as the eager adapter's does (:mod:`.function`); a
traced call (compiled) runs whole.

What crosses from the forward to the backward: the operator returns, beside the output, a
one-element CPU token that names the forward's :class:`~mc2.engine.passes.run.ForwardState`
in a process-local table (the state holds no input: the inputs come back from the graph).
The backward operator takes the state by its token; the table forgets a state when its
backward ran or when the token's storage is gone (a forward whose graph is dropped). Because
the state is not a graph value, activation-offload hooks do not see the activations of a
compiled call (the eager path, :mod:`.function`, saves them through ``save_for_backward``),
and a saved-tensor hook that *copies* the token (``save_on_cpu`` with pinned memory) loses the
state: do not offload around a compiled mc2 model.

This module is imported with ``import mc2``, so a program that only loads an exported graph
(``torch.export.load``) finds the operator registered.
"""

from __future__ import annotations

import inspect
import itertools
import json
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mc2.engine.autograd.pairing import current_pairing
from mc2.engine.autograd.prepare import EAGER_RUNTIME, guarded
from mc2.engine.compute.experts import PACKED_ORDER, SPLIT_ORDER
from mc2.engine.decide.call_plan import plan_call
from mc2.engine.decide.config import MC2Config
from mc2.engine.passes.run import CallInputs, ForwardState, run_backward, run_forward
from mc2.engine.transport.deadline import resolve_timeout


@dataclass(frozen=True)
class _Kept:
    """A forward's state until its backward; ``pairing``: the pairing an eager forward (a
    selective-checkpointing region's) ran under, which its backward gives way in, as the
    eager adapter's does (taken at the forward: autograd's device thread, where the backward
    may run, does not see the pairing's context variable)."""

    state: ForwardState
    pairing: Any


_STATES: dict[int, _Kept] = {}
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


def _fused_expert(x: Tensor, combine_weights: Tensor, expert_ids: Tensor,
                  experts: list[Tensor], shared_up: Tensor | None, shared_gate: Tensor | None,
                  shared_down: Tensor | None, shared_scale: Tensor | None, packed: bool,
                  group: str, config: str, num_experts: int | None, needs: list[bool]
                  ) -> tuple[Tensor, Tensor]:
    """``(output, token)``: one planned and run fused call. The tensors are in the pass's
    layout (:class:`~mc2.engine.passes.run.CallInputs`: combine weights ``[T, topk]``, the
    shared experts as one expert, their scale ``[T, 1]``); the config as
    :meth:`MC2Config.to_dict` JSON, the group by name;
    ``needs``: which tensor inputs (all but the ids, in :meth:`CallInputs.as_list` order) the
    backward differentiates, decided by the caller (a compiled forward runs without
    autograd)."""
    cfg = MC2Config.from_dict(json.loads(config))
    # an eager call routed here (a selective-checkpointing region's) pairs as the eager
    # adapter's does, between its steps; a traced one runs inside a compiled graph, whole
    eager = EAGER_RUNTIME.get() is not None
    pairing = current_pairing()
    if pairing is not None:
        if eager:
            pairing.calls += 1
        else:
            pairing.traced += 1
    between = pairing.hand_back if pairing is not None and eager else None
    need = CallInputs.of(needs)
    names = ["weights_" + n for n in (PACKED_ORDER if packed else SPLIT_ORDER)]

    def run() -> tuple[Tensor, ForwardState]:
        call, weights, _ = plan_call(
            x, dict(zip(names, experts)), expert_ids, combine_weights, config=cfg,
            shared=(shared_up, shared_gate, shared_down, shared_scale), packed=packed,
            group=_group_of(group), num_experts=num_experts,
            needs_grad=any(needs), timeout=resolve_timeout(cfg.timeout),
            paired=pairing is not None, **(EAGER_RUNTIME.get() or {}))
        return run_forward(call, CallInputs(x, combine_weights, shared_up, shared_gate,
                                            shared_down, shared_scale, weights.tensors()), need,
                           between)

    out, state = guarded(run, cfg, x)
    if not state.call.keep_activations:
        return out, torch.tensor([NO_STATE])
    key = next(_KEYS)
    _STATES[key] = _Kept(state, pairing if eager else None)
    token = torch.tensor([key])
    weakref.finalize(token.untyped_storage(), _STATES.pop, key, None)
    return out, token


# One operator for every call, tagged: a dropless call reads split sizes to the host, so
# Inductor must keep it out of its CUDA graphs (``mode="reduce-overhead"``). A capacity call
# (``MC2Config(capacity=N)``) reads nothing and can be captured eagerly with
# ``torch.cuda.graph``; under ``torch.compile`` it stays outside Inductor's graphs too (a second,
# untagged operator for it was removed: no capture of it was ever measured).
fused_expert_op = torch.library.custom_op(
    "mc2::fused_expert", _fused_expert, mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))


def _fake(x, combine_weights, expert_ids, experts, shared_up, shared_gate, shared_down,
          shared_scale, packed, group, config, num_experts, needs):
    return torch.empty_like(x), torch.empty(1, dtype=torch.int64, device="cpu")


fused_expert_op.register_fake(_fake)


# tagged as the forward: it finds its call's state by a host integer (``token.item()``, a CPU
# tensor) and runs the call's Python, which a CUDA graph's replay would skip, replaying the
# recorded call's state and memory instead
@torch.library.custom_op("mc2::fused_expert_backward", mutates_args=(),
                         tags=(torch.Tag.cudagraph_unsafe,))
def fused_expert_backward_op(grad_out: Tensor, token: Tensor, inputs: list[Tensor | None],
                             needed: list[bool]) -> list[Tensor]:
    """The gradients of a :func:`fused_expert_op` call w.r.t. ``inputs`` (its tensor inputs
    but the ids, in order); an empty tensor where ``needed`` is false."""
    kept = _STATES.pop(int(token.item()), None)  # a CPU tensor: no device synchronisation
    if kept is None:
        raise RuntimeError("mc2.fused_expert: the forward state of this backward is gone (a "
                           "second backward through one graph is not supported)")
    pairing = kept.pairing
    grads = run_backward(kept.state, CallInputs.of(inputs), grad_out, CallInputs.of(needed),
                         pairing.give_way if pairing is not None else None)
    # exactly what the fake says: a gradient where needed, an empty tensor elsewhere
    return [g if g is not None and need else _empty_like(t)
            for g, t, need in zip(grads.as_list(), inputs, needed)]


def _empty_like(t: Tensor | None) -> Tensor:
    return torch.empty(0) if t is None else t.new_empty(0)


@fused_expert_backward_op.register_fake
def _(grad_out, token, inputs, needed):
    return [torch.empty_like(t) if t is not None and need else _empty_like(t)
            for t, need in zip(inputs, needed)]


# the operator's arguments by name, in its schema's order (read from the function, so no
# position is written out by hand anywhere below)
_ARGUMENTS = tuple(inspect.signature(_fused_expert).parameters)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    args = dict(zip(_ARGUMENTS, inputs))
    ctx.needed = list(args["needs"])
    # the tensor arguments (all but the ids) as the pass names them
    saved = CallInputs(args["x"], args["combine_weights"], args["shared_up"],
                       args["shared_gate"], args["shared_down"], args["shared_scale"],
                       tuple(args["experts"]))
    ctx.save_for_backward(output[1], *saved.as_list())


def _backward(ctx: Any, grad_out: Tensor, _grad_token: Tensor) -> tuple:
    token, *tensors = ctx.saved_tensors
    grads = fused_expert_backward_op(grad_out, token, tensors, ctx.needed)
    g = CallInputs.of([g if need else None for g, need in zip(grads, ctx.needed)])
    by_name = {"x": g.x, "combine_weights": g.combine, "experts": list(g.experts),
               "shared_up": g.shared_up, "shared_gate": g.shared_gate,
               "shared_down": g.shared_down, "shared_scale": g.shared_scale}
    return tuple(by_name.get(name) for name in _ARGUMENTS)  # None: no gradient


fused_expert_op.register_autograd(_backward, setup_context=_setup_context)

FUSED_EXPERT = torch.ops.mc2.fused_expert.default  # what checkpoint policies compare against
