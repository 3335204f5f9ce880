"""Rows summed per index, as the reductions of rows sent once per destination need them.

Three places add rows into fewer rows: a rank sums its experts' outputs per received row
(:mod:`mc2.engine.passes.run`, :mod:`mc2.engine.passes.travel`), and the 2-D exchange's
forwarding rank sums the rows its node sends back per stage-1 row
(:mod:`mc2.engine.transport.hierarchy`). All sum 16-bit rows in float32, as a GEMM accumulates,
and round once at the end.
"""

from __future__ import annotations

import torch
from torch import Tensor


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where rows are summed: float32 for 16-bit rows, else their own dtype."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def sum_rows(values: Tensor, index: Tensor, size: int, *, scale: Tensor | None = None,
             keep: Tensor | None = None) -> Tensor:
    """``out[index[j]] += values[j] * scale[j]`` over ``size`` rows, in ``values``' dtype.

    ``keep``: ``[n, 1]`` bool, rows counted (the others count 0 whatever they hold, NaN
    included).
    """
    acc = accumulation_dtype(values.dtype)
    terms = (values if keep is None else torch.where(keep, values, 0)).to(acc)
    if scale is not None:
        terms = terms * scale.to(acc).unsqueeze(1)
    out = torch.zeros((size,) + tuple(values.shape[1:]), dtype=acc, device=values.device)
    out.index_add_(0, index, terms)
    return out if acc == values.dtype else out.to(values.dtype)
