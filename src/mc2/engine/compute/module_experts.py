"""Any experts module as a stage of the pipeline: rows in, rows out, its backward by autograd.

mc2's own SwiGLU (:mod:`.experts`) has a hand-written backward and reuses its buffers; it stays
the fast path where a model's experts are exactly that. Every other expert (biases, gpt-oss's
clamped activation, another activation, a kernel of the model's own) runs here: the module's
own forward on each micro-batch's rows, recorded by autograd as a graph of its own, whose
backward runs when that micro-batch's gradient rows arrive, pipelined with the gradient
exchanges exactly as the SwiGLU stage is.

**The contract** is Hugging Face's experts forward, so that a model's experts module (any
``experts_implementation``: ``eager``, ``grouped_mm``, ``batched_mm``) runs unchanged::

    forward(rows [R, H], local_ids [R, 1] int64, weights [R, 1]) -> [R, H]

Rows arrive grouped by local expert (ids ascending); ``weights`` are ones: the routing weights
are applied where the token lives, after the combine, as in the SwiGLU stage. A stage made with
``tokens_per_expert=True`` (Megatron's experts, whose grouped GEMMs take the counts on the host)
is called with a fourth argument, ``tokens_per_expert [L]`` int64 on the CPU, built from the
counts the call already read: the stage needs no read of its own, per micro-batch.

**Why a graph per micro-batch, and why one backward call for inputs and weights.** The rows'
gradient must go back on the wire as soon as it exists; the SwiGLU stage computes the weight
gradients afterwards, while it travels. Splitting an arbitrary module's backward the same way
would run part of it twice (the gradient reaching the down projection's input is needed by
both), about a quarter more backward work for a SwiGLU; one ``torch.autograd.grad`` per
micro-batch computes both at once, and the gradient rows still leave before the next
micro-batch's backward starts.

**Parameters** are the module's tensors as the call sees them (Hugging Face's expert
parallelism swaps its DTensor parameters for their local shards during the call): they are
inputs of the call's autograd node, and the stage runs the module with detached leaves in
their place (``torch.func.functional_call``'s reparametrisation), so gradients reach the
originals through the node, whatever they are (parameters, views of DTensors, FSDP2 shards
gathered for the forward).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.stateless import _reparametrize_module

ExpertsForward = Callable[[Tensor, Tensor, Tensor], Tensor]  # the contract (module docstring)
# the (hidden, dtype, device) a module was already tried on, one row each, kept on the module:
# a module that cannot take the call's rows fails there, before the handshake, not on the
# ranks that got rows mid-pipeline
TRIED_ATTRIBUTE = "_mc2_tried_on"


def stand_in_problem(module: nn.Module) -> str | None:
    """Why ``module`` cannot run on stand-ins for its parameters, or ``None``: a
    parametrization anywhere in it (PEFT's LoRA on an experts tensor, ``target_parameters``,
    registers one while its forward runs) computes the weight from tensors the stage does not
    see, so their gradients would be lost, silently."""
    for name, sub in module.named_modules():
        if parametrize.is_parametrized(sub):
            where = f"{name}." if name else ""
            return (f"{type(module).__name__} has a parametrization of "
                    f"{[where + p for p in sub.parametrizations]} (an adapter on the experts' "
                    "tensors, e.g. PEFT's target_parameters)")
    return None


def _buffer_state(module: nn.Module) -> list[tuple[int, int]]:
    """Each buffer's identity and version: what changes when a call updates one."""
    return [(id(b), b._version) for b in module.buffers()]


class KeptAsIs:
    """Activations kept as they are, not through ``save_for_backward``: an autograd graph of
    their own (a module stage's, a dense capacity pass's), or a capacity pass's sorted pairs.
    The same two methods as :class:`~mc2.engine.compute.experts.ExpertActivations`, so the
    pass's state never asks which it holds."""

    def saved(self) -> tuple[Tensor, ...]:
        return ()

    def restored(self, tensors: Any) -> Any:
        return self


@dataclass
class ModuleActivations(KeptAsIs):
    """One micro-batch's forward, kept for its backward: the rows as a leaf, the leaves that
    stood for the parameters, and the module's output (the root of its autograd graph)."""

    rows: Tensor
    leaves: tuple[Tensor, ...]
    out: Tensor


