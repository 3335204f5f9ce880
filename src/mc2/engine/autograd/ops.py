"""``mc2.fused_expert``: dispatch All-to-All -> SwiGLU experts -> combine All-to-All, overlapped.

Two entry points, one pipeline: :func:`fused_expert` takes the article's separate
``weights_up/weights_gate/weights_down`` (``[L, H, F]``, ``[L, F, H]``);
:func:`fused_expert_packed` takes the packed ``nn.Linear`` layout of Hugging Face, Megatron and
DeepSpeed experts (``gate_up [L, 2F, H]``, ``down [L, H, F]``), which runs gate and up as one
GEMM and measured faster (:mod:`mc2.engine.compute.experts`). :mod:`mc2.engine.decide.call_plan` plans a call,
:mod:`mc2.engine.autograd.function` runs it.
"""

from __future__ import annotations

from typing import Any, Unpack

import torch
from torch import Tensor

from mc2.engine.autograd.function import FusedExpertFunction
from mc2.engine.autograd.pairing import current_pairing, paired_config
from mc2.engine.autograd.operator import fused_expert_op, group_name
from mc2.engine.autograd.prepare import (
    EAGER_RUNTIME, autocast_inputs, guarded, resolve_config, shared_inputs
)
from mc2.engine.autograd.recompute import selective_region
from mc2.engine.compute.module_experts import ExpertsForward, ModuleExperts
from mc2.engine.decide.call_plan import combine_weights, plan_call
from mc2.engine.decide.config import ConfigOptions, MC2Config
from mc2.engine.decide.planner import Planner
from mc2.engine.transport.deadline import resolve_timeout
from mc2.engine.transport.workspace import Workspace
from mc2.observation.timeline import Timeline


def _run(x: Tensor, named: dict[str, Any], expert_ids: Tensor, routing_weights: Tensor | None,
         shared: tuple, config: MC2Config | None, options: dict[str, Any],
         **runtime: Any) -> Tensor:
    """Both entry points' call, by one of two adapters over one pass: the autograd Function
    (eager), or the operator ``torch.ops.mc2.fused_expert`` (under ``torch.compile`` or
    ``torch.export`` tracing, and inside a selective-checkpointing region, where the call
    must be one operator: :mod:`mc2.engine.autograd.recompute`). ``shared``: ``(up, gate,
    down, scale)``, each or all ``None``; they travel together through the checks
    (:func:`~mc2.engine.decide.validation.shared_problem`) and the autograd inputs, so a
    trainable ``scale`` alone already makes the call keep what its backward needs."""
    cfg, problem = resolve_config(config, options)
    x, named, routing_weights, shared = autocast_inputs(x, named, routing_weights, shared)
    if torch.compiler.is_compiling():
        return _through_operator(x, named, expert_ids, routing_weights, shared, cfg, problem,
                                 **runtime)
    cfg = paired_config(cfg)  # not traced: a paired schedule runs eager calls
    if selective_region():
        group, packed, num_experts = (runtime.pop(k) for k in ("group", "packed", "num_experts"))
        token = EAGER_RUNTIME.set(runtime)
        try:
            return _through_operator(x, named, expert_ids, routing_weights, shared, cfg, problem,
                                     group=group, packed=packed, num_experts=num_experts)
        finally:
            EAGER_RUNTIME.reset(token)

    return _eager(x, named, expert_ids, routing_weights, shared, cfg, problem, **runtime)


def _eager(x: Tensor, named: dict[str, Any], expert_ids: Tensor,
           routing_weights: Tensor | None, shared: tuple, cfg: MC2Config, problem: str | None,
           **runtime: Any) -> Tensor:
    """The call planned and run by the eager Function, under :func:`guarded` (a failure on
    one rank raised on every rank)."""
    def planned_and_run() -> Tensor:
        call, weights, combine = plan_call(x, named, expert_ids, routing_weights, config=cfg,
                                           paired=current_pairing() is not None,
                                           problem=problem, shared=shared,
                                           timeout=resolve_timeout(cfg.timeout), **runtime)
        return FusedExpertFunction.apply(call, x, combine, *shared_inputs(x, shared),
                                         *weights.tensors())

    return guarded(planned_and_run, cfg, x)


