"""Hugging Face ``transformers`` (>= 5): swap sparse-MoE blocks for MC2 blocks in one line.

:func:`enable_mc2` replaces every sparse-MoE block it understands with an
:class:`MC2SparseMoeBlock` that keeps the model's router and names (state-dict keys and
checkpoints do not change) and holds only this rank's experts; a block it does not understand
runs its experts module as mc2's experts stage (:mod:`mc2.integrations.module_stage`) where the
model's expert-parallel plan names it, and is refused otherwise. The rest of the model stays
replicated on every rank: train it data-parallel (:func:`mc2.average_gradients` gives the mean
loss's gradients), or with ``mesh=`` and :mod:`mc2.parallel.checkpoint`. It works on any model
object, so no hub access is needed.

See docs/huggingface.md, '`enable_mc2`' and its sections (which blocks, adapters, meta-device
initialisation, ``set_experts_implementation``).
"""

from __future__ import annotations

import functools
from typing import Any, Unpack

import torch
from torch import Tensor, nn

from mc2.engine.autograd.staged import StagedCall
from mc2.engine.decide.config import ConfigOptions, MC2Config
from mc2.integrations.module_stage import (
    ModuleStageExperts, ep_experts, experts_problem, is_silu as _is_silu, shard_experts,
    shared_inside, shared_views
)
from mc2.integrations.weight_reads import user_hook_problem
from mc2.parallel.expert_shards import expert_shards
from mc2.layer import PackedExperts
from mc2.parallel.mesh import resolve_layout

__all__ = ["enable_mc2", "expert_parameters", "MC2SparseMoeBlock", "LocalExperts",
           "EXPERTS_IMPLEMENTATIONS"]

EXPERTS_IMPLEMENTATIONS = {"eager": "loop", "grouped_mm": "grouped"}
"""Hugging Face ``experts_implementation`` -> mc2 ``gemm``, where mc2 has the same kind of
kernel: ``eager`` loops over the experts (mc2's ``"loop"``: one GEMM per expert),
``grouped_mm`` is ``torch.nn.functional.grouped_mm`` (mc2's ``"grouped"``). The others
(``batched_mm``: one GEMM per token-expert pair; kernels of other libraries) have none."""

# The layout flags of Hugging Face's @use_experts_implementation, as mc2's fused call needs them.
_EXPERTS_LAYOUT = {"has_gate": True, "has_bias": False, "has_post_expert_norm": False,
                   "is_transposed": False, "is_concatenated": True}


class LocalExperts(PackedExperts):
    """This rank's block of a model's experts, under the model's own names and layout.

    ``gate_up_proj [L, 2F, H]`` (gate rows first) and ``down_proj [L, H, F]``, held at
    ``<block>.experts`` as in the unpatched model: the state dict keeps Hugging Face's keys, and
    :mod:`mc2.parallel.checkpoint` writes files the unpatched model loads. Its forward runs the
    fused call (so FSDP2 gathers it, see :class:`mc2.layer.PackedExperts`). ``first_expert``:
    the global index of its first expert.
    """

    names = ("gate_up_proj", "down_proj")

    def __init__(self, gate_up: Tensor, down: Tensor, first_expert: int = 0) -> None:
        super().__init__(gate_up, down)
        self.first_expert = first_expert

    @property
    def expert_index(self) -> Tensor:
        """The global indices of these experts, derived from the layout (not a buffer, so
        ``to_empty`` and meta-device builds cannot leave it garbage)."""
        start, device = self.first_expert, self.gate_up_proj.device
        return torch.arange(start, start + self.gate_up_proj.shape[0], device=device)

    @torch.no_grad()
    def init_normal_(self, std: float, seed: int) -> None:
        """Draw the experts from ``N(0, std)``, as Hugging Face draws the unpatched model's.

        Expert ``e`` (global index) comes from a generator seeded ``seed + e``: its values do
        not depend on the EP layout, and the experts of different ranks differ even though
        every rank runs with the same seed (which the replicated parameters need). A tensor
        Hugging Face marked initialised (``_is_hf_initialized``, e.g. loaded) is left alone.
        """
        todo = [p for p in self.weights() if not getattr(p, "_is_hf_initialized", False)]
        for i in range(self.gate_up_proj.shape[0]):
            generator = torch.Generator(device=self.gate_up_proj.device)
            generator.manual_seed(seed + self.first_expert + i)
            for p in todo:
                p[i].normal_(0.0, std, generator=generator)


