"""SwiGLU expert math on expert-grouped rows: ``down(silu(x @ gate) * (x @ up))``.

Rows arrive grouped by local expert (``counts[l]`` rows for expert ``l``, in order). The weights
come in one of two layouts (:class:`ExpertWeights`), and neither is ever copied or transposed
in memory by a call:

* **packed** (``gate_up [L, 2F, H]`` with the gate rows first, ``down [L, H, F]``): the
  ``nn.Linear`` ``[out, in]`` layout of Hugging Face's ``gate_up_proj``/``down_proj``,
  Megatron's ``linear_fc1``/``linear_fc2`` and DeepSpeed experts. Gate and up are one
  ``[R, H] x [H, 2F]`` GEMM forward and one ``[R, 2F] x [2F, H]`` GEMM for the input gradient.
  Measured with ``benchmarks/gemm_strategies.py``, this is the faster layout on the CPU here (the
  BLAS kernels prefer a transposed right operand), so :class:`mc2.MoELayer` and the Hugging Face
  adapter keep their experts packed.
* **split** (``gate, up [L, H, F]``, ``down [L, F, H]``): the article's
  ``weights_up/weights_gate/weights_down`` signature; two GEMMs where packed runs one.

Two GEMM strategies compute the same thing: ``"loop"`` (one ``torch.mm`` per non-empty expert,
writing into preallocated slices) and ``"grouped"`` (``torch.nn.functional.grouped_mm``: one
launch for all experts, its offsets built on the device). ``"auto"`` measures both once per
weight shape, dtype and device (:mod:`mc2.engine.decide.gemm_strategy`).

Weight gradients are *written*, not zero-filled and accumulated: the first micro-batch that
touches an expert writes its gradient with ``mm(out=...)``, later ones add to it, and only the
experts that received no row at all are zeroed (:class:`WeightGrads`). Every large buffer comes
from a :class:`~mc2.engine.transport.workspace.Workspace`, so steady-state calls do not allocate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from mc2.engine.compute.grouped_into import grouped_mm_into
from mc2.engine.transport.workspace import Workspace


PACKED_ORDER = ("gate_up", "down")  # fused_expert_packed(x, weights_gate_up, weights_down)
SPLIT_ORDER = ("up", "gate", "down")  # fused_expert(x, weights_up, weights_gate, weights_down)


@dataclass(frozen=True)
class ExpertWeights:
    """This rank's routed experts, in the packed or the split layout (see the module docstring).

    Each layout has one order, the order of its public call, used everywhere a layout's
    tensors travel as a sequence (autograd inputs, gradients): :data:`PACKED_ORDER`
    ``(gate_up, down)`` and :data:`SPLIT_ORDER` ``(up, gate, down)``.

    Attributes:
        down: packed ``[L, H, F]``; split ``[L, F, H]``.
        gate_up: packed ``[L, 2F, H]`` (gate rows ``[:F]``, up rows ``[F:]``), else ``None``.
        gate, up: split ``[L, H, F]`` each, else ``None``.
    """

    down: Tensor
    gate_up: Tensor | None = None
    gate: Tensor | None = None
    up: Tensor | None = None

    @staticmethod
    def packed_of(gate_up: Tensor, down: Tensor) -> "ExpertWeights":
        return ExpertWeights(down=down, gate_up=gate_up)

    @staticmethod
    def split_of(up: Tensor, gate: Tensor, down: Tensor) -> "ExpertWeights":
        return ExpertWeights(down=down, gate=gate, up=up)

    @staticmethod
    def in_order(tensors: tuple[Tensor, ...]) -> "ExpertWeights":
        """From a layout's tensors in its order (two: packed, three: split)."""
        names = PACKED_ORDER if len(tensors) == 2 else SPLIT_ORDER
        return ExpertWeights(**dict(zip(names, tensors)))

    @property
    def packed(self) -> bool:
        return self.gate_up is not None

    @property
    def local_experts(self) -> int:
        return self.down.shape[0]

    @property
    def hidden(self) -> int:
        return self.down.shape[1] if self.packed else self.down.shape[2]

    @property
    def ffn(self) -> int:
        return self.down.shape[2] if self.packed else self.down.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.down.dtype

    @property
    def device(self) -> torch.device:
        return self.down.device

    @property
    def order(self) -> tuple[str, ...]:
        return PACKED_ORDER if self.packed else SPLIT_ORDER

    def tensors(self) -> tuple[Tensor, ...]:
        """The layout's tensors in its order: ``(gate_up, down)`` or ``(up, gate, down)``."""
        return tuple(getattr(self, name) for name in self.order)

    def detached(self) -> "ExpertWeights":
        return ExpertWeights.in_order(tuple(t.detach() for t in self.tensors()))

    @property
    def element_size(self) -> int:
        return self.down.element_size()

    @property
    def cache_key(self) -> tuple:
        """What the planner's calibration depends on."""
        return (tuple(self.down.shape), self.packed, self.dtype, self.device.type)

    @property
    def anchor(self) -> Tensor:
        """What names these experts across a forward and its recompute."""
        return self.down

    def for_calibration(self) -> "ExpertWeights":
        """One expert, detached (views): what the planner times."""
        return ExpertWeights.in_order(tuple(t[:1].detach() for t in self.tensors()))

    def step(self, rows: int, strategy: str) -> None:
        """A forward and backward of ``rows`` random rows through the first expert."""
        x = torch.randn(rows, self.hidden, dtype=self.dtype, device=self.device)
        forward_and_backward(x, [rows], self, strategy=strategy)

    # ---- the experts stage: the same methods as ModuleExperts', so a pass never asks which
    #: a hand-written backward over sorted rows (capacity slabs may run it grouped)
    has_grouped_backward = True

    def run(self, rows: Tensor, counts: list[int], offsets: Tensor | None, *, keep: bool,
            needs: tuple[bool, ...], strategy: str, workspace: Workspace | None
            ) -> tuple[Tensor, "ExpertActivations | None"]:
        """The experts on expert-grouped ``rows`` (:func:`swiglu_forward`); ``needs`` is
        unused: the weights' gradients are chosen in :meth:`gradients`."""
        return swiglu_forward(rows, counts, self, strategy=strategy, keep_activations=keep,
                              workspace=workspace, offsets=offsets)

    def backward(self, saved: "ExpertActivations", grad_rows: Tensor, counts: list[int],
                 offsets: Tensor | None, grads: "WeightGrads", *, strategy: str,
                 workspace: Workspace | None) -> tuple[Tensor, "WeightGradInputs | None"]:
        """The rows' gradient, and the weight gradients' operands for ``grads.add`` later
        (the pass adds them while the rows' gradient travels)."""
        return swiglu_backward_input(grad_rows, saved, counts, self, strategy=strategy,
                                     workspace=workspace, offsets=offsets)

    def gradients(self, needs: tuple[bool, ...], workspace: Workspace | None) -> "WeightGrads":
        return WeightGrads(self, needs, workspace)

    def dense(self, rows: Tensor, table: Tensor, params: tuple[Tensor, ...]) -> Tensor:
        """``sum_e table[:, e] * expert_e(rows)`` over this rank's experts, every row through
        every expert (``params``: these weights' tensors, or leaves standing for them): no
        per-expert count is needed, so nothing is read to the host."""
        w = ExpertWeights.in_order(params)
        many = rows.unsqueeze(0).expand(table.shape[1], *rows.shape)
        if w.packed:
            gate_up = torch.bmm(many, w.gate_up.transpose(1, 2))
            gate, up = gate_up[..., :w.ffn], gate_up[..., w.ffn:]
            down = w.down.transpose(1, 2)
        else:
            gate, up, down = torch.bmm(many, w.gate), torch.bmm(many, w.up), w.down
        y = torch.bmm(torch.nn.functional.silu(gate) * up, down)  # [L, R, H]
        return (y * table.t().unsqueeze(-1)).sum(0)