def _through_operator(x: Tensor, named: dict[str, Any], expert_ids: Tensor,
                      routing_weights: Tensor | None, shared: tuple, config: MC2Config,
                      problem: str | None, *, group: Any = None, packed: bool,
                      num_experts: int | None = None, **runtime: Any) -> Tensor:
    """The call as one :data:`~mc2.engine.autograd.operator.FUSED_EXPERT` node."""
    if problem is not None:  # the config: the same on every rank, so every rank raises
        raise ValueError(f"fused_expert: {problem}")
    given = sorted(k for k, v in runtime.items() if v is not None)
    if given:
        raise ValueError(f"fused_expert: {given} cannot be passed under torch.compile or "
                         "torch.export (the traced call uses the process's defaults)")
    hidden = x.shape[-1]
    ids2d = expert_ids.reshape(-1, expert_ids.shape[-1])
    combine, function_shared = combine_weights(routing_weights, ids2d, x), shared_inputs(x, shared)
    experts = list(named.values())
    grad = torch.is_grad_enabled()  # known while tracing; the traced graph runs without it
    needs = [grad and t is not None and t.requires_grad
             for t in (x, combine, *function_shared, *experts)]
    s_up, s_gate, s_down, s_scale = function_shared
    out, _ = fused_expert_op(x=x.reshape(-1, hidden), combine_weights=combine, expert_ids=ids2d,
                             experts=experts, shared_up=s_up, shared_gate=s_gate,
                             shared_down=s_down, shared_scale=s_scale, packed=packed,
                             group=group_name(group), config=config.json,
                             num_experts=num_experts, needs=needs)
    return out.view(x.shape)