class MC2SparseMoeBlock(nn.Module):
    """A sparse-MoE block running through :func:`mc2.fused_expert` with this rank's experts.

    The experts keep the model's own packed layout and names (:class:`LocalExperts`), this
    rank's ``L`` experts sliced out once; :func:`mc2.fused_expert_packed` runs them as they
    are, with no split or transpose. The router (``gate``) and a gated shared expert
    (``shared_expert``, ``shared_expert_gate``) are the block's own modules, kept as they are.

    Raises:
        ValueError: ``block`` holds a part this class would lose (see :func:`block_problems`).
    """

    def __init__(self, block: nn.Module, *, group: Any = None, mesh: Any = None,
                 config: MC2Config | None = None) -> None:
        super().__init__()
        if problems := block_problems(block):
            raise ValueError(_refusal(type(block).__name__, problems))
        experts = block.experts
        self.num_experts = experts.gate_up_proj.shape[0]
        self.layout = resolve_layout(group, mesh, num_experts=self.num_experts)
        mine = self.layout.experts_of_this_rank(self.num_experts)
        with torch.no_grad():
            self.experts = LocalExperts(experts.gate_up_proj[mine.start:mine.stop].clone(),
                                        experts.down_proj[mine.start:mine.stop].clone(),
                                        first_expert=mine.start)
        _carry_init_marks(experts, self.experts)
        for name in LocalExperts.names:  # frozen stays frozen (an adapter's base, fine-tuning)
            getattr(self.experts, name).requires_grad_(getattr(experts, name).requires_grad)
        self.gate = block.gate
        self.top_k = int(block.gate.top_k)
        self.shared_expert: nn.Module | None = getattr(block, "shared_expert", None)
        self.shared_expert_gate: nn.Module | None = getattr(block, "shared_expert_gate", None)
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)  # Mixtral's
        self.hf_config = getattr(experts, "config", None)  # where experts_implementation is
        self.group = self.layout.ep_group
        self.config = config or MC2Config()
        self.source = type(block).__name__
        self.train(block.training)  # an eval model stays in eval (no jitter; found by a review)

    @property
    def expert_index(self) -> Tensor:
        """The global indices of this rank's experts (see :attr:`LocalExperts.expert_index`)."""
        return self.experts.expert_index

    def mc2_expert_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's expert shards (see :mod:`mc2.parallel.expert_shards`).

        Raises:
            ValueError: the experts are wrapped (an adapter on their tensors, PEFT's
                ``target_parameters``): its factors belong to this rank's experts only, so
                mc2's gradient sync, clipping, checkpoints and ``fully_shard``, which would
                take them for replicated parameters, refuse them (every rank alike)."""
        if not isinstance(self.experts, LocalExperts):
            raise ValueError(
                f"{self.source}: the experts are wrapped in {type(self.experts).__name__} (an "
                "adapter on their tensors?): its factors belong to this rank's experts, and "
                "mc2's gradient sync, clipping, checkpoints and fully_shard would take them "
                "for replicated parameters; sync the adapter's gradients over the ranks that "
                "hold the same experts yourself, or adapt the shared layers instead")
        return {"experts.gate_up_proj": self.experts.gate_up_proj,
                "experts.down_proj": self.experts.down_proj}

    def follow_experts_implementation(self) -> None:
        """Take the model config's ``experts_implementation`` as this block's ``gemm``
        (:data:`EXPERTS_IMPLEMENTATIONS`); called by ``set_experts_implementation``."""
        chosen = getattr(self.hf_config, "_experts_implementation", None)
        if chosen is not None:
            self.config = self.config.replace(gemm=gemm_for(chosen))

    def forward(self, hidden_states: Tensor) -> Tensor:
        x, call_args, beside = self._call_args(hidden_states)
        # ids and weights by position, as Hugging Face's block calls its experts, so a hook
        # of the user's finds them where it would (by name, a pre-hook reading args[1] raised)
        out = self.experts(x, call_args.pop("expert_ids"), call_args.pop("routing_weights"),
                           **call_args)
        if beside is not None:
            out = out + beside
        return out.reshape(hidden_states.shape)

    def begin_staged(self, hidden_states: Tensor) -> StagedCall | "BesideStagedCall":
        """:meth:`forward` in stages, for batch overlap
        (:mod:`mc2.integrations.batch_overlap`): routes, plans the call and issues its
        dispatch; ``.experts()`` then ``.end()`` (the output, ``[tokens, H]``: the caller
        takes its own shape back) finish it.

        Raises:
            ValueError: the experts are wrapped (an adapter on their tensors, e.g. PEFT's
                ``target_parameters``): the staged call reads their tensors, which would skip
                the wrapper; their forward (:meth:`forward`) runs it.
        """
        if not isinstance(self.experts, LocalExperts):
            raise ValueError(
                f"batch overlap: the experts of {self.source} are wrapped in "
                f"{type(self.experts).__name__} (an adapter on their tensors?): the staged call "
                "would read the tensors without it; run without batch_overlap")
        x, call_args, beside = self._call_args(hidden_states)
        call = self.experts.begin_staged(x, **call_args)
        return call if beside is None else BesideStagedCall(call, beside)

    def _call_args(self, hidden_states: Tensor
                   ) -> tuple[Tensor, dict[str, Any], Tensor | None]:
        """The tokens ``[T, H]`` (with Mixtral's jitter in training: router and experts see it),
        the rest of the experts' call (routes, group, config, shared expert and scale) and the
        shared expert's output where it runs beside the call (else ``None``)."""
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        if self.training and self.jitter_noise > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        views, beside = self._shared(x)  # before the router, as the model runs its shared MLP
        weights, ids = self._route(x)
        shared, scale = (None, None, None), None
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            scale = torch.sigmoid(self.shared_expert_gate(x))
            if beside is not None:
                beside, scale = scale * beside, None
            else:
                shared = views
        return x, {"expert_ids": ids, "routing_weights": weights, "group": self.group,
                   "config": self.config, "shared": shared, "shared_scale": scale}, beside

    def _route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(top_k_weights, top_k_index)`` of the router, checked by dtype and shape only (no
        host read): a router returning another order or format must fail loudly, not route
        tokens by their weights. Every rank fails alike (same router, same structure)."""
        out = self.gate(x)
        if isinstance(out, tuple) and len(out) == 3:
            _, weights, ids = out
            want = (x.shape[0], self.top_k)
            if (isinstance(ids, Tensor) and _is_integer(ids) and tuple(ids.shape) == want
                    and isinstance(weights, Tensor) and weights.is_floating_point()
                    and tuple(weights.shape) == want):
                return weights, ids
        raise ValueError(
            f"MC2SparseMoeBlock (was {self.source}): the router {type(self.gate).__name__} must "
            f"return (router_logits, top_k_weights, top_k_index) with float weights and integer "
            f"indices of shape [tokens, top_k] = [{x.shape[0]}, {self.top_k}]; it returned "
            f"{_describe(out)}")

    def _shared(self, x: Tensor) -> tuple[Any, Tensor | None]:
        """``(views, beside)``: the shared expert as split ``(up [1,H,F], gate [1,H,F],
        down [1,F,H])`` views of its ``nn.Linear`` weights (no copy: their gradients land on
        the weights), or, where the views would not be what the MLP computes (checked at every
        forward, :mod:`mc2.integrations.weight_reads`: an adapter or a quantised layer on a
        projection, a hook, added before or after ``enable_mc2``), its output, run beside the
        call as the model runs it, said once; ``None``s without one. Called before the
        router, where the model runs the MLP: an adapter's dropout draws there (run after the
        router, a same-seed step drew other masks; found by a review)."""
        if self.shared_expert is None or self.shared_expert_gate is None:
            return None, None
        views = shared_views(self.shared_expert, self.experts, f"{self.source}'s shared_expert "
                             "runs beside the fused call, as the model runs it")
        return (views, None) if views is not None else (None, self.shared_expert(x))


class BesideStagedCall:
    """A staged call (:class:`~mc2.engine.autograd.staged.StagedCall`) whose output gains a
    shared expert's, computed beside it (:meth:`MC2SparseMoeBlock._shared`)."""

    def __init__(self, call: StagedCall, beside: Tensor) -> None:
        self.call, self.beside = call, beside

    def experts(self) -> None:
        self.call.experts()

    def end(self) -> Tensor:
        return self.call.end() + self.beside


