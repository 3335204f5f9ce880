"""Activation checkpointing that recomputes a layer without a second All-to-All.

Non-reentrant activation checkpointing (``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)``) drops what the backward needs and runs the forward again to get it
back. For an MoE layer that recompute would plan, dispatch and combine again: the same two
exchanges per micro-batch a second time, on every rank (and it runs the K its forward ran:
:meth:`mc2.Planner.again`).

PyTorch's selective checkpointing (``create_selective_checkpoint_contexts(policy)``) lets a
policy keep the outputs of chosen operators. While it runs a region, the fused call *is* one
operator, ``torch.ops.mc2.fused_expert.default`` (:mod:`.operator`; :func:`selective_region`
tells the public call to route through it), and :func:`checkpoint_policy` saves it: PyTorch's
own caching mode keeps the operator's outputs (the output and the token of its saved state)
and hands them back in the recompute, which then runs no collective. The operators the call
runs inside are not seen by the policy, so a policy that also saves ``aten.mm`` or
``aten.max`` saves the region's own, never the call's.
"""

from __future__ import annotations

from typing import Any, Callable

from mc2.engine.autograd.operator import FUSED_EXPERT

# what a selective-checkpointing policy saves to recompute an mc2 call without an exchange
# (its own or a framework's: mc2.integrations.torchtitan.MC2SelectiveAC)
SAVED_OPERATORS = (FUSED_EXPERT,)


def checkpoint_policy(*also_save: Any) -> Callable[..., Any]:
    """A selective-checkpointing policy that keeps the fused call's output and state.

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

    saved = {*SAVED_OPERATORS, *also_save}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_region() -> bool:
    """Whether a selective-checkpointing region is running (its forward or its recompute):
    PyTorch's caching dispatch modes are on the mode stack."""
    from torch.utils import checkpoint
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    modes = (checkpoint._CachingTorchDispatchMode, checkpoint._CachedTorchDispatchMode)
    return any(isinstance(mode, modes) for mode in _get_current_dispatch_mode_stack())
