"""mc2 in Megatron-Core: :class:`MC2MoELayer`, a ``MoELayer`` whose dispatch, experts and
combine are mc2's pipeline, and :func:`use_mc2`, which puts it in a layer or block spec.

Tested with megatron-core 0.16.1. Megatron's token dispatcher is a closed if/elif in
``MoELayer.__init__``, so the seam is the layer, as in Ascend's MindSpeed
(``--moe-alltoall-mc2``). The layer holds the submodules Megatron built, so its checkpoint keys
are ``MoELayer``'s; Megatron's router runs untouched, and its own experts module is the experts
stage of :func:`mc2.fused_expert_module`. The call reads nothing to the host beyond its own two
reads: the top-k slots come from ``routing_map`` on the device, and the experts'
``tokens_per_expert`` from the counts the call read anyway. Refusals: :func:`megatron_problem`.

See docs/megatron.md, 'Turning it on' and 'What runs' (the shared experts inside the call, why
scaling after the combine gives Megatron's product, dropped slots, ``overlap_param_gather``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mc2.engine.autograd.ops import fused_expert_module
from mc2.engine.autograd.staged import StagedCall, begin_module
from mc2.engine.compute.module_experts import ModuleExperts
from mc2.engine.decide.config import MC2Config
from mc2.engine.decide.validation import NO_EXPERT

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from mc2.engine.decide.batch_split import MIN_TOKENS, check_mode
from mc2.integrations.megatron_overlap import MC2TransformerLayer, is_param_gather_hook
from mc2.integrations.weight_reads import first_problem, first_user_hook, hook_problem, say_once

# what the layer runs when the spec names no config (the defaults: "auto" micro-batches)
DEFAULT_CONFIG = MC2Config()
# the config of mc2.integrations.megatron_patch: JSON text or a JSON file's path
ENV = "MC2_MEGATRON_CONFIG"


def megatron_problem(config: Any, pg_collection: Any) -> str | None:
    """Why :class:`MC2MoELayer` cannot honour this ``TransformerConfig`` (and process groups),
    or ``None``. Every reason names the field to change.

    The layer refuses what would compute something else than Megatron's ``MoELayer``, or what
    it has not been checked against:

    - ``expert_tensor_parallel_size`` > 1 and ``tensor_model_parallel_size`` > 1: the expert
      and attention shards of a token live on several ranks, which mc2's exchange does not
      gather;
    - ``moe_pad_expert_input_to_capacity``: Megatron then sends padding rows as tokens;
    - ``moe_token_dispatcher_type="flex"``: DeepEP/HybridEP dispatch, which the layer
      replaces;
    - ``add_bias_linear``: Megatron adds the experts' output bias unscaled, mc2 scales the whole
      output by the probability;
    - ``moe_apply_probs_on_input``: the probability scales the input, not the output;
    - ``moe_latent_size``, ``fp8`` / ``fp4``, ``cuda_graph_impl``, ``delay_wgrad_compute``,
      selective recompute of ``"moe"``: paths of Megatron's layer this one does not run;
    - ``moe_shared_expert_overlap`` with shared experts that are no plain SwiGLU (another
      activation, no GLU, ``glu_linear_offset``, ``activation_func_clamp_value``): the layer
      then runs them inside mc2's call (:func:`shared_views`), which computes plain SwiGLU;
    - ``gradient_accumulation_fusion``: Megatron's fused weight-gradient kernel writes
      ``main_grad`` of the parameter it was given, and mc2 runs the experts on stand-ins for
      their parameters (the gradients reach ``.grad``, where Megatron's DDP hooks read them
      when the fusion is off).
    """
    expert_tp = getattr(pg_collection, "expt_tp", None)
    if (expert_tp is not None and expert_tp.size() > 1) or (
            getattr(config, "expert_tensor_parallel_size", None) or 1) > 1:
        return ("expert_tensor_parallel_size must be 1 for MC2MoELayer (an expert split over "
                f"ranks is not supported), got {config.expert_tensor_parallel_size}")
    if getattr(config, "tensor_model_parallel_size", 1) > 1:
        return ("tensor_model_parallel_size must be 1 for MC2MoELayer (tokens sharded over "
                f"tensor-parallel ranks are not gathered), got {config.tensor_model_parallel_size}")
    if getattr(config, "moe_pad_expert_input_to_capacity", False):
        return ("moe_pad_expert_input_to_capacity is not supported by MC2MoELayer (rows are not "
                "padded to the capacity; mc2's own capacity mode is MC2Config(capacity=N)); set "
                "it to False")
    dispatcher = getattr(config, "moe_token_dispatcher_type", "alltoall")
    if dispatcher not in ("alltoall", "allgather"):
        return (f"moe_token_dispatcher_type={dispatcher!r} is not supported by MC2MoELayer "
                "(it runs its own dispatch); use 'alltoall'")
    if getattr(config, "add_bias_linear", False):
        return ("add_bias_linear must be False for MC2MoELayer (Megatron adds the experts' output "
                "bias unscaled by the routing probability; mc2 scales the whole output)")
    if getattr(config, "moe_apply_probs_on_input", False):
        return "moe_apply_probs_on_input is not supported by MC2MoELayer; set it to False"
    if getattr(config, "moe_latent_size", None):
        return "moe_latent_size is not supported by MC2MoELayer; set it to None"
    for name in ("fp8", "fp4"):
        if getattr(config, name, None):
            return f"{name} is not supported by MC2MoELayer, got {getattr(config, name)!r}"
    if getattr(config, "cuda_graph_impl", "none") not in (None, "none"):
        return (f"cuda_graph_impl={config.cuda_graph_impl!r} is not supported by MC2MoELayer; "
                "set it to 'none'")
    if getattr(config, "delay_wgrad_compute", False):
        return "delay_wgrad_compute is not supported by MC2MoELayer; set it to False"
    if getattr(config, "recompute_granularity", None) == "selective" and "moe" in (
            getattr(config, "recompute_modules", None) or ()):
        return ("recompute_modules must not hold 'moe' for MC2MoELayer (its recompute would run "
                "the layer's collectives again); use full recompute or drop 'moe'")
    if getattr(config, "moe_shared_expert_overlap", False) and getattr(
            config, "moe_shared_expert_intermediate_size", None):
        inside = ("moe_shared_expert_overlap runs the shared experts inside mc2's call, a plain "
                  "SwiGLU; or set it to False (they then run beside the call, as Megatron runs "
                  "them)")
        if not (config.gated_linear_unit and config.activation_func is torch.nn.functional.silu):
            return f"{inside}: it needs gated_linear_unit=True and activation_func=F.silu"
        for name, plain in (("glu_linear_offset", 0.0), ("activation_func_clamp_value", None)):
            if getattr(config, name, plain) != plain:
                return f"{inside}: it needs {name}={plain}, got {getattr(config, name)!r}"
    if getattr(config, "gradient_accumulation_fusion", False):
        return ("gradient_accumulation_fusion must be False for MC2MoELayer (the experts' "
                "weight gradients reach .grad, which Megatron's DDP adds to main_grad)")
    return None


class MC2MoELayer(MoELayer):
    """Megatron's ``MoELayer`` with mc2's pipeline in place of its dispatcher's dispatch,
    experts call and combine (docs/megatron.md, 'What runs').

    Args:
        config, submodules, layer_number, pg_collection: as ``MoELayer``.
        mc2_config: how mc2's calls run (default :data:`DEFAULT_CONFIG`); every rank passes the
            same. :func:`use_mc2` puts it in the spec's ``params``.

    Raises:
        ValueError: naming the field, for a setting :func:`megatron_problem` refuses.
    """

    def __init__(self, config: Any, submodules: Any = None, layer_number: int | None = None,
                 pg_collection: Any = None, mc2_config: MC2Config | None = None) -> None:
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        if (problem := megatron_problem(config, pg_collection)) is not None:
            raise ValueError(problem)
        if mc2_config is not None and not isinstance(mc2_config, MC2Config):
            raise ValueError(f"mc2_config must be an mc2.MC2Config, got "
                             f"{type(mc2_config).__name__}")
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         pg_collection=pg_collection)
        self.mc2_config = mc2_config or DEFAULT_CONFIG

    def forward(self, hidden_states: Tensor, intermediate_tensors: Any = None,
                padding_mask: Tensor | None = None) -> tuple[Tensor, None]:
        """``hidden_states [S, B, H]`` -> ``(output [S, B, H], None)``, as ``MoELayer``.

        ``padding_mask [B, S]`` (True: a real token) goes to the router, as Megatron passes it.
        """
        if intermediate_tensors is not None:
            raise ValueError("intermediate_tensors (partial CUDA-graph capture) is not supported "
                             "by MC2MoELayer")
        inside = self._shared_inside(hidden_states)
        shared = self.shared_beside(hidden_states)
        probs, routing_map = self.route(hidden_states, self._token_mask(padding_mask))
        output = self.routed(hidden_states, probs, routing_map, **inside)
        if shared is not None:
            output = output + shared
        return output, None

    def routed(self, hidden_states: Tensor, probs: Tensor, routing_map: Tensor,
               **shared: Tensor) -> Tensor:
        """The routed experts' weighted sum for every token, through mc2's pipeline (plus the
        shared experts ``shared`` names, :func:`shared_views`).

        ``probs [T, E]`` (zero off the route) and ``routing_map [T, E] bool`` are the router's.
        Every token's ``moe_router_topk`` slots are taken from the map (``topk`` of it, on
        the device: no read); with a capacity factor a token may keep fewer, and its dropped
        slots get the id of no expert (``-1``): they send no row and compute nothing, and
        their weight is zero (the map's own zero, so no gradient reaches the probabilities
        there either). One read-free path for both (the capacity factor's used to take the
        kept pairs with ``nonzero``, which makes the host wait for the device; then to send
        the dropped slots, weight 0, to whichever expert ``topk`` picked among the map's
        ties).
        """
        x, ids, weights = self._slots(hidden_states, probs, routing_map)
        self._refuse_experts_hooks()
        wait_param_gathers(self.experts)
        out = fused_expert_module(x, self.experts, ids, weights, group=self.ep_group,
                                  config=self.mc2_config, num_experts=self.config.num_moe_experts,
                                  local_experts=self.num_local_experts,
                                  forward=self._experts_stage, tokens_per_expert=True,
                                  **shared)
        return out.reshape(hidden_states.shape)

    def begin_staged(self, hidden_states: Tensor, padding_mask: Tensor | None = None
                     ) -> StagedCall:
        """:meth:`forward`'s router and mc2's call in stages, for batch overlap
        (:mod:`mc2.integrations.megatron_overlap`): routes, plans the call and issues its
        dispatch; ``.experts()`` then ``.end()`` (``[tokens, H]``) finish it. Shared experts
        outside the call are the caller's (:meth:`shared_beside`)."""
        inside = self._shared_inside(hidden_states)
        x, ids, weights = self._slots(
            hidden_states, *self.route(hidden_states, self._token_mask(padding_mask)))
        self._refuse_experts_hooks()
        wait_param_gathers(self.experts)
        experts = ModuleExperts.of(self.experts, x.shape[-1], forward=self._experts_stage,
                                   local_experts=self.num_local_experts, tokens_per_expert=True)
        return begin_module(x, experts, ids, weights, group=self.ep_group,
                            config=self.mc2_config, num_experts=self.config.num_moe_experts,
                            shared=(inside.get("shared_up"), inside.get("shared_gate"),
                                    inside.get("shared_down")),
                            shared_scale=inside.get("shared_scale"))

    def shared_beside(self, hidden_states: Tensor) -> Tensor | None:
        """The shared experts' output where they run beside mc2's call (as Megatron runs
        them), or ``None`` (no shared experts, or inside: :meth:`_shared_inside`)."""
        if not self.use_shared_expert or self._shared_runs_inside():
            return None
        if self.shared_expert_overlap:  # asked inside, but their linears must be called
            return overlapped_shared(self.shared_experts, hidden_states)
        return self.shared_experts_compute(hidden_states)

    def _shared_inside(self, hidden_states: Tensor) -> dict[str, Tensor]:
        """The shared experts as the call's ``shared_*`` arguments where they run inside it
        (``moe_shared_expert_overlap``: Megatron overlaps them with its dispatcher, mc2's call
        runs them where its pipeline waits), else nothing."""
        if self._shared_runs_inside():
            wait_param_gathers(self.shared_experts)
            return shared_views(self.shared_experts, hidden_states)
        return {}

    def _shared_runs_inside(self) -> bool:
        """``moe_shared_expert_overlap`` and, at this forward, projections that read as their
        weights (:func:`shared_read_problem`: an adapter or a hook of the user's makes them run
        beside, called, said once)."""
        if not (self.use_shared_expert and self.shared_expert_overlap):
            return False
        if (problem := shared_read_problem(self.shared_experts)) is not None:
            say_once(f"mc2: MC2MoELayer's shared experts run beside the call, as Megatron runs "
                     f"them: {problem}")
            return False
        return True

    def _refuse_experts_hooks(self) -> None:
        """A hook of the user's on the experts module, or its forward replaced: mc2 calls it
        with unit weights and applies the router's probabilities after the combine, where
        Megatron passes them in, so a hook that is not linear in them saw other tensors (a
        clamp: outputs 0.83 apart; found by a review). Every rank holds the same modules, so
        every rank raises alike, checked at each forward."""
        if (problem := first_user_hook([("experts", self.experts)], is_param_gather_hook)):
            raise ValueError(f"MC2MoELayer: {problem}: mc2 calls the experts module with unit "
                             "weights and applies the router's probabilities after the "
                             "combine, so the hook would see other tensors than under "
                             "Megatron's MoELayer; register it on the MC2MoELayer instead")

    @staticmethod
    def _token_mask(padding_mask: Tensor | None) -> Tensor | None:
        """Megatron's ``padding_mask [B, S]`` as its router takes it, ``[S, B]`` bool."""
        return None if padding_mask is None else padding_mask.transpose(0, 1).bool()

    def _slots(self, hidden_states: Tensor, probs: Tensor, routing_map: Tensor
               ) -> tuple[Tensor, Tensor, Tensor]:
        """The tokens ``[T, H]``, their top-k expert ids and weights, from the router's map
        (see :meth:`routed`)."""
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        ids = routing_map.to(torch.int8).topk(self.config.moe_router_topk, dim=-1,
                                              sorted=False).indices
        kept = routing_map.gather(1, ids)  # False: a slot the capacity factor dropped
        weights = probs.gather(1, ids) * kept.to(probs.dtype)
        return x, torch.where(kept, ids, NO_EXPERT), weights.to(x.dtype)

    def _experts_stage(self, rows: Tensor, local_ids: Tensor, weights: Tensor,
                       tokens_per_expert: Tensor) -> Tensor:
        """mc2's experts-stage contract (rows grouped by local expert, local ids ``[R, 1]``,
        unit weights ``[R, 1]``, and ``tokens_per_expert`` on the host, from the counts the
        call read anyway) as Megatron's experts call: its grouped GEMMs read the counts on the
        host, as Megatron's dispatchers hand them."""
        out, bias = self.experts(rows, tokens_per_expert, weights.reshape(-1))
        assert bias is None, "the experts' output bias is refused by megatron_problem"
        return out