def gemm_for(experts_implementation: str) -> str:
    """mc2's ``gemm`` for a Hugging Face ``experts_implementation``, or a ``ValueError``."""
    if experts_implementation not in EXPERTS_IMPLEMENTATIONS:
        raise ValueError(
            f"experts_implementation={experts_implementation!r} has no equivalent in mc2: an "
            f"mc2 block runs its experts itself, inside its fused dispatch/compute/combine call. "
            f"Use 'grouped_mm' (mc2 gemm='grouped') or 'eager' (gemm='loop'), or choose with "
            f"enable_mc2(model, gemm=...) ('auto' measures)")
    return EXPERTS_IMPLEMENTATIONS[experts_implementation]


def _is_integer(t: Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _describe(out: Any) -> str:
    """Types, dtypes and shapes of a router's output (never its values)."""
    if isinstance(out, Tensor):
        return f"Tensor {out.dtype} {tuple(out.shape)}"
    if isinstance(out, tuple):
        return "(" + ", ".join(_describe(o) for o in out) + ")"
    return type(out).__name__


def _holds_tensors(module: nn.Module, recurse: bool = True) -> bool:
    """Whether ``module`` has parameters or buffers (what a state dict or a step would lose)."""
    return any(True for _ in module.parameters(recurse)) or \
        any(True for _ in module.buffers(recurse))


def _is_candidate(module: nn.Module) -> bool:
    """A sparse-MoE block by its shape: a router ``gate`` with ``top_k`` and ``experts`` with
    ``gate_up_proj``/``down_proj`` tensors. Whether mc2 can run it: :func:`block_problems`."""
    experts, gate = getattr(module, "experts", None), getattr(module, "gate", None)
    if not isinstance(experts, nn.Module) or not isinstance(gate, nn.Module) \
            or not hasattr(gate, "top_k"):
        return False
    return all(isinstance(getattr(experts, n, None), Tensor) for n in LocalExperts.names)


def _experts_problems(experts: nn.Module) -> list[str]:
    """What in ``experts`` the fused SwiGLU call would not compute."""
    problems = []
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0] or \
            gate_up.shape[1] != 2 * down.shape[2] or gate_up.shape[2] != down.shape[1]:
        problems.append(f"experts.gate_up_proj {tuple(gate_up.shape)} and down_proj "
                        f"{tuple(down.shape)} are not [E, 2F, H] and [E, H, F]")
    for flag, needed in _EXPERTS_LAYOUT.items():
        if getattr(experts, flag, needed) != needed:
            problems.append(f"experts.{flag}={getattr(experts, flag)!r} (mc2 needs {needed})")
    extra = sorted(set(dict(experts.named_parameters())) - set(LocalExperts.names)) + \
        sorted(name for name, _ in experts.named_buffers())
    if extra:
        problems.append(f"experts tensors {extra} (mc2 knows only gate_up_proj and down_proj)")
    if not _is_silu(getattr(experts, "act_fn", None)):
        problems.append(f"experts.act_fn {type(experts.act_fn).__name__} (mc2 computes SiLU)")
    apply_gate = getattr(type(experts), "_apply_gate", None)
    if apply_gate is not None and apply_gate.__name__ != "_default_apply_gate":
        problems.append(f"experts._apply_gate of {type(experts).__name__} (mc2 computes "
                        "act(gate) * up)")
    return problems


