"""Fixed-size slabs: the rows of capacity mode (:mod:`mc2.engine.decide.capacity`).

Every rank sends every rank the same number of rows, so the All-to-All takes no split sizes
(a :class:`~mc2.engine.transport.comm.FlatExchange` of ``None`` splits: equal slabs, the same
both ways), allocates nothing whose size depends on the data, and reads nothing back: what a
CUDA graph can capture. Small tables travel in the same bytes as the rows (:func:`pack`), so a
call needs no exchange of its own for them.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _padded(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def pack(rows: Tensor, table: Tensor) -> Tensor:
    """``rows [n, H]`` and a float64 ``table [n, w]`` as one ``[n, bytes]`` uint8 tensor (the
    rows' bytes padded to 8, so the table's floats stay aligned)."""
    width = _padded(rows.shape[1] * rows.element_size())
    out = torch.zeros(rows.shape[0], width + table.shape[1] * 8, dtype=torch.uint8,
                      device=rows.device)
    out[:, :rows.shape[1] * rows.element_size()] = rows.contiguous().view(torch.uint8)
    out[:, width:] = table.to(torch.float64).contiguous().view(torch.uint8)
    return out


def unpack(data: Tensor, hidden: int, dtype: torch.dtype, table_width: int
           ) -> tuple[Tensor, Tensor]:
    """:func:`pack` undone: ``(rows [n, H], table [n, w])`` (copies, contiguous)."""
    size = torch.empty((), dtype=dtype).element_size()
    width = _padded(hidden * size)
    rows = data[:, :hidden * size].contiguous().view(dtype)
    table = data[:, width:width + table_width * 8].contiguous().view(torch.float64)
    return rows, table
