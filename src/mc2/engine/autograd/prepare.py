"""What every adapter does before a pass: the config, autocast, the inputs' layout, the deadline.

Shared by the public call (:mod:`.ops`), the custom op (:mod:`.operator`) and the staged calls
(:mod:`.staged`), so that the three run one call the same way.
"""

from __future__ import annotations

import contextvars
import weakref
from typing import Any, Callable

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from mc2.engine.decide.config import MC2Config
from mc2.engine.transport.deadline import CommTimeout, deadline, resolve_timeout

_traced_config: Callable[..., MC2Config] | None = None


def _config_while_tracing(config: MC2Config | None, options: tuple) -> MC2Config:
    """A config built from keyword options, as a constant of the traced graph (Dynamo does
    not trace the dataclass machinery; the options are constants anyway). Wrapped on first use
    only: ``torch.compiler.assume_constant_result`` imports Dynamo, which costs seconds at
    ``import mc2`` on every rank of every job that never compiles."""
    global _traced_config
    if _traced_config is None:
        _traced_config = torch.compiler.assume_constant_result(
            lambda cfg, opts: MC2Config.of(cfg, **dict(opts)))
    return _traced_config(config, options)


def resolve_config(config: MC2Config | None, options: dict[str, Any]
                   ) -> tuple[MC2Config, str | None]:
    """The call's config, or the defaults and what is wrong: a bad value must reach the
    handshake (an error on every rank), not stop this rank alone before it."""
    try:
        if options and torch.compiler.is_compiling():
            return _config_while_tracing(config, tuple(sorted(options.items()))), None
        return MC2Config.of(config, **options), None
    except ValueError as exc:
        return MC2Config(), str(exc).removeprefix("MC2Config: ")


# Low-precision copies of parameters under autocast, one per (parameter, dtype, version), held
# only while something else (the graph that saved it) holds the copy: autocast's own cast
# cache, for a call that is not an autocast op.
_CASTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _cast(t: Any, dtype: torch.dtype) -> Any:
    """``t`` in ``dtype``, differentiably; a parameter's copy is reused while its values are
    unchanged and the copy is alive (so batch overlap's micro-batches and the calls of one
    forward share one copy, as autocast's cache shares it between ops)."""
    if not isinstance(t, Tensor) or not t.is_floating_point() or t.dtype == dtype:
        return t
    if not (t.is_leaf and t.requires_grad) or torch.compiler.is_compiling():
        return t.to(dtype)
    entry = _CASTS.get(t)
    if entry is not None:
        version, ref = entry
        copy = ref()
        if copy is not None and version == t._version and copy.dtype == dtype:
            return copy
    copy = t.to(dtype)
    _CASTS[t] = (t._version, weakref.ref(copy))
    return copy


def autocast_inputs(x: Any, named: dict[str, Any], routing_weights: Any, shared: tuple
                    ) -> tuple[Any, dict[str, Any], Any, tuple]:
    """Under ``torch.autocast``, the call computes in the autocast dtype, as a matmul would:
    floating inputs are cast (differentiably: gradients reach the parameters in their own
    dtype; parameters through a cast cache, :func:`_cast`) and the call itself runs with
    autocast off (its GEMMs write into buffers)."""
    if not isinstance(x, Tensor) or not torch.is_autocast_enabled(x.device.type):
        return x, named, routing_weights, shared
    dtype = torch.get_autocast_dtype(x.device.type)
    return (_cast(x, dtype), {k: _cast(v, dtype) for k, v in named.items()},
            _cast(routing_weights, dtype), tuple(_cast(t, dtype) for t in shared))


def guarded(fn: Callable[[], Any], cfg: MC2Config, x: Any) -> Any:
    """``fn()`` under the call's deadline, with autocast off, a timeout named by its phase."""
    seconds = resolve_timeout(cfg.timeout)
    device_type = x.device.type if isinstance(x, Tensor) else "cpu"
    with deadline(seconds), torch.autocast(device_type, enabled=False):
        try:
            return fn()
        except CommTimeout as exc:
            if exc.phase is not None:
                raise
            raise exc.at(phase="forward") from exc.__cause__  # the handshake, counts, planning


def shared_inputs(x: Tensor, shared: tuple) -> tuple:
    """The shared experts as one expert of width ``S * shared_ffn`` with their scale
    ``[T, 1]``: the pass's layout (:class:`~mc2.engine.passes.run.CallInputs`)."""
    hidden = x.shape[-1]
    s_up, s_gate, s_down, s_scale = shared
    if s_up is not None:
        n, _, f = s_up.shape
        s_up, s_gate, s_down = (s_up.permute(1, 0, 2).reshape(1, hidden, n * f),
                                s_gate.permute(1, 0, 2).reshape(1, hidden, n * f),
                                s_down.reshape(1, n * f, hidden))
    if s_scale is not None:  # [..., 1] -> [T, 1], the layout of the flattened tokens
        s_scale = s_scale.reshape(-1, 1)
    return s_up, s_gate, s_down, s_scale


# The runtime objects (timeline, planner, workspace) of an eager call routed through the
# custom op (under selective checkpointing): an op's schema carries no Python objects.
EAGER_RUNTIME: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "mc2_eager_runtime", default=None)