def _ranges(counts: list[int]) -> list[tuple[int, int, int]]:
    """``(expert, start, stop)`` for every expert with at least one row."""
    out, start = [], 0
    for expert, n in enumerate(counts):
        if n:
            out.append((expert, start, start + n))
        start += n
    return out


def _offsets(counts: list[int], device: torch.device) -> Tensor:
    """``grouped_mm``'s ``offs`` from host counts. The pipeline passes offsets built on the
    device instead (:attr:`mc2.engine.decide.routing.MicroBatchRoute.expert_offsets`); one group needs
    no upload either."""
    if len(counts) == 1:
        return torch.full((1,), counts[0], dtype=torch.int32, device=device)
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


def _per_expert(a: Tensor, w: Tensor, counts: list[int], strategy: str, out: Tensor,
                accumulate: bool = False, offsets: Tensor | None = None) -> Tensor:
    """``out[rows of l] (+)= a[rows of l] @ w[l]`` for every local expert ``l``.

    ``w`` may be a transposed view (``[L, in, out]`` with any strides): BLAS reads it in place.
    ``offsets``: the running ends of ``counts`` on the device, for ``"grouped"``.
    """
    if strategy == "grouped":
        offs = offsets if offsets is not None else _offsets(counts, a.device)
        grouped_mm_into(a, w, offs, out, accumulate)
        return out
    for expert, start, stop in _ranges(counts):
        if accumulate:
            out[start:stop].addmm_(a[start:stop], w[expert])
        else:
            torch.mm(a[start:stop], w[expert], out=out[start:stop])
    return out