def overlapped_shared(mlp: Any, hidden_states: Tensor) -> Tensor:
    """``SharedExpertMLP``'s output as Megatron computes it under
    ``moe_shared_expert_overlap``: its dispatcher calls the MLP's staged methods, not the
    module, so a hook on the MLP itself (or its forward replaced) does not run there, while
    its linears' do (calling the module ran them: outputs 0.27 apart; found by a review)."""
    mlp.pre_forward_comm(hidden_states)
    mlp.linear_fc1_forward_and_act()
    mlp.linear_fc2_forward()
    mlp.post_forward_comm()
    return mlp.get_output()


def shared_views(mlp: Any, hidden_states: Tensor) -> dict[str, Tensor]:
    """Megatron's ``SharedExpertMLP`` as ``fused_expert_module``'s shared experts: views of its
    weights (``linear_fc1`` ``[2F, H]``, gate rows first as Megatron's GLU chunks them;
    ``linear_fc2`` ``[H, F]``), so gradients land on its parameters, and its gate
    ``sigmoid(x @ gate_weight.T)`` as the per-token scale.

    :func:`megatron_problem` has refused what mc2's SwiGLU would not compute (another
    activation, no GLU, a bias).
    """
    fc1, fc2 = mlp.linear_fc1.weight, mlp.linear_fc2.weight
    # one view of fc1 split by unbind (not two slices): autograd then builds one [2F, H]
    # gradient for fc1, not two zero-filled ones summed
    gate, up = fc1.view(2, fc1.shape[0] // 2, -1).transpose(1, 2).unbind(0)
    views = {"shared_gate": gate.unsqueeze(0), "shared_up": up.unsqueeze(0),
             "shared_down": fc2.t().unsqueeze(0)}
    if mlp.use_shared_expert_gate:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        views["shared_scale"] = torch.sigmoid(torch.nn.functional.linear(x, mlp.gate_weight))
    return views


def wait_param_gathers(module: Any) -> None:
    """Run Megatron DDP's parameter-gather pre-hooks (:func:`is_param_gather_hook`) of
    ``module`` and its submodules, now.

    Why: with ``overlap_param_gather`` a parameter is all-gathered asynchronously after the
    optimizer step and waited for in a forward pre-hook of the module that owns it. mc2 reads
    the shared MLP's weights as views without calling its linears, and runs the experts on
    stand-ins for their parameters (the hooks then see the stand-ins, not the parameters): no
    hook would wait, the GEMMs could read parameters before their gather lands, and a bucket
    group never waited would trip Megatron's ``param_gather_handle`` assertion on the next
    step. The hook only waits (and dispatches the next bucket), so running it before the reads
    is what calling the modules would have done first; the same hook run again inside finds
    nothing left to wait for."""
    for sub in module.modules():
        for hook in list(sub._forward_pre_hooks.values()):
            if is_param_gather_hook(hook):
                hook(sub, ())


def shared_read_problem(mlp: Any) -> str | None:
    """Why ``mlp``'s ``linear_fc1`` / ``linear_fc2`` do not read as their weights (a class
    other than Megatron's own parallel linears, e.g. an adapter's wrapper; a hook other than
    the parameter gather :func:`wait_param_gathers` runs; a parametrization), or ``None``."""
    if (problem := hook_problem(mlp, ignore=is_param_gather_hook)) is not None:
        return f"{problem}: its gate weight is read, not called"
    return first_problem(((name, getattr(mlp, name, None))
                          for name in ("linear_fc1", "linear_fc2")), _parallel_linears(),
                         ignore=is_param_gather_hook)


@functools.cache
def _parallel_linears() -> tuple[type, ...]:
    """Megatron's own parallel linears, whose forward is their weight's GEMM at
    ``tensor_model_parallel_size=1``, with TransformerEngine's where it imports (found once:
    a failed import is searched for again at every attempt, and this is asked every forward)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    kinds: tuple[type, ...] = (ColumnParallelLinear, RowParallelLinear)
    try:
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelLinear, TERowParallelLinear)
        kinds += (TEColumnParallelLinear, TERowParallelLinear)
    except ImportError:  # TransformerEngine absent
        pass
    return kinds


def config_from_env(value: str | None = None) -> MC2Config:
    """The :class:`~mc2.MC2Config` that ``value`` (default: the environment variable
    :data:`ENV`) names: JSON text or a JSON file's path (see :func:`settings_from_env`).

    Raises:
        ValueError: naming :data:`ENV`, for a missing file, text that is not a JSON object, or
            a field ``MC2Config`` does not have or refuses.
    """
    return settings_from_env(value)[0]


def settings_from_env(value: str | None = None) -> tuple[MC2Config, bool | str]:
    """``(config, batch_overlap)`` from ``value`` (default: :data:`ENV`): JSON text or a JSON
    file's path holding :class:`~mc2.MC2Config` fields and, optionally, ``"batch_overlap"``
    (``true``, ``false`` or ``"auto"``: batch overlap across the layers, as
    ``use_mc2(..., batch_overlap=...)``). Empty: :data:`DEFAULT_CONFIG`, no batch overlap.

    Raises:
        ValueError: naming :data:`ENV`, for a missing file, text that is not a JSON object, a
            field ``MC2Config`` does not have or refuses, or a bad ``batch_overlap``.
    """
    value = os.environ.get(ENV, "") if value is None else value
    text = value.strip()
    if not text:
        return DEFAULT_CONFIG, False
    if not text.startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise ValueError(f"{ENV}={value!r} is neither JSON text nor the path of a file")
        text = path.read_text()
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{ENV}: not JSON ({exc})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{ENV}: expected a JSON object of MC2Config fields, got "
                         f"{type(values).__name__}")
    overlap = values.pop("batch_overlap", False)
    check_mode(overlap, '"batch_overlap"', ENV)
    try:
        return MC2Config.from_dict(values), overlap
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{ENV}: {exc}") from None


def holds_moe_layer(spec: Any) -> bool:
    """Whether ``spec`` (a layer or block spec) places a ``MoELayer`` (what :func:`use_mc2`
    rewrites)."""
    found: list[str] = []
    _rewrite(spec, {}, found, "spec")
    return bool(found)


# ---------------------------------------------------------------------------------------------
# specs


def _is_moe_layer(module: Any) -> bool:
    if isinstance(module, tuple) and len(module) == 2:  # (import path, name)
        return module == ("megatron.core.transformer.moe.moe_layer", "MoELayer")
    return module is MoELayer or module is MC2MoELayer


def _rewrite(obj: Any, extra: dict[str, Any], found: list[str], where: str,
             layer: dict[str, Any] | None = None) -> Any:
    """``obj`` with its MoE layer specs building :class:`MC2MoELayer` (``extra``: their added
    params) and, with ``layer`` (batch overlap's params), its ``TransformerLayer`` specs
    building :class:`~mc2.integrations.megatron_overlap.MC2TransformerLayer`."""
    if isinstance(obj, ModuleSpec):
        if _is_moe_layer(obj.module):
            found.append(where)
            return dataclasses.replace(obj, module=MC2MoELayer, params={**obj.params, **extra})
        if layer is not None and obj.module in (TransformerLayer, MC2TransformerLayer):
            obj = dataclasses.replace(obj, module=MC2TransformerLayer,
                                      params={**obj.params, **layer})
        if isinstance(obj.module, type) and issubclass(obj.module, MoELayer):
            raise ValueError(f"use_mc2: {where} is {obj.module.__name__}, a MoELayer subclass of "
                             "the model's own; use_mc2 replaces only MoELayer")
        return dataclasses.replace(obj, submodules=_rewrite(obj.submodules, extra, found,
                                                            f"{where}.submodules", layer))
    if isinstance(obj, functools.partial) and _is_moe_layer(obj.func):  # megatron-core >= 0.17
        found.append(where)
        return functools.partial(MC2MoELayer, *obj.args, **{**obj.keywords, **extra})
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _rewrite(getattr(obj, f.name), extra, found, f"{where}.{f.name}",
                                    layer) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **changes) if any(
            changes[k] is not getattr(obj, k) for k in changes) else obj
    if isinstance(obj, (list, tuple)):
        items = [_rewrite(v, extra, found, f"{where}[{i}]", layer) for i, v in enumerate(obj)]
        return obj if all(a is b for a, b in zip(items, obj)) else type(obj)(items)
    return obj


def other_layers(spec: Any) -> list[str]:
    """The layers of a block spec that mc2's layer loop cannot run (any but
    ``TransformerLayer``), by index and kind; none for a layer spec. Batch overlap runs a
    block only where this is empty."""
    if not isinstance(spec, TransformerBlockSubmodules):
        return []
    return [f"layer_specs[{i}] ({getattr(s.module, '__name__', s.module)})"
            for i, s in enumerate(spec.layer_specs)
            if getattr(s, "module", None) not in (TransformerLayer, MC2TransformerLayer)]


def use_mc2(spec: Any, *, config: MC2Config | None = None, pg_collection: Any = None,
            batch_overlap: bool | str = False, min_tokens: int = MIN_TOKENS) -> Any:
    r"""A copy of ``spec`` (a ``ModuleSpec`` of a layer or of a ``MoELayer``, or a decoder
    block's ``TransformerBlockSubmodules``) whose ``MoELayer`` specs build :class:`MC2MoELayer`
    with ``config``; their submodules (router, experts, shared experts) are kept, so the model's
    parameters and checkpoint keys do not change. ``spec`` itself is not modified.

    ``pg_collection``: for a model built with a ``ProcessGroupCollection`` of its own. Megatron
    0.16.1's ``TransformerLayer`` hands its collection to an MLP whose spec module is exactly
    ``MoELayer`` (or one of its experts classes), not to a subclass, which then takes the
    global ``parallel_state`` groups as ``MoELayer`` itself does without one; a model on the
    global groups (``pretrain_gpt.py``'s) needs nothing here.

    ``batch_overlap``: ``True`` or ``"auto"`` also builds the spec's ``TransformerLayer``\ s as
    :class:`~mc2.integrations.megatron_overlap.MC2TransformerLayer`: the decoder's two halves
    of the batch interleaved stage by stage across layers (``docs/megatron.md``);
    ``min_tokens``: tokens per rank below which a forward runs unsplit.

    A paired schedule (one micro-batch's forward beside another's backward: Megatron's
    ``overlap_moe_expert_parallel_comm=True`` under :mod:`~mc2.integrations.megatron_patch`,
    :func:`~mc2.integrations.megatron_schedule.forward_backward_paired`,
    :func:`mc2.forward_backward`) needs nothing more: the ``MC2MoELayer`` calls pair inside
    the layers.

    Raises:
        ValueError: ``spec`` holds no ``MoELayer`` (``spec`` names the argument), or a subclass
            of ``MoELayer`` of the model's own (which the rewrite would lose); a config that
            batch overlap refuses is refused when the layers are built
            (:func:`~mc2.integrations.megatron_overlap.batch_overlap_problem`).
    """
    if config is not None and not isinstance(config, MC2Config):
        raise ValueError(f"config must be an mc2.MC2Config, got {type(config).__name__}")
    found: list[str] = []
    extra: dict[str, Any] = {"mc2_config": config or DEFAULT_CONFIG}
    if pg_collection is not None:
        extra["pg_collection"] = pg_collection
    check_mode(batch_overlap, "batch_overlap")
    layer = None
    if batch_overlap:
        layer = {"batch_overlap": batch_overlap, "min_tokens": min_tokens}
        if isinstance(spec, TransformerBlockSubmodules):  # this stage's layers, as built
            layer["stage_layers"] = len(spec.layer_specs)
    out = _rewrite(spec, extra, found, "spec", layer)
    if layer is not None:
        # every layer of the block must take part: a layer left as it was would run its own
        # forward between recorded ones (and the stack's last would never be reached)
        if other := other_layers(spec):
            raise ValueError(f"use_mc2(batch_overlap=...): {other} are not "
                             "TransformerLayer specs; batch overlap runs a block of "
                             "TransformerLayers")
    if not found:
        raise ValueError(f"use_mc2: spec ({type(spec).__name__}) holds no MoELayer spec")
    return out