def _shared_problems(block: nn.Module) -> list[str]:
    """What in a Qwen2-MoE style gated shared expert mc2 would not compute.

    Only the pairing is needed here: the MLP runs inside the call where its projections read
    as a bias-free SwiGLU of the block's width, and beside it, called, otherwise, which is decided at
    every forward (:meth:`MC2SparseMoeBlock._shared`)."""
    mlp, gate = getattr(block, "shared_expert", None), getattr(block, "shared_expert_gate", None)
    if mlp is None and gate is None:
        return []
    if mlp is None or gate is None:
        return ["shared_expert and shared_expert_gate go together (the gated shared expert of "
                "Qwen2-MoE); the block has only one"]
    if not isinstance(mlp, nn.Module) or not isinstance(gate, nn.Module):
        return [f"shared_expert ({type(mlp).__name__}) and shared_expert_gate "
                f"({type(gate).__name__}) must be modules"]
    return []


def block_problems(block: nn.Module) -> list[str]:
    """What :class:`MC2SparseMoeBlock` would lose or compute differently if it replaced
    ``block``: each part named; empty when it can replace it faithfully.

    Known parts: the router ``gate`` (kept as it is, whatever it holds), ``experts`` (fused
    SwiGLU, no bias, no extra tensor) and Qwen2-MoE's ``shared_expert`` with
    ``shared_expert_gate``. Anything else that holds a parameter or buffer is a problem, and
    so is a forward hook on the block or its experts (register it after ``enable_mc2``, on the
    MC2 block: that one is called).
    """
    problems = _experts_problems(block.experts) + _shared_problems(block)
    # the block and its experts are replaced, not called: their hooks would go with them
    problems += [f"{where}{problem}" for where, module in (("", block), ("experts: ", block.experts))
                 if (problem := user_hook_problem(module)) is not None]
    own = sorted(dict(block.named_parameters(recurse=False))) + \
        sorted(dict(block.named_buffers(recurse=False)))
    if own:
        problems.append(f"its own tensors {own}")
    known = {"gate", "experts", "shared_expert", "shared_expert_gate"}
    for name, child in block.named_children():
        if name not in known and _holds_tensors(child):
            problems.append(f"submodule {name!r} ({type(child).__name__}) with parameters")
    return problems


