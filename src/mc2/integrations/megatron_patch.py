"""One import for Megatron-LM's ``pretrain_gpt.py``-style scripts: every MoE layer the script's
specs build is :class:`~mc2.integrations.megatron.MC2MoELayer`::

    import mc2.integrations.megatron_patch  # first, before the script builds its specs
    # MC2_MEGATRON_CONFIG='{"micro_batches": 2}'  or  MC2_MEGATRON_CONFIG=/path/to/mc2.json

It wraps ``moe_module_specs.get_moe_module_spec_for_backend`` (and, with batch overlap, the GPT
layer and block spec functions) wherever a module holds it by name; a spec built before the
import is not rewritten, hence "first". It also wraps ``forward_backward_no_pipelining`` so that
Megatron's ``overlap_moe_expert_parallel_comm=True`` runs mc2's paired schedule. :data:`ENV` is
read once, at the import, and is the integration's one environment variable; unset or empty
means :data:`~mc2.integrations.megatron.DEFAULT_CONFIG`. :func:`patch` patches again with
another config; :func:`unpatch` restores Megatron's functions.

See docs/megatron.md, 'Turning it on', 'Batch overlap across layers' and "Megatron's own
switch: `overlap_moe_expert_parallel_comm=True`".
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable

from mc2.engine.decide.batch_split import check_mode
from mc2.engine.decide.config import MC2Config
from mc2.integrations.megatron import (
    ENV, config_from_env, holds_moe_layer, settings_from_env, use_mc2)

__all__ = ["ENV", "config_from_env", "patch", "settings_from_env", "unpatch"]
_NAME = "get_moe_module_spec_for_backend"


# the GPT layer and block spec functions that batch overlap rewrites (their TransformerLayers)
_LAYER_SPECS = ("get_gpt_layer_local_spec", "get_gpt_layer_with_transformer_engine_spec",
                "get_gpt_decoder_block_spec")


def _original(fn: Callable[..., Any]) -> Callable[..., Any]:
    return getattr(fn, "__mc2_original__", fn)


def _install(home: types.ModuleType, name: str, new: Callable[..., Any]) -> None:
    """``new`` in place of ``home.name``, in ``home`` and in every imported module that holds
    it (or an earlier patch of it) under its name."""
    old = getattr(home, name)
    originals = {id(old), id(_original(old))}
    for module in list(sys.modules.values()):
        # a module's own namespace only: some modules (torch._classes) answer any getattr
        held = getattr(module, "__dict__", {}).get(name)
        if isinstance(held, types.FunctionType) and (
                id(held) in originals or id(_original(held)) in originals):
            setattr(module, name, new)


def _wrapped(original: Callable[..., Any], rewrite: Callable[[Any], Any],
             config: MC2Config) -> Callable[..., Any]:
    @functools.wraps(original)
    def through_mc2(*args: Any, **kwargs: Any) -> Any:
        return rewrite(original(*args, **kwargs))

    through_mc2.__mc2_original__ = original  # type: ignore[attr-defined]
    through_mc2.mc2_config = config  # type: ignore[attr-defined]
    return through_mc2


def _layers(spec: Any, config: MC2Config, overlap: bool | str) -> Any:
    """A layer or block spec holding a MoE layer, mc2's (:func:`use_mc2`, with ``overlap`` as
    batch overlap: a block that also holds other kinds of layers is then refused, naming
    them)."""
    if not holds_moe_layer(spec):
        return spec
    return use_mc2(spec, config=config, batch_overlap=overlap)


def _pipelined_refused(**kwargs: Any) -> Any:
    raise ValueError("overlap_moe_expert_parallel_comm=True with pipeline parallelism: mc2 "
                     "runs the flag as its paired schedule, which is built for no pipeline "
                     "stages only (Megatron's combined 1F1B calls its dispatcher's parts, "
                     "which mc2's layers do not run); set it to False or "
                     "pipeline_model_parallel_size=1")


def _paired_when_asked(original: Callable[..., Any], paired: Callable[..., Any]
                       ) -> Callable[..., Any]:
    """Megatron's schedule ``original``, running ``paired`` instead where the model's config
    sets ``overlap_moe_expert_parallel_comm`` in a training call (docs/megatron.md)."""
    from mc2.integrations.megatron_schedule import flag_asked

    @functools.wraps(original)
    def schedule(**kwargs: Any) -> Any:
        return (paired if flag_asked(kwargs) else original)(**kwargs)

    schedule.__mc2_original__ = original  # type: ignore[attr-defined]
    return schedule


# Megatron's schedules and what runs in their place with overlap_moe_expert_parallel_comm
# (None: mc2's paired schedule where it measures faster)
_SCHEDULES: dict[str, Callable[..., Any] | None] = {
    "forward_backward_no_pipelining": None,
    "forward_backward_pipelining_with_interleaving": _pipelined_refused,
    "forward_backward_pipelining_without_interleaving": _pipelined_refused,
}


def patch(config: MC2Config | None = None, batch_overlap: bool | str | None = None
          ) -> MC2Config:
    """Make every MoE spec Megatron's GPT spec functions build an ``MC2MoELayer`` spec with
    ``config`` (default: from :data:`ENV`), and their layer and block specs holding a MoE layer
    ``MC2TransformerLayer`` layers, with ``batch_overlap`` (default: from :data:`ENV`);
    Megatron's ``forward_backward_no_pipelining`` honours ``overlap_moe_expert_parallel_comm``
    with mc2's paired schedule (docs/megatron.md). The config in force."""
    import megatron.core.models.gpt.gpt_layer_specs as layer_specs
    import megatron.core.models.gpt.moe_module_specs as moe_specs
    from megatron.core.pipeline_parallel import schedules

    from_env, env_overlap = settings_from_env()
    config = from_env if config is None else config
    overlap = env_overlap if batch_overlap is None else batch_overlap
    if not isinstance(config, MC2Config):
        raise ValueError(f"config must be an mc2.MC2Config, got {type(config).__name__}")
    check_mode(overlap, "batch_overlap")
    unpatch()
    _install(moe_specs, _NAME, _wrapped(_original(getattr(moe_specs, _NAME)),
                                        lambda spec: use_mc2(spec, config=config), config))
    for name in _LAYER_SPECS:
        _install(layer_specs, name, _wrapped(_original(getattr(layer_specs, name)),
                                             lambda spec: _layers(spec, config, overlap), config))
    from mc2.integrations.megatron_schedule import forward_backward_decided

    for name, paired in _SCHEDULES.items():
        _install(schedules, name, _paired_when_asked(
            _original(getattr(schedules, name)), paired or forward_backward_decided))
    return config


def unpatch() -> None:
    """Megatron's own spec functions back, wherever :func:`patch` put its wrappers."""
    import megatron.core.models.gpt.gpt_layer_specs as layer_specs
    import megatron.core.models.gpt.moe_module_specs as moe_specs
    from megatron.core.pipeline_parallel import schedules

    for home, name in [(moe_specs, _NAME), *((schedules, n) for n in _SCHEDULES),
                       *((layer_specs, n) for n in _LAYER_SPECS)]:
        _install(home, name, _original(getattr(home, name)))


patch()
