"""Where mc2 reads a module's weights instead of calling it: whether the read is what the call
would compute.

mc2 runs a shared MLP inside its call as *views* of the MLP's weights, and a model's experts on
stand-ins for their parameters. That is the module's computation only while the module is
exactly what it looks like. A LoRA adapter (PEFT wraps the ``nn.Linear`` in a ``LoraLayer``,
or registers a parametrization on an experts tensor while its forward runs), a quantised
layer (transformers' ``FP8Linear``, bitsandbytes' ``Linear4bit``: ``nn.Linear`` subclasses with
forwards of their own), a forward hook (Megatron's distributed optimizer waits for a
parameter's all-gather in a forward pre-hook) all change what calling the module computes,
and none of them shows in its ``.weight``.

So every place that reads weights asks here first, **at every forward** (a few attribute
reads, no device work): adapters are added after ``enable_mc2`` (``get_peft_model`` on the
patched model) and removed again (``unload``), so a check made once would go stale. Where the
answer is a problem, the caller runs the module as the model runs it (a shared MLP beside the
call) or refuses with a ``ValueError``; :func:`say_once` says why, once per reason.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from torch import nn
from torch.nn.utils import parametrize

from mc2.observation.once import warn_once


class WeightReadWarning(UserWarning):
    """mc2 runs a module as the model runs it instead of reading its weights (said once per
    reason)."""


def say_once(reason: str) -> None:
    """Warn with ``reason`` the first time it is given in this process."""
    warn_once(reason, WeightReadWarning, stacklevel=3)


def read_problem(module: Any, kinds: tuple[type, ...] = (nn.Linear,),
                 ignore: Callable[[Any], bool] | None = None) -> str | None:
    """Why reading ``module.weight`` is not what calling ``module`` computes, or ``None``.

    ``kinds``: the exact classes whose forward is their weight's GEMM and nothing else (a
    subclass may compute more: ``FP8Linear`` is an ``nn.Linear``). Also a problem: a forward
    hook or pre-hook (it would not run; ``ignore``: hooks the caller runs itself) and a
    parametrization (the read would bypass it).
    """
    if type(module) not in kinds:
        names = " or ".join(_qualified(k) for k in kinds)
        return (f"{_qualified(type(module))} is not a plain {names} (an adapter or a quantised "
                "layer computes more than its weight)")
    if (problem := hook_problem(module, ignore)) is not None:
        return problem
    if parametrize.is_parametrized(module):
        return f"{type(module).__name__} has a parametrization of {list(module.parametrizations)}"
    return None


def first_problem(modules: Iterable[tuple[str, Any]], kinds: tuple[type, ...] = (nn.Linear,),
                  ignore: Callable[[Any], bool] | None = None) -> str | None:
    """The first ``name: problem`` of :func:`read_problem` over ``(name, module)`` pairs."""
    for name, module in modules:
        if (problem := read_problem(module, kinds, ignore)) is not None:
            return f"{name}: {problem}"
    return None


def framework_hook(hook: Any) -> bool:
    """A hook that adds nothing a call of mc2 must run: FSDP2's (its gathers and reductions,
    which mc2's layer loop runs itself) and Hugging Face's output capturing (it only records,
    and batch overlap records per micro-batch: :mod:`mc2.integrations.split_records`)."""
    return type(getattr(hook, "__self__", None)).__name__ == "FSDPState" or \
        getattr(hook, "__qualname__", "").endswith("output_capturing_hook")


def user_hook_problem(module: Any, also: Callable[[Any], bool] | None = None) -> str | None:
    """:func:`hook_problem` of ``module`` without :func:`framework_hook`'s (nor ``also``'s:
    hooks a framework's caller runs itself)."""
    if not isinstance(module, nn.Module):
        return None
    return hook_problem(module, framework_hook if also is None
                        else lambda hook: framework_hook(hook) or also(hook))


def first_user_hook(modules: Iterable[tuple[str, Any]],
                    also: Callable[[Any], bool] | None = None) -> str | None:
    """The first ``name: problem`` of :func:`user_hook_problem` over ``(name, module)`` pairs,
    as :func:`first_problem` is for reads."""
    for name, module in modules:
        if (problem := user_hook_problem(module, also)) is not None:
            return f"{name}: {problem}"
    return None


def hook_problem(module: Any, ignore: Callable[[Any], bool] | None = None) -> str | None:
    """Where calling ``module`` runs more than its own class's forward (which a read of its
    weights, or a module standing in for it, would not run), what: a forward or backward hook
    or pre-hook, its own or every module's (``register_module_forward_hook``; ``ignore``:
    hooks the caller runs itself), or a ``forward`` replaced on the instance; else ``None``.
    (Backward hooks, global hooks and replaced forwards passed unseen: gradients or outputs
    differed from the model's, silently; found by a review.)"""
    if (replaced := vars(module).get("forward")) is not None and not _framework_forward(replaced):
        return f"{type(module).__name__} has its forward replaced on the instance"
    hooks = [h for table in (module._forward_pre_hooks, module._forward_hooks,
                             module._backward_pre_hooks, module._backward_hooks, *_global_hooks())
             for h in table.values() if not _records_only(h) and (ignore is None or not ignore(h))]
    if not hooks:
        return None
    names = ", ".join(getattr(h, "__qualname__", type(h).__name__) for h in hooks)
    return f"{type(module).__name__} has hooks ({names})"


def _framework_forward(forward: Any) -> bool:
    """A forward a framework put on the instance around the class's own: TorchTitan's
    ``parallelize`` redistributes a module's inputs and outputs so (mc2's integration does
    what it does for the calls it makes)."""
    return getattr(forward, "__qualname__", "").endswith(
        "parallelize.<locals>.forward_with_redistribution")


def _global_hooks() -> tuple[dict, ...]:
    """torch's hooks on every module's call (``register_module_*_hook``)."""
    from torch.nn.modules import module as torch_module

    return (torch_module._global_forward_pre_hooks, torch_module._global_forward_hooks,
            torch_module._global_backward_pre_hooks, torch_module._global_backward_hooks)


def _records_only(hook: Any) -> bool:
    """torch's ``ModuleTracker`` (under ``FlopCounterMode`` and the debug modes): it records
    which module runs and changes nothing."""
    return type(getattr(hook, "__self__", None)).__name__ == "ModuleTracker"


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