def _refusal(where: str, problems: list[str]) -> str:
    return (f"enable_mc2: {where} cannot be replaced without losing a part or changing what it "
            f"computes: " + "; ".join(problems))


def _carry_init_marks(source: nn.Module, target: LocalExperts) -> None:
    """Hugging Face's "initialised" marks (``_is_hf_initialized``, set by its init and by
    loading) go from the replaced experts to ours: a later ``init_weights()`` then skips
    experts that hold real values, as it skips the rest of the model."""
    if getattr(source, "_is_hf_initialized", False):
        target._is_hf_initialized = True
    for name in LocalExperts.names:
        if getattr(getattr(source, name), "_is_hf_initialized", False):
            getattr(target, name)._is_hf_initialized = True


def _init_weights_with_mc2(model: nn.Module, module: nn.Module) -> None:
    """``model._init_weights`` (Hugging Face's per-module init) that also knows
    :class:`LocalExperts`: ``N(0, initializer_range)``, as Mixtral, Qwen2-MoE and Qwen3-MoE
    initialise their experts. The seed is drawn from the default generator (the same on every
    rank that seeded alike)."""
    if not isinstance(module, LocalExperts):
        type(model)._init_weights(model, module)
        return
    std = getattr(model.config, "initializer_range", None) or 0.02
    module.init_normal_(float(std), int(torch.randint(0, 2 ** 62, (1,))))


def _set_experts_implementation(model: nn.Module, experts_implementation: str | dict) -> None:
    """``model.set_experts_implementation`` that the MC2 blocks follow: refused (before anything
    changes) where mc2 has no equivalent, see :data:`EXPERTS_IMPLEMENTATIONS`."""
    requested = experts_implementation.values() if isinstance(experts_implementation, dict) \
        else [experts_implementation]
    for value in requested:
        gemm_for(value)
    type(model).set_experts_implementation(model, experts_implementation)
    for module in model.modules():
        if isinstance(module, MC2SparseMoeBlock):
            module.follow_experts_implementation()


