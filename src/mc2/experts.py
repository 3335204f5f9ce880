"""SwiGLU expert math on expert-grouped rows: ``down(silu(x @ gate) * (x @ up))``.

Rows arrive grouped by local expert (``counts[l]`` rows for expert ``l``, in order). Two GEMM
strategies compute the same thing:

* ``"grouped"``: ``torch.nn.functional.grouped_mm`` with cumulative offsets, one kernel per
  projection (float32/bfloat16/float16 only);
* ``"loop"``: one ``torch.mm`` per non-empty expert, writing into preallocated slices.

``"auto"`` takes ``loop``: measured with ``benchmarks/gemm_strategies.py`` on CPU (torch 2.13,
one thread) the two are within 2-7% of each other with ``loop`` ahead on small experts, and on an
H200 (torch 2.11, bf16, 8 experts of 4096x3584, 32768 rows, forward+backward) ``loop`` took
13.6 ms against 15.1 ms for ``grouped_mm``. ``grouped`` stays available for shapes where kernel
launches dominate (many small experts); pass ``gemm="grouped"``.
The backward accumulates weight gradients into caller-owned buffers so that micro-batches add up
without extra allocations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

GemmStrategy = Literal["auto", "grouped", "loop"]
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class ExpertActivations:
    """What the backward of one micro-batch needs: ``x [R, H]``, ``gate``, ``up`` ``[R, F]``.

    Memory: ``R * (H + 2F)`` elements per micro-batch, ``R`` the rows this rank's experts
    received. ``silu(gate) * up`` is recomputed in the backward rather than stored.
    """

    x: Tensor
    gate: Tensor
    up: Tensor


def resolve_strategy(strategy: GemmStrategy, dtype: torch.dtype, device: torch.device) -> str:
    """Turn ``"auto"`` into a concrete strategy; reject ``"grouped"`` where it cannot run."""
    if strategy not in ("auto", "grouped", "loop"):
        raise ValueError(f"gemm must be 'auto', 'grouped' or 'loop', got {strategy!r}")
    grouped_ok = hasattr(F, "grouped_mm") and dtype in _GROUPED_DTYPES
    if strategy == "grouped" and not grouped_ok:
        raise ValueError(f"gemm='grouped' needs float32/bfloat16/float16, got {dtype}; use 'loop'")
    return "loop" if strategy == "auto" else strategy


def _ranges(counts: list[int]) -> list[tuple[int, int, int]]:
    """``(expert, start, stop)`` for every expert with at least one row."""
    out, start = [], 0
    for expert, n in enumerate(counts):
        if n:
            out.append((expert, start, start + n))
        start += n
    return out


def _offsets(counts: list[int], device: torch.device) -> Tensor:
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


def _grouped(a: Tensor, w: Tensor, counts: list[int], strategy: str) -> Tensor:
    """``out[rows of l] = a[rows of l] @ w[l]`` for every local expert ``l``."""
    if strategy == "grouped":
        return F.grouped_mm(a, w, offs=_offsets(counts, a.device))
    out = a.new_empty((a.shape[0], w.shape[-1]))
    for expert, start, stop in _ranges(counts):
        torch.mm(a[start:stop], w[expert], out=out[start:stop])
    return out


def _grouped_weight_grad(a: Tensor, g: Tensor, counts: list[int], strategy: str, acc: Tensor) -> None:
    """``acc[l] += a[rows of l].T @ g[rows of l]`` (weight gradient, accumulated)."""
    if strategy == "grouped":
        acc.add_(F.grouped_mm(a.t(), g, offs=_offsets(counts, a.device)))
        return
    for expert, start, stop in _ranges(counts):
        acc[expert].addmm_(a[start:stop].t(), g[start:stop])


def swiglu_forward(
    x: Tensor,
    counts: list[int],
    w_up: Tensor,
    w_gate: Tensor,
    w_down: Tensor,
    *,
    strategy: str,
    keep_activations: bool,
) -> tuple[Tensor, ExpertActivations | None]:
    """Expert outputs ``[R, H]`` for expert-grouped rows ``x [R, H]``.

    Args:
        counts: rows per local expert, ``sum(counts) == R``.
        w_up, w_gate: ``[L, H, F]``; w_down: ``[L, F, H]``.
        strategy: ``"grouped"`` or ``"loop"`` (see :func:`resolve_strategy`).
        keep_activations: return what :func:`swiglu_backward` needs.
    """
    if x.shape[0] == 0:
        empty = x.new_empty((0, w_up.shape[-1]))
        return x.new_empty((0, w_down.shape[-1])), (
            ExpertActivations(x, empty, empty) if keep_activations else None
        )
    gate = _grouped(x, w_gate, counts, strategy)
    up = _grouped(x, w_up, counts, strategy)
    y = _grouped(F.silu(gate) * up, w_down, counts, strategy)
    return y, (ExpertActivations(x, gate, up) if keep_activations else None)


@dataclass
class WeightGradInputs:
    """Operands of the weight gradients of one micro-batch, produced by
    :func:`swiglu_backward_input` and consumed by :func:`accumulate_weight_grads`.

    Why separate: the input gradient must travel back to the token owners, the weight gradients
    stay here. Computing the input gradient first lets the pipeline put it on the wire at once
    and do the weight-gradient GEMMs while it travels.
    """

    x: Tensor  # [R, H]
    act: Tensor  # [R, F] silu(gate) * up
    grad_y: Tensor  # [R, H]
    grad_up: Tensor  # [R, F]
    grad_gate: Tensor  # [R, F]
    counts: list[int]


def swiglu_backward_input(
    grad_y: Tensor,
    saved: ExpertActivations,
    counts: list[int],
    w_up: Tensor,
    w_gate: Tensor,
    w_down: Tensor,
    *,
    strategy: str,
) -> tuple[Tensor, WeightGradInputs | None]:
    """Gradient w.r.t. the expert inputs ``[R, H]``, plus what the weight gradients need.

    Args:
        grad_y: ``[R, H]`` gradient of the expert outputs, expert-grouped like ``saved.x``.
    """
    if grad_y.shape[0] == 0:
        return grad_y.new_empty((0, w_up.shape[1])), None
    sig = torch.sigmoid(saved.gate)
    silu = saved.gate * sig
    grad_act = _grouped(grad_y, w_down.transpose(1, 2), counts, strategy)
    grad_up = grad_act * silu
    grad_gate = grad_act.mul_(saved.up).mul_(sig * (1 + saved.gate * (1 - sig)))
    grad_x = _grouped(grad_up, w_up.transpose(1, 2), counts, strategy)
    grad_x.add_(_grouped(grad_gate, w_gate.transpose(1, 2), counts, strategy))
    act = silu.mul_(saved.up)
    return grad_x, WeightGradInputs(saved.x, act, grad_y, grad_up, grad_gate, counts)


def accumulate_weight_grads(
    work: WeightGradInputs | None, grads: tuple[Tensor, Tensor, Tensor], *, strategy: str
) -> None:
    """Add one micro-batch's contribution to ``grads = (grad_up, grad_gate, grad_down)``."""
    if work is None:
        return
    grad_up_w, grad_gate_w, grad_down_w = grads
    _grouped_weight_grad(work.act, work.grad_y, work.counts, strategy, grad_down_w)
    _grouped_weight_grad(work.x, work.grad_up, work.counts, strategy, grad_up_w)
    _grouped_weight_grad(work.x, work.grad_gate, work.counts, strategy, grad_gate_w)


def swiglu_backward(
    grad_y: Tensor,
    saved: ExpertActivations,
    counts: list[int],
    w_up: Tensor,
    w_gate: Tensor,
    w_down: Tensor,
    grads: tuple[Tensor, Tensor, Tensor],
    *,
    strategy: str,
) -> Tensor:
    """Input gradient ``[R, H]``; adds the weight gradients into ``grads`` right away."""
    grad_x, work = swiglu_backward_input(grad_y, saved, counts, w_up, w_gate, w_down,
                                         strategy=strategy)
    accumulate_weight_grads(work, grads, strategy=strategy)
    return grad_x
