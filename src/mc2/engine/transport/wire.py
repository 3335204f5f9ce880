"""Formats rows travel in: fewer bytes on the wire, compute in the compute dtype.

Where communication is longer than the compute, overlap can at best bring a step down to the
communication time; only fewer bytes help then. A :class:`WireFormat` turns the rows of one
exchange into bytes before they leave and back into compute-dtype rows after they arrive:

- ``None``: rows travel as they are (``x.dtype``), bit for bit; no conversion at all.
- ``torch.bfloat16`` / ``torch.float16``: a plain cast (2 bytes per element).
- ``torch.float8_e4m3fn`` / ``"int8"``: 1 byte per element, plus one float32 scale per row and
  per block of ``block`` channels (128 by default, as DeepEP). The scale maps the block's
  largest magnitude onto the format's largest value, so a row with a large dynamic range loses
  precision only in its own blocks. A block of zeros gets scale 1 (never 0/0).

Every encoded row is a row of bytes (``uint8 [n, bytes_per_row]``): the scales sit right after
the values in the same row, so they travel in the same All-to-All, and any backend that moves
bytes moves every format (Gloo has no float8 type).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from mc2.engine.transport.workspace import Workspace

FP8 = torch.float8_e4m3fn
_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "fp8": FP8, "float8_e4m3fn": FP8, "e4m3": FP8,
          "int8": "int8", "none": None, "fp32": None, "float32": None}
_CODES = {None: 0, torch.bfloat16: 1, torch.float16: 2, FP8: 3, "int8": 4}
_MAX = {FP8: 448.0, "int8": 127.0}


@dataclass(frozen=True)
class WireFormat:
    """How one direction's rows travel.

    Attributes:
        kind: ``None`` (as they are), a cast dtype, ``torch.float8_e4m3fn`` or ``"int8"``.
        block: channels per scale for the quantised kinds.
    """

    kind: Any = None
    block: int = 128

    @property
    def quantised(self) -> bool:
        return self.kind in _MAX

    @property
    def code(self) -> int:
        """A small integer that names the format, for the ranks' handshake."""
        return _CODES[self.kind] * 100_000 + (self.block if self.quantised else 0)

    def bytes_per_row(self, hidden: int, dtype: torch.dtype) -> int:
        """Bytes one row of ``hidden`` channels takes on the wire."""
        if self.kind is None:
            return hidden * dtype.itemsize
        if not self.quantised:
            return hidden * self.kind.itemsize
        return hidden + 4 * (hidden // self.block)

    def describe(self) -> str:
        if self.kind is None:
            return "compute dtype"
        if self.quantised:
            name = "fp8 e4m3" if self.kind == FP8 else "int8"
            return f"{name} + fp32 scale per {self.block} channels"
        return str(self.kind).replace("torch.", "")

    def encode(self, rows: Tensor, workspace: Workspace | None = None) -> Tensor:
        """``rows [n, H]`` (compute dtype) -> what travels (``rows`` itself for ``None``).

        Every buffer, temporaries included, comes from ``workspace``: on a CPU the page faults
        of fresh allocations cost more than the arithmetic.
        """
        if self.kind is None:
            return rows
        ws = workspace or Workspace.transient()
        n, hidden = rows.shape
        out = ws.empty((n, self.bytes_per_row(hidden, rows.dtype)), torch.uint8, rows.device)
        if not self.quantised:
            out.view(self.kind).copy_(rows)
            return out
        nb = hidden // self.block
        blocks = rows.reshape(n, nb, self.block)
        # scales and the division in float32 whatever the compute dtype: in float16 the
        # reciprocal of a small block's scale overflows, and zeros would become NaN
        work = ws.empty((n, nb, self.block), _codec_dtype(rows.dtype), rows.device)
        if work.dtype == rows.dtype:
            torch.abs(blocks, out=work)
        else:
            work.copy_(blocks).abs_()
        amax = torch.amax(work, -1, keepdim=True).float()
        # a block of zeros gets scale 1, never 0/0; a block holding NaN or Inf a non-finite
        # scale, so that it arrives non-finite (a scale of 1 for a NaN maximum made int8
        # deliver finite values: NaN casts to 0); a scale no smaller than float32's smallest
        # normal, whose reciprocal is finite (below it, a block whose maximum is under ~1e-36
        # got an infinite reciprocal: its zeros became NaN, its values ±amax); scales travel
        # as float32
        scale = torch.where(amax == 0, torch.ones_like(amax), amax / _MAX[self.kind]) \
            .clamp_min_(torch.finfo(torch.float32).tiny)
        torch.mul(blocks, scale.reciprocal(), out=work)
        values = out[:, :hidden].view(torch.int8 if self.kind == "int8" else FP8)
        if self.kind == "int8":
            work.round_()
        work.clamp_(-_MAX[self.kind], _MAX[self.kind])  # above 448 e4m3fn has only NaN
        values.view(n, nb, self.block).copy_(work)
        out[:, hidden:].view(torch.float32).copy_(scale.view(n, nb))
        return out

    def decode(self, data: Tensor, hidden: int, dtype: torch.dtype,
               workspace: Workspace | None = None) -> Tensor:
        """What arrived -> ``[n, hidden]`` rows in ``dtype``."""
        if self.kind is None:
            return data
        ws = workspace or Workspace.transient()
        n = data.shape[0]
        rows = ws.empty((n, hidden), dtype, data.device)
        if not self.quantised:
            return rows.copy_(data.view(self.kind))
        nb = hidden // self.block
        values = data[:, :hidden]
        scale = data[:, hidden:].contiguous().view(torch.float32).view(n, nb, 1)
        wide = _codec_dtype(dtype)  # rescale in float32 (a float16 product can underflow)
        work = rows if wide == dtype else ws.empty((n, hidden), wide, data.device)
        if self.kind == "int8":
            work.copy_(values.view(torch.int8))
        else:
            _fp8_to(work, values, ws)
        work.view(n, nb, self.block).mul_(scale)
        if work is not rows:
            rows.copy_(work)
        return rows


def _codec_dtype(dtype: torch.dtype) -> torch.dtype:
    """What quantised rows are scaled in: float32 for the 2-byte types, else the dtype."""
    return torch.float32 if dtype.itemsize < 4 else dtype


_FP8_TABLES: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def _fp8_to(rows: Tensor, values: Tensor, ws: Workspace) -> None:
    """Write e4m3fn bytes ``values`` into ``rows`` as their values.

    A 256-entry table of every byte's value (PyTorch's own conversion, so exact, subnormals
    included and NaN for the NaN encodings, which encode never produces) and one gather through
    int32 indices: at 8,192 x 1,024 on one core 9 ms, against about 30 ms for PyTorch's
    float8 -> float conversion and 22 ms for bit shifts into bfloat16 (which also needed the
    scale times 2^120, overflowing float32 for blocks past ~57,000).
    """
    key = (rows.dtype, rows.device)
    if key not in _FP8_TABLES:
        _FP8_TABLES[key] = torch.arange(256, dtype=torch.uint8, device=rows.device).view(
            FP8).to(rows.dtype)
    index = ws.empty(tuple(values.shape), torch.int32, values.device)
    index.copy_(values)
    torch.index_select(_FP8_TABLES[key], 0, index.view(-1), out=rows.view(-1))


NONE = WireFormat()


def parse_wire_dtype(value: Any) -> Any:
    """A format name (``"bf16"``, ``"fp8"``, ``"int8"``, ``"none"``) or dtype -> the kind."""
    if isinstance(value, str):
        key = value.strip().lower()
        if key not in _NAMES:
            raise ValueError(f"unknown wire format {value!r}; use one of none, bf16, fp16, fp8, "
                             "int8")
        return _NAMES[key]
    return value


def wire_problem(wire_dtype: Any, block: int, hidden: int | None) -> str | None:
    """What is wrong with a ``wire_dtype`` argument, or ``None`` (``hidden=None``: the block's
    fit to the hidden size is checked later, by the call)."""
    kinds = wire_dtype if isinstance(wire_dtype, tuple) else (wire_dtype,)
    if isinstance(wire_dtype, tuple) and len(wire_dtype) != 2:
        return f"wire_dtype as a tuple must be (dispatch, combine), got {wire_dtype!r}"
    for kind in kinds:
        if not _known(kind):
            return (f"wire_dtype must be None, torch.bfloat16, torch.float16, "
                    f"torch.float8_e4m3fn or 'int8', got {kind!r}")
        if kind in _MAX:
            if isinstance(block, bool) or not isinstance(block, int) or block < 1:
                return f"wire_block must be a positive int, got {block!r}"
            if hidden is not None and hidden % block:
                return (f"wire_block {block} must divide the hidden size {hidden} "
                        f"(scales are per block of channels)")
    return None


class WirePair(NamedTuple):
    """The formats of a call's two exchanges, by name: ``dispatch`` (rows out to the experts;
    in a backward, the output gradients out) and ``combine`` (rows back; in a backward, the
    input gradients back). A pass indexes it by direction (0: dispatch, 1: combine)."""

    dispatch: WireFormat
    combine: WireFormat


PLAIN_PAIR = WirePair(NONE, NONE)
"""Rows in the compute dtype both ways."""


def wire_pair(wire_dtype: Any, block: int = 128) -> WirePair:
    """The :class:`WirePair` of a validated ``wire_dtype`` (one format both ways, or a
    ``(dispatch, combine)`` pair)."""
    dispatch, combine = wire_dtype if isinstance(wire_dtype, tuple) else (wire_dtype, wire_dtype)
    return WirePair(WireFormat(dispatch, block), WireFormat(combine, block))


def _known(kind: Any) -> bool:
    try:
        return kind in _CODES
    except TypeError:  # unhashable
        return False


_SHORT = {None: "none", torch.bfloat16: "bf16", torch.float16: "fp16", FP8: "fp8", "int8": "int8"}


def wire_names(wire_dtype: Any) -> Any:
    """A validated ``wire_dtype`` by name (``"bf16"``, or a pair ``["fp8", "bf16"]``), JSON-safe;
    :func:`parse_wire_dtype` reads the names back."""
    return [_SHORT[k] for k in wire_dtype] if isinstance(wire_dtype, tuple) else _SHORT[wire_dtype]


def describe_pair(wire: WirePair) -> str:
    """``"fp8 ..."`` for one format both ways, ``"dispatch X, combine Y"`` for a pair."""
    return wire.dispatch.describe() if wire.dispatch == wire.combine else \
        f"dispatch {wire.dispatch.describe()}, combine {wire.combine.describe()}"