def _extend_hf_models(model: nn.Module) -> None:
    """Route the Hugging Face models holding MC2 blocks through :func:`_init_weights_with_mc2`
    and :func:`_set_experts_implementation`.

    Instance attributes: ``initialize_weights`` visits each module with the ``_init_weights``
    of its nearest enclosing ``PreTrainedModel`` (``self._init_weights``, found on the
    instance first), so every such model around a block is covered, and the class is left
    alone. ``functools.partial`` of module functions keeps the model picklable.
    """
    for module in model.modules():
        init = getattr(module, "_init_weights", None)
        if not callable(init) or not callable(getattr(module, "_initialize_weights", None)):
            continue
        if not any(isinstance(m, MC2SparseMoeBlock) for m in module.modules()):
            continue
        if not (isinstance(init, functools.partial) and init.func is _init_weights_with_mc2):
            module._init_weights = functools.partial(_init_weights_with_mc2, module)
        if callable(getattr(type(module), "set_experts_implementation", None)):
            module.set_experts_implementation = functools.partial(_set_experts_implementation,
                                                                  module)


def enable_mc2(model: nn.Module, group: Any = None, *, mesh: Any = None,
               config: MC2Config | None = None, batch_overlap: bool | str = False,
               min_tokens: int | None = None,
               **options: Unpack[ConfigOptions]) -> int:
    """Replace the model's sparse-MoE blocks in place; returns how many were replaced.

    Every rank must call it on an identical model (same weights, or all on the meta device):
    each keeps its own experts. ``group`` is the expert-parallel group; or ``mesh``, a 1-D mesh
    (expert parallel) or a ``("dp", "ep")`` mesh (:func:`mc2.expert_parallel_mesh`): experts
    split over ``ep`` and replicated over ``dp``, everything else replicated everywhere.
    ``config`` (an :class:`mc2.MC2Config`) or its fields as keywords (``micro_batches=4``,
    ``wire_dtype="fp8"``, ``hierarchy="2d"``, ...): how every block's fused call runs.

    Afterwards ``model.init_weights()`` initialises the experts too (meta-device builds) and
    ``model.set_experts_implementation`` sets the blocks' ``gemm`` (docs/huggingface.md).

    ``batch_overlap``: ``True`` or ``"auto"`` runs each forward as two micro-batches interleaved
    across the decoder layers, each one's All-to-All travelling while the other computes
    (:mod:`mc2.integrations.batch_overlap`, ``docs/batch_overlap.md``); ``min_tokens``: the
    tokens per rank below which it is off.

    Raises:
        ValueError: the model has no block this adapter understands; a block holds a part
            the adapter does not understand (nothing is replaced then); or the mesh is bad
            (see :func:`mc2.parallel.mesh.resolve_layout`); raised on every rank alike.
    """
    config = MC2Config.of(config, **options)
    candidates = [(name, m) for name, m in model.named_modules()
                  if not isinstance(m, MC2SparseMoeBlock) and _is_candidate(m)]
    blocks = [(name, m) for name, m in candidates if not block_problems(m)]
    fast = {f"{name}.experts" if name else "experts" for name, _ in blocks}
    staged = [(name, m) for name, m in ep_experts(model)
              if name not in fast and not isinstance(m, ModuleStageExperts)]
    covered = fast | {name for name, _ in staged}
    problems = [f"{name or '<the model itself>'} ({type(m).__name__}): {'; '.join(found)}"
                for name, m in candidates if (found := block_problems(m))
                and f"{name}.experts" not in covered]
    problems += [f"{name}: {why}" for name, m in staged if (why := experts_problem(m))]
    if any(name == "" for name, _ in blocks):
        problems.append("the model itself is a sparse-MoE block: pass the model that holds it")
    problems += _tied_experts([(f"{name}.experts", m.experts) for name, m in blocks] + staged)
    if problems:
        raise ValueError(_refusal("these blocks", problems))
    for name, module in blocks:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child,
                MC2SparseMoeBlock(module, group=group, mesh=mesh, config=config))
    for name, module in staged:  # the model's own experts, as the pipeline's experts stage
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, shard_experts(module, group=group, mesh=mesh, config=config))
        shared_inside(parent)
    if not blocks and not staged:
        raise ValueError(f"enable_mc2: no sparse-MoE block with fused gate_up_proj/down_proj "
                         f"experts, and no experts module named by the model's expert-parallel "
                         f"plan, found in {type(model).__name__}")
    _extend_hf_models(model)
    if batch_overlap and staged:
        raise ValueError("batch_overlap: runs MC2SparseMoeBlock's stages; these experts run "
                         f"their own forward ({[name for name, _ in staged]})")
    if batch_overlap:
        _overlap_layers(model, batch_overlap, min_tokens, blocks=[
            m for m in model.modules() if isinstance(m, MC2SparseMoeBlock)])
    return len(blocks) + len(staged)


