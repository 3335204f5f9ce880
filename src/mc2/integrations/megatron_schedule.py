"""Megatron-Core's gradient accumulation with one micro-batch's forward beside another's
backward: :func:`forward_backward_paired` has the signature of Megatron's
``forward_backward_no_pipelining``, so a ``pretrain_gpt.py``-style script swaps one function
(or sets ``overlap_moe_expert_parallel_comm=True`` under :mod:`~mc2.integrations.megatron_patch`).

Each micro-batch runs through Megatron's own ``forward_step`` and ``backward_step``, as its
schedule runs them; the forward of micro-batch n+1 runs beside the backward of micro-batch n
(:func:`mc2.engine.autograd.pairing.run_pairs`). What pairs is each ``MC2MoELayer``'s call.

See docs/megatron.md, 'Gradient accumulation: one micro-batch's forward beside another's
backward' (what runs Megatron's function unchanged, what is refused and why).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from mc2.engine.autograd.pairing import run_pairs
from mc2.engine.autograd.staged import micro_batch_label
from mc2.engine.decide.batch_split import say_once
from mc2.forward_backward import agree_step, decided_schedule
from mc2.parallel.layer_gather import fsdp_units

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules
from megatron.core.utils import get_model_config, get_model_type


def flag_asked(kwargs: dict[str, Any]) -> bool:
    """Whether a call of one of Megatron's schedules with ``kwargs`` is a training call whose
    model's config sets ``overlap_moe_expert_parallel_comm`` (Megatron's flag changes only
    the training schedule)."""
    model = kwargs["model"]
    return not kwargs.get("forward_only") and get_model_config(
        model[0] if isinstance(model, list) else model).overlap_moe_expert_parallel_comm


def megatrons(**kwargs: Any) -> Any:
    """Megatron's own ``forward_backward_no_pipelining`` (not the patch's, which may be this
    module's), with its own handling of ``overlap_moe_expert_parallel_comm`` off: its combined
    1F1B would call the dispatcher's parts, which mc2's layers do not run."""
    function = schedules.forward_backward_no_pipelining
    if not flag_asked(kwargs):
        return getattr(function, "__mc2_original__", function)(**kwargs)
    raise ValueError("overlap_moe_expert_parallel_comm=True under mc2 runs mc2's paired "
                     "schedule, which takes one model chunk without hybrid context "
                     "parallelism; set it to False")


def forward_backward_paired(**kwargs: Any) -> list[Any]:
    """Megatron's ``forward_backward_no_pipelining`` (same keywords, same result: the
    ``forward_data_store``), each micro-batch's forward after the first run beside the
    previous one's backward (module docstring).

    Raises:
        ValueError: the model makes no mc2 call, so nothing was paired (every rank alike,
            after the first micro-batch's forward); the model is sharded by Megatron's FSDP
            wrappers or FSDP2 (before anything runs; ``overlap_moe_expert_parallel_comm``
            runs Megatron's loop for those, and says so once).
    """
    return _forward_backward(kwargs, True)


def forward_backward_decided(**kwargs: Any) -> list[Any]:
    """:func:`forward_backward_paired` where it measured faster, else the sequential loop
    (through the same ``forward_step`` and ``backward_step``): the first steps run both ways,
    as ``mc2.forward_backward(overlap="auto")`` does, and the faster one is kept. What
    Megatron's ``overlap_moe_expert_parallel_comm=True`` runs under the patch import."""
    return _forward_backward(kwargs, "auto")


# Megatron's FSDP wrappers (use_torch_fsdp2, use_megatron_fsdp), by class name: their hooks
# hold one pass's state per unit, which a paired step would mix (mc2.parallel.paired_fsdp)
_FSDP_WRAPPERS = ("TorchFullyShardedDataParallel", "FullyShardedDataParallel")


def unpaired_sharding(model: torch.nn.Module) -> str | None:
    """Why ``model``'s sharding keeps this schedule from pairing it, or ``None``."""
    if type(model).__name__ in _FSDP_WRAPPERS or fsdp_units(model):
        return ("the model is sharded by FSDP (use_torch_fsdp2 or use_megatron_fsdp), whose "
                "units keep one pass's state at a time: a paired step must hold them gathered "
                "from its first forward to its last backward, which this schedule does not "
                "do (mc2.forward_backward does, for FSDP2 of its own)")
    return None


def unpaired_config(config: Any) -> str | None:
    """Why ``config`` keeps this schedule from pairing, or ``None``: Megatron's fine-grained
    activation offloading keeps its chunks in forward order, each forward's followed by its
    own backward, which a paired step does not keep."""
    if getattr(config, "fine_grained_activation_offloading", False):
        return ("fine_grained_activation_offloading=True: its offload manager takes each "
                "micro-batch's forward to be followed by that micro-batch's backward, and a "
                "paired step runs the next forward first")
    return None


def _forward_backward(kwargs: dict[str, Any], overlap: bool | str) -> list[Any]:
    model, data_iterator = kwargs["model"], kwargs["data_iterator"]
    if isinstance(model, list):
        if len(model) != 1:  # Megatron's own function refuses model chunks
            return megatrons(**kwargs)
        model = model[0]
    if isinstance(data_iterator, list) and len(data_iterator) == 1:
        data_iterator = data_iterator[0]
    config = get_model_config(model)
    count = kwargs["num_microbatches"]
    if kwargs.get("forward_only") or getattr(config, "hybrid_context_parallel", False):
        return megatrons(**kwargs)
    agree_step(count, overlap, None)  # a rank of 1 micro-batch beside one of 2 too
    if count < 2 and not config.overlap_moe_expert_parallel_comm:
        return megatrons(**kwargs)
    if overlap is not False and (why := unpaired_sharding(model) or unpaired_config(config)):
        if overlap is True:  # every rank alike: every rank runs the same model
            raise ValueError(f"forward_backward_paired: {why}; use Megatron's "
                             "forward_backward_no_pipelining")
        say_once(why, "pairing one micro-batch's forward with another's backward")
        overlap = False
    if config.timers is not None:  # as Megatron's loop times its step
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
    pg_collection = kwargs.get("pg_collection")
    cp_size = pg_collection.cp.size() if pg_collection is not None else \
        parallel_state.get_context_parallel_world_size()
    first_val_step = kwargs.get("first_val_step")
    collect = kwargs.get("collect_non_loss_data", False)
    store: list[Any] = []
    model_type = get_model_type(model)
    device = next(model.parameters()).device
    tokens = [torch.zeros([], dtype=torch.int, device=device)]
    no_sync = config.no_sync_func or contextlib.nullcontext

    def forward(i: int) -> Any:
        with micro_batch_label(i):
            output, num_tokens = schedules.forward_step(
                kwargs["forward_step_func"], data_iterator, model, count, None, store, config,
                cp_size, collect, is_first_microbatch=schedules.check_first_val_step(
                    first_val_step, False, i == 0), current_microbatch=i)
        tokens[0] = tokens[0] + num_tokens
        return output

    def backward(output: Any) -> None:
        schedules.backward_step(None, output, None, model_type, config)

    def paired() -> None:
        run_pairs(count, forward, backward, around=no_sync, strict=overlap is True,
                  unpaired="forward_backward_paired: the model made no mc2 call (no "
                           "MC2MoELayer: use_mc2(spec)), so nothing can be paired; use "
                           "Megatron's forward_backward_no_pipelining")

    def sequential() -> None:  # Megatron's loop: the last micro-batch outside no_sync
        with no_sync():
            for i in range(count - 1):
                backward(forward(i))
        backward(forward(count - 1))

    decided_schedule(model, overlap, None, count, paired=paired, sequential=sequential,
                     agreed=True)
    if config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func(
            [model], tokens[0] if config.calculate_per_token_loss else None,
            pg_collection=pg_collection, force_all_reduce=kwargs.get("force_all_reduce", False))
    if getattr(config, "fine_grained_activation_offloading", False):  # as Megatron's loop
        schedules.off_interface.reset()
    if config.timers is not None:
        config.timers("forward-backward").stop()
    return store
