"""One import for Megatron-LM's ``pretrain_gpt.py``-style scripts: every MoE layer the script's
specs build is :class:`~mc2.integrations.megatron.MC2MoELayer`::

    import mc2.integrations.megatron_patch  # first, before the script builds its specs
    # MC2_MEGATRON_CONFIG='{"micro_batches": 2}'  or  MC2_MEGATRON_CONFIG=/path/to/mc2.json

**Where it patches.** Every MoE spec of megatron-core 0.16.1's GPT specs
(``get_gpt_layer_local_spec``, ``get_gpt_layer_with_transformer_engine_spec``,
``get_gpt_decoder_block_spec``, ``get_moe_module_spec``, the MTP and experimental-attention
specs) is made by ``moe_module_specs.get_moe_module_spec_for_backend``; that one function is
wrapped with :func:`~mc2.integrations.megatron.use_mc2`, in its module and in every module
already imported that holds it by name (``gpt_layer_specs`` does). A spec built before the
import (a module-level spec such as ``mamba_layer_specs.moe``, made when that module is
imported) is not rewritten: import this first. Megatron's own flags stay as they are, and a
setting the layer cannot honour raises ``ValueError`` naming it when the model is built.

**The config** comes from the environment variable :data:`ENV` (read once, at the import; the
one environment variable of this integration): JSON text (starting with ``{``) or the path of a
JSON file, with :class:`~mc2.MC2Config`'s fields (``MC2Config.to_dict``'s form). Unset or
empty: :data:`~mc2.integrations.megatron.DEFAULT_CONFIG`. :func:`patch` patches again with
another config; :func:`unpatch` restores Megatron's function.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable

from mc2.engine.decide.config import MC2Config
from mc2.integrations.megatron import ENV, config_from_env, use_mc2

__all__ = ["ENV", "config_from_env", "patch", "unpatch"]
_NAME = "get_moe_module_spec_for_backend"


def _original(fn: Callable[..., Any]) -> Callable[..., Any]:
    return getattr(fn, "__mc2_original__", fn)


def _install(new: Callable[..., Any]) -> None:
    """``new`` in place of the spec function, in its module and in every imported module that
    holds it (or an earlier patch of it) under its name."""
    import megatron.core.models.gpt.moe_module_specs as specs

    old = getattr(specs, _NAME)
    originals = {id(old), id(_original(old))}
    for module in list(sys.modules.values()):
        # a module's own namespace only: some modules (torch._classes) answer any getattr
        held = getattr(module, "__dict__", {}).get(_NAME)
        if isinstance(held, types.FunctionType) and (
                id(held) in originals or id(_original(held)) in originals):
            setattr(module, _NAME, new)


def patch(config: MC2Config | None = None) -> MC2Config:
    """Make every MoE spec Megatron's GPT spec functions build an ``MC2MoELayer`` spec with
    ``config`` (default: from :data:`ENV`); the config in force."""
    import megatron.core.models.gpt.moe_module_specs as specs

    config = config_from_env() if config is None else config
    if not isinstance(config, MC2Config):
        raise ValueError(f"config must be an mc2.MC2Config, got {type(config).__name__}")
    original = _original(getattr(specs, _NAME))

    @functools.wraps(original)
    def moe_spec_through_mc2(*args: Any, **kwargs: Any) -> Any:
        return use_mc2(original(*args, **kwargs), config=config)

    moe_spec_through_mc2.__mc2_original__ = original  # type: ignore[attr-defined]
    moe_spec_through_mc2.mc2_config = config  # type: ignore[attr-defined]
    _install(moe_spec_through_mc2)
    return config


def unpatch() -> None:
    """Megatron's own spec function back, wherever :func:`patch` put its wrapper."""
    import megatron.core.models.gpt.moe_module_specs as specs

    _install(_original(getattr(specs, _NAME)))


patch()