def fused_expert(
    x: Tensor,
    weights_up: Tensor,
    weights_gate: Tensor,
    weights_down: Tensor,
    expert_ids: Tensor,
    routing_weights: Tensor | None = None,
    *,
    group: Any = None,
    config: MC2Config | None = None,
    num_experts: int | None = None,
    shared_up: Tensor | None = None,
    shared_gate: Tensor | None = None,
    shared_down: Tensor | None = None,
    shared_scale: Tensor | None = None,
    timeline: Timeline | None = None,
    planner: Planner | None = None,
    workspace: Workspace | None = None,
    **options: Unpack[ConfigOptions],
) -> Tensor:
    """Expert-parallel SwiGLU MoE with the All-to-All hidden behind expert computation.

    Expert ``e`` lives on rank ``e // local_experts`` of ``group``. Each token is sent to the
    ranks of its top-k experts (dispatch), transformed there by
    ``down(silu(x @ gate) * (x @ up))`` and sent back (combine); the result is the
    ``routing_weights``-weighted sum over its top-k expert outputs, in the original token order.
    Dropless by default: no capacity factor, no token dropped. Capacity mode
    (``capacity=N``) sends fixed slabs instead: rows that do not fit raise
    :class:`~mc2.engine.decide.overflow.CapacityOverflow` (``overflow="raise"``) or are left
    out and counted (``overflow="drop"``, :func:`mc2.engine.decide.capacity.dropped_rows`).

    Args:
        x: ``[batch, seq, hidden]`` or ``[tokens, hidden]`` float tokens of this rank (may hold
            zero tokens; the rank still takes part). Under ``torch.autocast`` the call computes
            in the autocast dtype.
        weights_up: ``[local_experts, hidden, ffn]`` this rank's experts' up projections.
        weights_gate: ``[local_experts, hidden, ffn]`` gate projections.
        weights_down: ``[local_experts, ffn, hidden]`` down projections.
        expert_ids: ``x.shape[:-1] + (topk,)`` integer *global* expert ids in
            ``[0, world * local_experts)``, on ``x``'s device; ``-1``: no expert (a slot a
            capacity factor dropped, as DeepEP marks one): it sends no row, computes nothing
            and adds nothing, and its routing weight's gradient is zero.
        routing_weights: like ``expert_ids``, float; the top-k combine weights (``None``: 1).
        group: the expert-parallel process group (``None``: the default group). Without an
            initialised ``torch.distributed`` or with one rank, runs locally without collectives.
        config: how the call runs (:class:`mc2.MC2Config`: micro-batches, overlap, hierarchy,
            wire format, GEMM strategy, deadline, finiteness check); every rank passes the same.
        **options: :class:`mc2.MC2Config`'s fields as keywords, a shorthand that builds one
            (or replaces fields of ``config``): ``fused_expert(..., micro_batches=4)``.
        num_experts: optional check that the group holds exactly this many experts.
        shared_up, shared_gate: ``[shared, hidden, shared_ffn]`` optional shared experts
            (DeepSeek/Qwen style) that every token passes through; computed while the first
            dispatch is in flight (forward) and the first gradient dispatch (backward).
        shared_down: ``[shared, shared_ffn, hidden]``.
        shared_scale: ``x.shape[:-1] + (1,)`` (or ``[tokens, 1]``), x's dtype and device: a
            per-token factor on the shared experts' output (Qwen2-MoE's
            ``sigmoid(shared_expert_gate(x))``), so the output is
            ``routed + shared_scale * shared``; differentiable. Needs the shared experts.
        timeline: a :class:`~mc2.observation.timeline.Timeline` that receives compute/comm/
            wait/transfer spans (default: the one of the active :func:`mc2.profile`, if any).
        planner: the :class:`~mc2.engine.decide.planner.Planner` for ``micro_batches="auto"``
            (default: one shared per group, measuring on first use: a collective all ranks
            enter together).
        workspace: the :class:`~mc2.engine.transport.workspace.Workspace` large buffers come from on CPU
            (default: the process's shared one), so steady-state calls allocate nothing.
            Returned tensors (output, gradients) share its memory until you drop them.

    Returns:
        ``x``-shaped output, differentiable w.r.t. ``x``, the three weights,
        ``routing_weights`` and the shared experts (and ``shared_scale``). Every rank must run
        the backward when any rank does (as with DDP).

    Memory kept for the backward: per micro-batch the received rows and their gate/up
    projections (``rows * (hidden + 2 * ffn)`` elements), plus the combined expert outputs
    ``tokens * topk * hidden`` for the ``routing_weights`` gradient. Nothing is kept when no
    input requires a gradient.

    Host synchronisation: two device-to-host reads per call (the handshake, the split sizes)
    and one upload, none in the backward, whatever K (``docs/accelerators.md``).

    Raises:
        ValueError: on *every* rank of the group when any rank passes bad arguments (wrong
            shape/dtype/device, expert id out of range, weights that do not match the group, a
            bad option), or when ranks disagree on values that must be shared (options, the K
            ``"auto"`` chose); no rank is left in a collective.
        TypeError: an option that :class:`mc2.MC2Config` does not have.
        CapacityOverflow: a ``ValueError``; capacity mode's rows that did not fit, expert ids
            out of range or slabs of another configuration, on every rank, at that call's end
            on a CPU, else at the next handshake or :func:`mc2.check_overflow`.
        CommTimeout: a peer did not answer within the deadline (stalled or gone); the process
            group is unusable afterwards (restart from a checkpoint).

    Non-finite input: a NaN or Inf in a token stays in that token's output row in the forward,
    but its backward poisons the weight gradients of every expert the token visited.
    ``check_finite=True`` raises ``ValueError`` on every rank instead (one pass over ``x`` and
    ``routing_weights``, folded into the call's handshake: no extra collective).
    """
    return _run(x, {"weights_up": weights_up, "weights_gate": weights_gate,
                    "weights_down": weights_down}, expert_ids, routing_weights,
                (shared_up, shared_gate, shared_down, shared_scale), config, dict(options),
                group=group, packed=False, num_experts=num_experts, timeline=timeline,
                planner=planner, workspace=workspace)


