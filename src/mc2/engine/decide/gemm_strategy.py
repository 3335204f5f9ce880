"""Which expert GEMM strategy a call runs: ``"loop"`` or ``"grouped"``, chosen by measurement.

``"loop"`` launches one GEMM per non-empty expert and pass (about ``6 * L * K`` small GEMMs per
layer for a forward and backward of ``K`` micro-batches over ``L`` local experts); ``"grouped"``
launches one ``torch.nn.functional.grouped_mm`` per GEMM of the SwiGLU for all experts at once.
Which is faster depends on the device, the dtype and the expert size: on a GPU launches are
expensive and grouped kernels are tuned for bf16; on a CPU, one thread, the two were within a
few percent with the loop ahead on small experts. So ``gemm="auto"`` does not assume: it times a
forward and backward of both on this rank's own weight shape, once per (layout, shape, dtype,
device), with the device's clock (:mod:`mc2.device.clock`), and takes ``"grouped"`` only where it
measured at least :data:`MIN_GAIN` faster. The strategy is local arithmetic: ranks need not
agree on it, and the choice never changes what crosses the wire.

On a CPU ``"auto"`` takes ``"loop"`` without timing: there :func:`grouped_mm_into`'s kernel is
the same per-expert loop of ``mm`` (plus a read of the offsets), so it cannot win, and timing it
cost a process's first call ~2 s (1.4 s of it importing ``torch._dynamo``, which a custom op's
first call does; hidden 1024, ffn 2048, docs/measurements.md).
"""

from __future__ import annotations

import itertools
import torch
import torch.nn.functional as F

from mc2.device.rng import kept_rng
from mc2.device.clock import clock_for
from mc2.device.per_device import device_state
from mc2.device.streams import full_device
from mc2.engine.decide.config import GemmStrategy
from mc2.engine.compute.experts import ExpertWeights, forward_and_backward
from mc2.engine.transport.host import upload

GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_GAIN = 0.05  # what one-time timing of a few repeats can tell apart
ROWS_PER_EXPERT = 64  # rows per expert of the timed step
REPEATS = 3


def grouped_problem(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why ``grouped_mm`` cannot serve this dtype and device without stalling, or ``None``.

    On CUDA only bf16 on compute capability 9.x/10.x has a grouped kernel; everything else
    falls back to a per-group loop that reads the offsets back to the host (``offs.cpu()``),
    which stops the host at every GEMM.
    """
    if not hasattr(F, "grouped_mm"):
        return "this PyTorch has no torch.nn.functional.grouped_mm"
    if dtype not in GROUPED_DTYPES:
        return f"gemm='grouped' needs float32/bfloat16/float16, got {dtype}"
    if device.type == "cuda" and torch.version.hip is not None:  # ROCm's "cuda": majors differ
        return ("gemm='grouped' on ROCm: not known to have a grouped kernel that leaves its "
                "offsets on the device (never measured there)")
    if device.type == "cuda":
        major = torch.cuda.get_device_capability(device)[0]
        if dtype != torch.bfloat16 or major not in (9, 10):
            return (f"gemm='grouped' on CUDA needs bfloat16 on compute capability 9.x or 10.x "
                    f"(got {dtype}, {major}.x): elsewhere grouped_mm reads its offsets back to "
                    "the host at every GEMM")
    return None


def strategy_problem(strategy: GemmStrategy, dtype: torch.dtype, device: torch.device
                     ) -> str | None:
    """Why a validated ``gemm=`` cannot serve this dtype and device, or ``None`` (checked
    before the call's handshake, so it is an error on every rank)."""
    if strategy == "grouped" and (why := grouped_problem(dtype, device)) is not None:
        return f"{why}; use 'loop'"
    return None


def _time_step(weights: ExpertWeights, strategy: str, rows: int) -> float:
    """Median seconds of a forward and backward of ``rows`` rows split evenly over the local
    experts (weight gradients included)."""
    local = weights.local_experts
    counts = [rows // local] * local
    ends = upload(list(itertools.accumulate(counts)), weights.device, torch.int32)
    with kept_rng(weights.device):  # its draws are not the caller's
        x = torch.randn(sum(counts), weights.hidden, dtype=weights.dtype, device=weights.device)

    def step() -> None:
        forward_and_backward(x, counts, weights, strategy=strategy, offsets=ends)

    with torch.no_grad():
        step()  # warm-up (and kernel selection)
        return clock_for(weights.device).median(step, REPEATS)


def resolve_strategy(strategy: GemmStrategy, weights: ExpertWeights) -> str:
    """A concrete strategy for a validated ``strategy`` on these weights (their device)."""
    if strategy != "auto":
        return strategy
    if not isinstance(weights, ExpertWeights) or weights.device.type == "cpu" \
            or grouped_problem(weights.dtype, weights.device) is not None:
        return "loop"  # a module stage runs its own GEMMs; the CPU: see the module docstring
    chosen = device_state(full_device(weights.device)).gemm  # a measurement of the device
    key = (weights.packed, tuple(weights.down.shape), weights.dtype)
    if key not in chosen:
        plain = weights.detached()
        rows = ROWS_PER_EXPERT * weights.local_experts
        loop = _time_step(plain, "loop", rows)
        grouped = _time_step(plain, "grouped", rows)
        chosen[key] = "grouped" if grouped < loop * (1 - MIN_GAIN) else "loop"
    return chosen[key]