@dataclass
class ExpertActivations:
    """What the backward of one micro-batch needs: ``x [R, H]`` and ``gate_up [R, 2F]``.

    ``silu(gate) * up`` is recomputed in the backward rather than stored.
    """

    x: Tensor
    gate_up: Tensor

    def saved(self) -> tuple[Tensor, ...]:
        """The tensors ``save_for_backward`` keeps for this micro-batch."""
        return (self.x, self.gate_up)

    def restored(self, tensors: Sequence[Tensor]) -> ExpertActivations:
        """The activations from :meth:`saved`'s tensors as a saved-tensor hook hands them
        back."""
        return ExpertActivations(*tensors)


def swiglu_forward(
    x: Tensor,
    counts: list[int],
    weights: ExpertWeights,
    *,
    strategy: str,
    keep_activations: bool,
    workspace: Workspace | None = None,
    offsets: Tensor | None = None,
    out: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, ExpertActivations | None]:
    """Expert outputs ``[R, H]`` for expert-grouped rows ``x [R, H]``.

    Args:
        counts: rows per local expert, ``sum(counts) == R``.
        strategy: ``"grouped"`` or ``"loop"`` (see :func:`resolve_strategy`).
        keep_activations: return what :func:`swiglu_backward_input` needs.
        offsets: ``counts``' running ends on the device (``"grouped"`` needs them).
        out: ``(y [R, H], gate_up [R, 2F] or None)`` to write into, for a caller that
            computes its rows in parts (the shared experts, half under the fill and half under
            the drain); a ``None`` ``gate_up`` is a temporary of this call.
    """
    ws = workspace or Workspace.transient()
    rows, ffn = x.shape[0], weights.ffn
    gate_up = out[1] if out is not None and out[1] is not None else ws.empty(
        (rows, 2 * ffn), x.dtype, x.device)
    if rows:
        if weights.packed:
            _per_expert(x, weights.gate_up.transpose(1, 2), counts, strategy, gate_up,
                        offsets=offsets)
        else:
            _per_expert(x, weights.gate, counts, strategy, gate_up[:, :ffn], offsets=offsets)
            _per_expert(x, weights.up, counts, strategy, gate_up[:, ffn:], offsets=offsets)
    act = ws.empty((rows, ffn), x.dtype, x.device)
    torch.ops.aten.silu.out(gate_up[:, :ffn], out=act)
    act.mul_(gate_up[:, ffn:])
    y = out[0] if out is not None else ws.empty((rows, weights.hidden), x.dtype, x.device)
    down = weights.down.transpose(1, 2) if weights.packed else weights.down
    if rows:
        _per_expert(act, down, counts, strategy, y, offsets=offsets)
    return y, (ExpertActivations(x, gate_up) if keep_activations else None)