@dataclass(frozen=True)
class ModuleExperts:
    """This rank's experts as a module (see the module docstring).

    Attributes:
        module: holds the parameters (by ``names``).
        forward: the experts forward to run (default ``module.forward``; Hugging Face's expert
            parallelism replaces ``module.forward`` and keeps the original, which is this).
        local_experts: experts on this rank.
        hidden: the rows' width.
        names: the parameters' names in ``module``, in the order of :meth:`tensors`.
        params: the parameters as this call sees them.
        tokens_per_expert: ``forward`` also takes the rows per local expert, on the host.
    """

    module: nn.Module
    forward: Callable[..., Tensor]
    local_experts: int
    hidden: int
    names: tuple[str, ...]
    params: tuple[Tensor, ...]
    tokens_per_expert: bool = False

    @staticmethod
    def of(module: nn.Module, hidden: int, *, forward: Callable[..., Tensor] | None = None,
           local_experts: int | None = None, tokens_per_expert: bool = False
           ) -> "ModuleExperts":
        """The module's floating-point parameters, read now (inside any context that swapped
        them, e.g. Hugging Face's local shards of DTensor parameters)."""
        if (problem := stand_in_problem(module)) is not None:
            raise ValueError(
                f"fused_expert_module: mc2 runs the experts on stand-ins for their tensors, "
                f"which would skip what changes them: {problem}. Put the adapter where mc2 "
                f"calls the module (a shared MLP), or on experts mc2 computes itself (Mixtral, "
                f"Qwen-MoE under enable_mc2: get_peft_model after enable_mc2)")
        named = [(n, p) for n, p in module.named_parameters() if p.is_floating_point()]
        if local_experts is None:
            local_experts = getattr(module, "num_experts", None)
        if not isinstance(local_experts, int) or local_experts < 1:
            raise ValueError("fused_expert_module: pass local_experts= (the module has no "
                             "integer num_experts attribute)")
        return ModuleExperts(module, forward or module.forward, local_experts, hidden,
                             tuple(n for n, _ in named), tuple(p for _, p in named),
                             tokens_per_expert)

    def tensors(self) -> tuple[Tensor, ...]:
        return self.params

    def problem(self, like: Tensor) -> str | None:
        """Why the module cannot take rows like ``like``'s, or ``None``: it runs once on one
        zero row per (width, dtype, device), before the call's handshake, so that a module that
        fails does so on every rank, as an error, and never mid-pipeline on some ranks while
        the others wait in a transfer. Tried again when what the module runs changes (Hugging
        Face's ``set_experts_implementation``, a forward replaced): a kernel chosen after the
        first try failed inside the pipeline on the ranks that got rows while the others
        waited (found by a review)."""
        runs = getattr(self.forward, "__func__", self.forward)
        key = (self.hidden, like.dtype, str(like.device), id(runs), self.module.training,
               getattr(getattr(self.module, "config", None), "_experts_implementation", None))
        tried: set = self.module.__dict__.setdefault(TRIED_ATTRIBUTE, set())
        if key in tried:
            return None
        row = torch.zeros(1, self.hidden, dtype=like.dtype, device=like.device)
        ids = torch.zeros(1, 1, dtype=torch.int64, device=like.device)
        state = _buffer_state(self.module)
        try:
            with torch.no_grad():
                self._call(row, ids, torch.ones(1, 1, dtype=like.dtype, device=like.device),
                           self.params, self.only(0, 1))
        except Exception as exc:  # noqa: BLE001 - reported on every rank by the handshake
            return (f"the experts module {type(self.module).__name__} fails on a row of "
                    f"width {self.hidden} and dtype {like.dtype}: {type(exc).__name__}: {exc}")
        if _buffer_state(self.module) != state:
            # a running statistic (a fake-quantised activation's amax, say) would be updated
            # once per micro-batch and expert and once more here: other values than the
            # model's, silently (found by a review)
            return (f"the experts module {type(self.module).__name__} changes its buffers when "
                    "called (a running statistic?): mc2 calls it once per micro-batch, and "
                    "once more to try it, so its state would differ from the model's")
        tried.add(key)
        return None

    def bound(self, tensors: tuple[Tensor, ...]) -> "ModuleExperts":
        """The same experts with ``tensors`` as their parameters (the autograd node's)."""
        return replace(self, params=tuple(tensors))

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype if self.params else torch.float32

    @property
    def device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    @property
    def ffn(self) -> int:
        """Elements per expert and hidden unit: what the handshake compares (ranks running
        other experts must not exchange rows) and a width for the planner's sizes."""
        return sum(p.numel() for p in self.params) // max(1, self.local_experts * self.hidden)

    @property
    def element_size(self) -> int:
        return self.params[0].element_size() if self.params else 4

    @property
    def cache_key(self) -> tuple:
        """What the planner's calibration depends on."""
        return ("module", type(self.module).__qualname__,
                tuple(tuple(p.shape) for p in self.params), self.dtype, self.device.type)

    @property
    def anchor(self) -> Any:
        """What names these experts across a forward and its recompute."""
        return self.module

    def for_calibration(self) -> "ModuleExperts":
        return self

    def only(self, expert: int, rows: int) -> list[int]:
        """Rows per local expert where all ``rows`` go to ``expert``."""
        return [rows if e == expert else 0 for e in range(self.local_experts)]

    #: no hand-written backward: capacity slabs run every row through every expert
    has_grouped_backward = False

    def run(self, rows: Tensor, counts: list[int], offsets: Tensor, *, keep: bool,
            needs: tuple[bool, ...], strategy: str = "loop", workspace: Any = None
            ) -> tuple[Tensor, ModuleActivations | None]:
        """The module on expert-grouped ``rows`` (``counts``: rows per local expert, on the
        host; ``offsets``: their running ends, on the device); with ``keep``, what
        :meth:`backward` needs. No row: the module is not called (some experts kernels refuse
        empty inputs), and nothing is kept. ``strategy`` and ``workspace`` are mc2's SwiGLU's:
        the module has its own."""
        if rows.shape[0] == 0:
            return rows.new_zeros(rows.shape), None
        ids = torch.searchsorted(offsets.to(torch.int64),
                                 torch.arange(rows.shape[0], device=rows.device), right=True)
        ids = ids.clamp_(max=self.local_experts - 1).unsqueeze(1)
        ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
        if not keep:
            with torch.no_grad():
                return self._call(rows, ids, ones, self.params, counts), None
        leaf = rows.detach().requires_grad_(True)
        needs = tuple(needs) + (True,) * (len(self.params) - len(needs))  # unsaid: wanted
        leaves = tuple(p.detach().requires_grad_(need) for p, need in zip(self.params, needs))
        # the module's own graph, whatever saved-tensor hooks surround the call (an offload or
        # checkpoint hook would otherwise pack tensors this stage unpacks itself)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            out = self._call(leaf, ids, ones, leaves, counts)
        return out.detach(), ModuleActivations(leaf, leaves, out)

    def _call(self, rows: Tensor, ids: Tensor, ones: Tensor, params: tuple[Tensor, ...],
              counts: list[int]) -> Tensor:
        """The forward with ``params`` in the module's place (``counts``: rows per local
        expert, handed on where the stage takes them)."""
        extra = (torch.tensor(counts, dtype=torch.int64),) if self.tokens_per_expert else ()
        with _reparametrize_module(self.module, dict(zip(self.names, params))):
            out = self.forward(rows, ids, ones, *extra)
        if tuple(out.shape) != tuple(rows.shape):
            raise ValueError(f"fused_expert_module: the experts returned {tuple(out.shape)} "
                             f"for rows {tuple(rows.shape)}; they must return one row per row")
        return out

    def backward(self, saved: ModuleActivations | None, grad_rows: Tensor, counts: list[int],
                 offsets: Tensor | None, grads: "ModuleGrads", *, strategy: str = "loop",
                 workspace: Any = None) -> tuple[Tensor, None]:
        """The rows' gradient; the parameters' gradients added to ``grads`` at once (one
        autograd call gives both), so nothing is left for later (``None``)."""
        if saved is None:  # no row reached this rank's experts
            return torch.zeros_like(grad_rows), None
        wanted = [saved.rows] + [leaf for leaf in saved.leaves if leaf.requires_grad]
        if not saved.out.requires_grad:  # nothing in the module depends on a leaf
            return torch.zeros_like(saved.rows), None
        found = torch.autograd.grad(saved.out, wanted, grad_rows, allow_unused=True)
        grads.add([g for g, leaf in zip(found[1:], wanted[1:])],
                  [i for i, leaf in enumerate(saved.leaves) if leaf.requires_grad])
        return (found[0] if found[0] is not None else torch.zeros_like(saved.rows)), None

    def gradients(self, needs: tuple[bool, ...], workspace: Any = None) -> "ModuleGrads":
        return ModuleGrads(self.params, needs)

    def dense(self, rows: Tensor, table: Tensor, params: tuple[Tensor, ...]) -> Tensor:
        """``sum_e table[:, e] * expert_e(rows)``, every row through every local expert with
        ``params`` in the module's place (capacity slabs: no count reaches the host)."""
        ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
        out = torch.zeros_like(rows)
        for e in range(table.shape[1]):
            ids = torch.full((rows.shape[0], 1), e, dtype=torch.int64, device=rows.device)
            out = out + table[:, e:e + 1] * self._call(rows, ids, ones, params,
                                                       self.only(e, rows.shape[0]))
        return out

    def step(self, rows: int, strategy: str) -> None:
        """A forward and backward of ``rows`` random rows through the first expert (the
        planner's calibration)."""
        x = torch.randn(rows, self.hidden, dtype=self.dtype, device=self.device)
        offsets = torch.full((self.local_experts,), rows, dtype=torch.int64, device=self.device)
        out, saved = self.run(x, self.only(0, rows), offsets, keep=True,
                              needs=(True,) * len(self.params))
        assert saved is not None
        self.backward(saved, torch.ones_like(out), self.only(0, rows), offsets,
                      self.gradients((True,) * len(self.params)))


def _same(t: Tensor) -> Tensor:
    return t


class ModuleGrads:
    """The parameters' gradients of one backward, summed over its micro-batches (zeros for a
    parameter no row reached). ``params``: the parameters, in the order the gradients come
    (a module stage's, or any autograd-recorded experts')."""

    def __init__(self, params: tuple[Tensor, ...], needed: tuple[bool, ...]) -> None:
        self.params = tuple(params)
        self.needed = tuple(needed) + (False,) * (len(self.params) - len(needed))
        self._grads: list[Tensor | None] = [None] * len(self.params)

    def add(self, grads: list[Tensor | None], indices: list[int]) -> None:
        for i, g in zip(indices, grads):
            if g is None:
                continue
            self._grads[i] = g if self._grads[i] is None else self._grads[i].add_(g)

    def finish(self) -> tuple[Tensor | None, ...]:
        return tuple((g if g is not None else torch.zeros_like(p)) if need else None
                     for g, p, need in zip(self._grads, self.params, self.needed))