def fused_expert_packed(
    x: Tensor,
    weights_gate_up: Tensor,
    weights_down: Tensor,
    expert_ids: Tensor,
    routing_weights: Tensor | None = None,
    *,
    group: Any = None,
    config: MC2Config | None = None,
    num_experts: int | None = None,
    shared_up: Tensor | None = None,
    shared_gate: Tensor | None = None,
    shared_down: Tensor | None = None,
    shared_scale: Tensor | None = None,
    timeline: Timeline | None = None,
    planner: Planner | None = None,
    workspace: Workspace | None = None,
    **options: Unpack[ConfigOptions],
) -> Tensor:
    """:func:`fused_expert` with the experts in the packed ``nn.Linear`` layout.

    Args:
        weights_gate_up: ``[local_experts, 2 * ffn, hidden]``: rows ``[:ffn]`` are the gate
            projection, rows ``[ffn:]`` the up projection (Hugging Face ``gate_up_proj``,
            Megatron ``linear_fc1``), applied as ``x @ W.T``.
        weights_down: ``[local_experts, hidden, ffn]`` (``down_proj``, ``linear_fc2``).

    Everything else is as in :func:`fused_expert`; the result is the same function of the same
    weights. Gate and up run as one GEMM and no weight is ever copied or transposed in memory.
    """
    return _run(x, {"weights_gate_up": weights_gate_up, "weights_down": weights_down},
                expert_ids, routing_weights, (shared_up, shared_gate, shared_down, shared_scale),
                config, dict(options), group=group, packed=True, num_experts=num_experts,
                timeline=timeline, planner=planner, workspace=workspace)


def fused_expert_module(
    x: Tensor,
    experts: torch.nn.Module,
    expert_ids: Tensor,
    routing_weights: Tensor | None = None,
    *,
    group: Any = None,
    config: MC2Config | None = None,
    num_experts: int | None = None,
    local_experts: int | None = None,
    forward: ExpertsForward | None = None,
    tokens_per_expert: bool = False,
    shared_up: Tensor | None = None,
    shared_gate: Tensor | None = None,
    shared_down: Tensor | None = None,
    shared_scale: Tensor | None = None,
    timeline: Timeline | None = None,
    planner: Planner | None = None,
    workspace: Workspace | None = None,
    **options: Unpack[ConfigOptions],
) -> Tensor:
    """:func:`fused_expert` with any experts module in place of mc2's SwiGLU.

    The same pipeline (dispatch, experts, combine per micro-batch, overlapped; the backward
    pipelined with the gradient exchanges), with ``experts``' own forward as the experts stage
    and its backward by autograd, one micro-batch at a time
    (:mod:`mc2.engine.compute.module_experts`).

    Args:
        experts: this rank's experts. Called as Hugging Face calls an experts module:
            ``forward(rows [R, H], local_ids [R, 1] int64, weights [R, 1]) -> [R, H]``, with
            rows grouped by local expert and unit weights (``routing_weights`` are applied
            after the combine). Its floating-point parameters, as they are at the call, get
            gradients.
        local_experts: experts on this rank (default ``experts.num_experts``).
        forward: the forward to run instead of ``experts.forward`` (a module whose ``forward``
            was replaced, as Hugging Face's expert parallelism does, keeps the original).
        tokens_per_expert: call the forward with a fourth argument, the rows per local expert
            (``[L]`` int64 on the CPU), for experts that need the counts on the host
            (Megatron's): built from the counts the call read anyway, so the stage reads
            nothing per micro-batch.
        shared_up, shared_gate, shared_down, shared_scale: shared experts as in
            :func:`fused_expert` (a plain SwiGLU: a framework's shared MLP as views of its
            weights), run inside the call where its pipeline would wait.

    Everything else is as in :func:`fused_expert`. Not traceable by ``torch.compile`` or
    ``torch.export`` (a module is no operator argument: use :func:`fused_expert_packed` there),
    and refused inside a selective-checkpointing region (its recompute would run its
    collectives again): use full checkpointing, which runs the call again as a whole.
    """
    if torch.compiler.is_compiling():
        raise ValueError("fused_expert_module cannot be traced by torch.compile or torch.export "
                         "(a module is no operator argument); use fused_expert_packed there")
    module = ModuleExperts.of(experts, x.shape[-1], forward=forward,
                              local_experts=local_experts, tokens_per_expert=tokens_per_expert)
    if selective_region():
        raise ValueError("fused_expert_module cannot run inside a selective activation "
                         "checkpointing region; checkpoint the whole layer instead")
    cfg, problem = resolve_config(config, dict(options))
    cfg = paired_config(cfg)
    x, named, routing_weights, shared = autocast_inputs(
        x, dict(zip(module.names, module.params)), routing_weights,
        (shared_up, shared_gate, shared_down, shared_scale))
    return _eager(x, named, expert_ids, routing_weights, shared, cfg, problem, packed=False,
                  group=group, num_experts=num_experts, timeline=timeline, planner=planner,
                  workspace=workspace, module=module)