@dataclass
class WeightGradInputs:
    """Operands of the weight gradients of one micro-batch, produced by
    :func:`swiglu_backward_input` and consumed by :meth:`WeightGrads.add`.

    Why separate: the input gradient must travel back to the token owners, the weight gradients
    stay here. Computing the input gradient first lets the pipeline put it on the wire at once
    and do the weight-gradient GEMMs while it travels.
    """

    x: Tensor  # [R, H]
    act: Tensor  # [R, F] silu(gate) * up
    grad_y: Tensor  # [R, H]
    grad_gate_up: Tensor  # [R, 2F]
    counts: list[int]
    offsets: Tensor | None = None  # counts' running ends on the device


def swiglu_backward_input(
    grad_y: Tensor,
    saved: ExpertActivations,
    counts: list[int],
    weights: ExpertWeights,
    *,
    strategy: str,
    workspace: Workspace | None = None,
    offsets: Tensor | None = None,
) -> tuple[Tensor, WeightGradInputs | None]:
    """Gradient w.r.t. the expert inputs ``[R, H]``, plus what the weight gradients need.

    Consumes ``saved``: its ``gate_up`` buffer is overwritten with the gradient of gate_up, so
    a micro-batch's backward runs once.

    Args:
        grad_y: ``[R, H]`` gradient of the expert outputs, expert-grouped like ``saved.x``.
    """
    ws = workspace or Workspace.transient()
    rows, ffn, hidden = grad_y.shape[0], weights.ffn, weights.hidden
    grad_x = ws.empty((rows, hidden), grad_y.dtype, grad_y.device)
    if rows == 0:
        return grad_x, None
    # The gradient of gate_up is written over the saved gate_up (needed no more afterwards):
    # one [R, 2F] buffer less at the backward's peak, for one [R, F] copy.
    grad_gate_up = saved.gate_up
    gate, up = grad_gate_up[:, :ffn], grad_gate_up[:, ffn:]
    grad_act = ws.empty((rows, ffn), grad_y.dtype, grad_y.device)
    _per_expert(grad_y, weights.down if weights.packed else weights.down.transpose(1, 2), counts,
                strategy, grad_act, offsets=offsets)
    act = ws.empty((rows, ffn), grad_y.dtype, grad_y.device)
    torch.ops.aten.silu.out(gate, out=act)  # silu(gate); act = silu(gate) * up below
    grad_silu = ws.empty((rows, ffn), grad_y.dtype, grad_y.device)
    torch.mul(grad_act, up, out=grad_silu)
    grad_act.mul_(act)  # now d up
    act.mul_(up)
    torch.ops.aten.silu_backward.grad_input(grad_silu, gate, grad_input=gate)  # d gate
    del grad_silu
    up.copy_(grad_act)
    del grad_act
    if weights.packed:
        _per_expert(grad_gate_up, weights.gate_up, counts, strategy, grad_x, offsets=offsets)
    else:
        _per_expert(grad_gate_up[:, :ffn], weights.gate.transpose(1, 2), counts, strategy, grad_x,
                    offsets=offsets)
        _per_expert(grad_gate_up[:, ffn:], weights.up.transpose(1, 2), counts, strategy, grad_x,
                    accumulate=True, offsets=offsets)
    return grad_x, WeightGradInputs(saved.x, act, grad_y, grad_gate_up, counts, offsets)