def _overlap_layers(model: nn.Module, mode: bool | str, min_tokens: int | None,
                    blocks: list["MC2SparseMoeBlock"]) -> None:
    """Put the decoder layers that hold the MC2 blocks into an :class:`OverlappedLayers`."""
    from mc2.engine.decide.planner import planner_for
    from mc2.integrations.batch_overlap import MIN_TOKENS, OverlappedLayers, stage_problem

    holders = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.ModuleList) and any(
                   isinstance(x, MC2SparseMoeBlock) for layer in m for x in layer.modules())]
    if len(holders) != 1:
        raise ValueError(f"batch_overlap: expected one list of decoder layers holding the MoE "
                         f"blocks, found {[name for name, _ in holders]}")
    name, layers = holders[0]
    problems = [p for layer in layers if (p := stage_problem(layer))]
    if problems:
        raise ValueError(f"batch_overlap: cannot run these layers in stages: {problems}")
    group = blocks[0].group
    if blocks[0].layout.dp_group is not None:  # agreed where FSDP's collectives reach
        group = _whole_mesh_group(blocks[0].layout)
    decision = planner_for(group).batch_overlap(
        mode, min_tokens=MIN_TOKENS if min_tokens is None else min_tokens, group=group)
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child,
            OverlappedLayers(list(layers), decision=decision))


def _tied_experts(experts: list[tuple[str, nn.Module]]) -> list[str]:
    """Expert tensors one layer shares with another (tied, or views of one storage): mc2
    copies each layer's share of its experts, which untied them, so each layer's gradient
    went to its own copy and one optimizer step made the layers differ (found by a review)."""
    seen: dict[int, str] = {}
    problems = []
    for name, module in experts:
        for tensor_name, p in module.named_parameters(recurse=False):
            key = p.untyped_storage().data_ptr() if p.device.type != "meta" and p.numel() \
                else id(p)
            if key in seen and not seen[key].startswith(f"{name}."):
                problems.append(f"{name}.{tensor_name} shares its storage with {seen[key]}: "
                                "mc2 copies each layer's experts, which would untie them")
            seen.setdefault(key, f"{name}.{tensor_name}")
    return problems


def _whole_mesh_group(layout: Any) -> Any:
    """The group batch overlap's decision is agreed on for a ``("dp", "ep")`` mesh: every
    rank of the mesh, not one EP group (the data-parallel collectives span the EP groups,
    and groups that split differently would issue them at other points of the step). The
    default group, so the mesh must span the world.

    Raises:
        ValueError: the mesh holds fewer ranks than the world.
    """
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    if layout.mesh is not None and layout.mesh.size() != world:
        raise ValueError(f"batch_overlap with a ('dp', 'ep') mesh needs the mesh to span the "
                         f"world ({layout.mesh.size()} of {world} ranks): the decision is "
                         "agreed on every rank")
    return dist.group.WORLD if dist.is_initialized() else None


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The rank-local expert weights of every MC2 block (not to be averaged over ranks)."""
    return [shard.param for shard in expert_shards(model)]
