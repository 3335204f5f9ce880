"""Activation checkpointing that recomputes a layer without a second All-to-All.

Non-reentrant activation checkpointing (``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)``) drops what the backward needs and runs the forward again to get it
back. For an MoE layer that recompute would plan, dispatch and combine again: the same two
exchanges per micro-batch a second time, on every rank.

PyTorch's selective checkpointing (``create_selective_checkpoint_contexts(policy)``) lets a
policy keep the outputs of chosen operators. To a policy the fused call is one operator,
``torch.ops.mc2.fused_expert.default`` (:mod:`mc2.engine.autograd.operator`), and
:func:`checkpoint_policy` saves it. Then the forward records what the call's backward reads
(the exchanged rows in expert order, their gate/up projections, the routes) and the
recompute hands that back instead of running the call: no collective in a recomputed step.
Everything else in the checkpointed region is recomputed (or saved, as the policy says).

How the call sees the policy: while selective checkpointing runs a region, its dispatch mode is
on the mode stack and holds the policy and a storage shared by the forward and the recompute.
The call asks the policy about itself in the forward and keeps its records in that storage, in
call order, as PyTorch does for the operators it saves; the recompute takes them back in the
same order. Policies that do not name the fused call leave it to
run again in the recompute (correct, with its collectives).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from mc2.engine.autograd.function import ForwardResult

_STORAGE_KEY = "mc2.fused_expert"  # beside PyTorch's per-operator keys in the shared storage


def _mode_types() -> tuple[type, type]:
    """PyTorch's two selective-checkpointing modes (forward, recompute); subclasses count."""
    from torch.utils import checkpoint

    return checkpoint._CachingTorchDispatchMode, checkpoint._CachedTorchDispatchMode


def _fused_expert_op() -> Any:
    from mc2.engine.autograd.operator import FUSED_EXPERT

    return FUSED_EXPERT


def checkpoint_policy(*also_save: Any) -> Callable[..., Any]:
    """A selective-checkpointing policy that keeps the fused call's exchanged rows.

    Use it with PyTorch's own contexts::

        from functools import partial
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
        context_fn = partial(create_selective_checkpoint_contexts, mc2.checkpoint_policy())
        out = checkpoint(layer, x, use_reentrant=False, context_fn=context_fn)

    Args:
        also_save: further operators to keep (e.g. ``torch.ops.aten.mm.default``); everything
            else is recomputed.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    saved = {_fused_expert_op(), *also_save}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _calls(storage: Any) -> list[tuple[ForwardResult, int]]:
    """Our records in the region's storage (a dict of dicts, keyed by operator in PyTorch)."""
    return storage[_STORAGE_KEY].setdefault("calls", [])


@dataclass
class RecordedCalls:
    """The fused calls of one checkpointed region, in call order (see the module docstring)."""

    storage: Any
    replaying: bool

    def record(self, result: ForwardResult) -> None:
        """Keep a forward's result for the recompute (the output detached: the recompute's
        output is a new autograd node over the same values)."""
        out = result.out.detach() if result.out is not None else None
        # record=None: no cycle storage -> record -> call -> storage to hold the rows
        kept = replace(result, out=out, call=replace(result.call, record=None))
        _calls(self.storage).append((kept, out._version if out is not None else 0))

    def next_result(self) -> ForwardResult:
        results = _calls(self.storage)
        if not results:
            raise RuntimeError("mc2.fused_expert: the recompute makes more fused calls than its "
                               "forward did (the checkpointed function must run the same calls)")
        result, version = results.pop(0)
        if result.out is not None and result.out._version != version:
            raise RuntimeError("mc2.fused_expert: the output of a call kept for the recompute "
                               "was modified in place after the forward; the recompute would "
                               "hand back the modified values (clone it before editing)")
        return result


def active_cache() -> RecordedCalls | None:
    """The records of the selective-checkpointing region being run, when its policy saves the
    fused call; ``None`` otherwise (no region, or a policy that recomputes the call)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    caching, cached = _mode_types()
    for mode in reversed(_get_current_dispatch_mode_stack()):
        storage = getattr(mode, "storage", None)
        if not isinstance(mode, (caching, cached)) or storage is None:
            continue
        if isinstance(mode, cached):  # the recompute: replay what the forward recorded, if anything
            return RecordedCalls(storage, replaying=True) if _calls(storage) else None
        policy = getattr(mode, "policy_fn", None)
        return RecordedCalls(storage, replaying=False) if _saves_the_call(policy) else None
    return None


def _saves_the_call(policy: Callable[..., Any] | None) -> bool:
    from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

    if policy is None:
        return False
    decision = policy(SelectiveCheckpointContext(is_recompute=False), _fused_expert_op())
    if isinstance(decision, bool):
        return decision
    return decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
