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
another config; :func:`unpatch` restores Megatron's functions.

**Batch overlap** across the layers (``docs/megatron.md``): ``"batch_overlap": true`` (or
``"auto"``) in the same JSON also wraps the GPT layer and block spec functions
(``get_gpt_layer_local_spec``, ``get_gpt_layer_with_transformer_engine_spec``,
``get_gpt_decoder_block_spec``), so that a spec holding a MoE layer builds its
``TransformerLayer`` specs as ``MC2TransformerLayer``::

    MC2_MEGATRON_CONFIG='{"batch_overlap": true}' python pretrain_gpt.py ...
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable

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


def patch(config: MC2Config | None = None, batch_overlap: bool | str | None = None
          ) -> MC2Config:
    """Make every MoE spec Megatron's GPT spec functions build an ``MC2MoELayer`` spec with
    ``config`` (default: from :data:`ENV`); with ``batch_overlap`` (default: from :data:`ENV`)
    ``True`` or ``"auto"``, their layer and block specs holding a MoE layer also build
    ``MC2TransformerLayer`` layers (``use_mc2(..., batch_overlap=...)``). The config in force."""
    import megatron.core.models.gpt.gpt_layer_specs as layer_specs
    import megatron.core.models.gpt.moe_module_specs as moe_specs

    from_env, env_overlap = settings_from_env()
    config = from_env if config is None else config
    overlap = env_overlap if batch_overlap is None else batch_overlap
    if not isinstance(config, MC2Config):
        raise ValueError(f"config must be an mc2.MC2Config, got {type(config).__name__}")
    if overlap not in (True, False, "auto"):
        raise ValueError(f"batch_overlap must be True, False or 'auto', got {overlap!r}")
    unpatch()
    _install(moe_specs, _NAME, _wrapped(_original(getattr(moe_specs, _NAME)),
                                        lambda spec: use_mc2(spec, config=config), config))
    if overlap:
        def with_overlap(spec: Any) -> Any:
            return use_mc2(spec, config=config, batch_overlap=overlap) \
                if holds_moe_layer(spec) else spec

        for name in _LAYER_SPECS:
            _install(layer_specs, name,
                     _wrapped(_original(getattr(layer_specs, name)), with_overlap, config))
    return config


def unpatch() -> None:
    """Megatron's own spec functions back, wherever :func:`patch` put its wrappers."""
    import megatron.core.models.gpt.gpt_layer_specs as layer_specs
    import megatron.core.models.gpt.moe_module_specs as moe_specs

    for home, name in [(moe_specs, _NAME), *((layer_specs, n) for n in _LAYER_SPECS)]:
        _install(home, name, _original(getattr(home, name)))


patch()