class WeightGrads:
    """The weight gradients of one backward, written by the first micro-batch that touches an
    expert and added to by later ones (no zero fill, no read-modify-write on first touch).

    Args:
        weights: the weights whose gradients these are (layout and shapes).
        needed: one flag per tensor, in the layout's order (:attr:`ExpertWeights.order`), as
            ``ctx.needs_input_grad``; ``None``: all.
    """

    def __init__(self, weights: ExpertWeights, needed: tuple[bool, ...] | None = None,
                 workspace: Workspace | None = None) -> None:
        self.weights = weights
        self._needed = dict(zip(weights.order, needed or (True,) * len(weights.order)))
        self._workspace = workspace or Workspace.transient()
        self._grads: dict[str, Tensor | None] | None = None
        self.touched = [False] * weights.local_experts

    @property
    def grads(self) -> dict[str, Tensor | None]:
        """By name; allocated on first use, i.e. after the first micro-batch's input gradient:
        by then that micro-batch's temporaries are free, so the gradients reuse their memory."""
        if self._grads is None:
            ws = self._workspace
            self._grads = {name: ws.empty(tuple(w.shape), w.dtype, w.device)
                           if self._needed[name] else None
                           for name, w in zip(self.weights.order, self.weights.tensors())}
        return self._grads

    def add(self, work: WeightGradInputs | None, *, strategy: str) -> None:
        """Add one micro-batch's contribution."""
        if work is None:
            return
        ffn = self.weights.ffn
        # each weight's gradient is a @ b over the rows (a: [*, R], b: [R, *])
        parts = (("gate_up", work.grad_gate_up.t(), work.x), ("down", work.grad_y.t(), work.act)) \
            if self.weights.packed else \
            (("gate", work.x.t(), work.grad_gate_up[:, :ffn]),
             ("up", work.x.t(), work.grad_gate_up[:, ffn:]), ("down", work.act.t(), work.grad_y))
        if strategy == "grouped":
            self._add_grouped(work, parts)
            return
        for expert, start, stop in _ranges(work.counts):
            first = not self.touched[expert]
            self.touched[expert] = True
            for name, a, b in parts:
                _write(self.grads[name], expert, a[:, start:stop], b[start:stop], first)

    def _add_grouped(self, work: WeightGradInputs, parts: tuple[tuple[str, Tensor, Tensor], ...]
                     ) -> None:
        """One grouped GEMM per weight writes every expert's gradient (an empty group's is
        zero) into its buffer (:mod:`mc2.engine.compute.grouped_into`), or adds to it after the
        first micro-batch."""
        offs = work.offsets if work.offsets is not None else _offsets(work.counts, work.x.device)
        first = not any(self.touched)
        for name, a, b in parts:
            grad = self.grads[name]
            if grad is not None:
                grouped_mm_into(a, b, offs, grad, not first)
        self.touched = [True] * len(self.touched)

    def finish(self) -> tuple[Tensor | None, ...]:
        """The gradients in the layout's order; experts that saw no row are zeroed."""
        for expert, seen in enumerate(self.touched):
            if not seen:
                for grad in self.grads.values():
                    if grad is not None:
                        grad[expert].zero_()
        return tuple(self.grads[name] for name in self.weights.order)


def _write(grad: Tensor | None, expert: int, a: Tensor, b: Tensor, first: bool) -> None:
    if grad is None:
        return
    if first:
        torch.mm(a, b, out=grad[expert])
    else:
        grad[expert].addmm_(a, b)


def forward_and_backward(x: Tensor, counts: list[int], weights: ExpertWeights, *, strategy: str,
                         offsets: Tensor | None = None, workspace: Workspace | None = None
                         ) -> None:
    """A forward and a backward of ``x``'s rows, weight gradients included: the expert work
    of one training step, as the planner and the GEMM strategy choice (and
    ``benchmarks/gemm_strategies.py``) time it."""
    y, saved = swiglu_forward(x, counts, weights, strategy=strategy, keep_activations=True,
                              workspace=workspace, offsets=offsets)
    assert saved is not None
    grads = WeightGrads(weights, None, workspace)
    _, work = swiglu_backward_input(y, saved, counts, weights, strategy=strategy,
                                    workspace=workspace, offsets=offsets)
    grads.add(work, strategy=strategy)
    grads.finish()
