"""``MC2Config``: every per-call policy of :func:`mc2.fused_expert`, in one frozen dataclass.

A policy is what a call *should do* (how many micro-batches, overlap or not, the All-to-All
layout, the wire format, the GEMM strategy, the deadline, the finiteness check); runtime objects
that a call *uses* (the process group, a planner, a workspace, a timeline) stay separate
arguments. Every entry point takes the same config (``fused_expert``, ``fused_expert_packed``,
:class:`mc2.MoELayer`, :func:`mc2.integrations.transformers.enable_mc2`, ``mc2 bench`` and
``mc2 train`` through :mod:`mc2.tools.config_args`), and keyword arguments of the same names
stay as a shorthand that builds one (:meth:`MC2Config.of`).

Validation happens here, once (:meth:`MC2Config.problem`). What needs the call's data (that
``wire_block`` divides the hidden size, that ``gemm="grouped"`` can serve the dtype) is checked
by the call, before its handshake. Every value that ranks must share is agreed in the
handshake, so a rank with another config raises ``ValueError`` on every rank.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

import torch

from mc2.engine.transport.wire import parse_wire_dtype, wire_names, wire_problem

MicroBatches = int | Literal["auto"]
WireDtype = torch.dtype | Literal["int8"] | None
Hierarchy = Literal["auto", "flat", "2d"]
GemmStrategy = Literal["auto", "grouped", "loop"]
HIERARCHIES = ("flat", "2d", "auto")
GEMMS = ("auto", "grouped", "loop")


class ConfigOptions(TypedDict, total=False):
    """The keyword shorthand of :class:`MC2Config` (``fused_expert(..., micro_batches=4)``)."""

    micro_batches: MicroBatches
    overlap: bool
    hierarchy: Hierarchy
    wire_dtype: WireDtype | str | tuple[WireDtype | str, WireDtype | str]
    wire_block: int
    gemm: GemmStrategy
    timeout: float | None
    check_finite: bool
    dedup: bool
    capacity: int | None
    overflow: Literal["raise", "drop"]


@dataclass(frozen=True)
class MC2Config:
    """How one :func:`mc2.fused_expert` call runs (every rank of the group passes the same).

    Attributes:
        micro_batches: K, the number of micro-batches the local tokens are split into; ``1``
            does not split; ``"auto"``: the planner chooses from a cost model measured on the
            group and the real calls' times (:mod:`mc2.engine.decide.planner`; K = 1 where splitting
            cannot pay).
        overlap: ``True`` issues asynchronous collectives so micro-batch ``i+1`` is dispatched
            and ``i-1`` combined while ``i`` computes (where the backend cannot, or
            ``MC2_FORCE_SYNC=1`` is set, the call falls back to synchronous collectives, warns
            with :class:`mc2.SyncFallbackWarning` and marks the timeline); ``False`` is the
            plain serial path (with ``"auto"``: K = 1).
        hierarchy: ``"flat"``: one All-to-All over the group; ``"2d"``: across nodes only
            between ranks of the same local rank, one message per node, then inside the node
            (:mod:`mc2.engine.transport.hierarchy`; needs the same number of ranks on every node);
            ``"auto"``: ``"2d"`` where the group spans several nodes of several ranks and the
            2-D exchange measured faster for this size. Results agree to rounding (the same
            rows meet the same experts; with ``dedup`` a token's experts on one node are summed
            there first, so the sums run in another order).
        wire_dtype: the format rows travel in (:mod:`mc2.engine.transport.wire`). ``None``: the compute
            dtype, bit for bit; ``torch.bfloat16`` / ``torch.float16``: a cast;
            ``torch.float8_e4m3fn`` / ``"int8"``: 1 byte per element plus a float32 scale per
            row and ``wire_block`` channels. A pair ``(dispatch, combine)`` gives each exchange
            its own format. Names (``"bf16"``, ``"fp8"``, ``"int8"``, ``"none"``) are accepted.
            The backward uses the same pair, straight-through.
        wire_block: channels per scale of the quantised formats (must divide the hidden size).
        gemm: ``"loop"`` (one GEMM per expert), ``"grouped"`` (``grouped_mm``) or ``"auto"``
            (measured once per shape and device, :mod:`mc2.engine.decide.gemm_strategy`).
        timeout: seconds any one wait of the call may take before :class:`mc2.CommTimeout`
            (``None``: ``MC2_TIMEOUT``, else the process group's own timeout; never more than
            that; ``0``: no deadline of mc2's own). See :mod:`mc2.engine.transport.deadline`.
        check_finite: raise ``ValueError`` on every rank when a token or routing weight holds
            NaN or Inf (one pass over ``x`` on the device, folded into the handshake; in
            capacity mode every call's handshake checks, a read of the device each call).
        dedup: a token travels once to each rank holding any of its experts, and that rank
            sums its experts' weighted outputs into one row back (:mod:`mc2.engine.decide.dedup`);
            ``False``: one row per (token, expert). Results agree to rounding.
        capacity: rows each rank sends each rank per call, fixed (``None``: sized to the
            data, read once per call). A call then reads nothing to the host, allocates
            nothing whose size depends on the data, and a small batch is two collectives: what
            a CUDA graph can capture (:mod:`mc2.engine.decide.capacity`). A token goes at most
            once to each rank, so ``capacity`` >= tokens per rank never overflows. Flat
            exchange, rows in the compute dtype; ``"auto"`` runs the planner's trials priced
            for full slabs and keeps K = 1 (two collectives of rows) unless a split measured faster.
        overflow: with ``capacity``, what rows that do not fit do: ``"raise"`` (counted on
            the device; :class:`mc2.CapacityOverflow` on every rank: on a CPU at the end of the
            call's forward, on an accelerator at the next handshake on the group or
            :func:`mc2.check_overflow`, :mod:`mc2.engine.decide.overflow`) or
            ``"drop"`` (left out and counted: :func:`mc2.engine.decide.capacity.dropped_rows`).
    """

    micro_batches: MicroBatches = "auto"
    overlap: bool = True
    hierarchy: Hierarchy = "flat"
    wire_dtype: Any = None
    wire_block: int = 128
    gemm: GemmStrategy = "auto"
    timeout: float | None = None
    check_finite: bool = False
    dedup: bool = False
    capacity: int | None = None
    overflow: str = "raise"

    def __post_init__(self) -> None:
        kinds = self.wire_dtype
        if isinstance(kinds, (tuple, list)):
            kinds = tuple(parse_wire_dtype(k) for k in kinds)
            if len(set(kinds)) == 1:  # one format both ways
                (kinds,) = set(kinds)
        else:
            kinds = parse_wire_dtype(kinds)
        object.__setattr__(self, "wire_dtype", kinds)
        if (problem := self.problem()) is not None:
            raise ValueError(f"MC2Config: {problem}")
        # the form a traced call carries it in (mc2.engine.autograd.operator): made here, not while
        # tracing, where json is not traceable
        object.__setattr__(self, "json", json.dumps(self.to_dict(), sort_keys=True))

    def problem(self) -> str | None:
        """What is wrong with these values, or ``None`` (the one place configs are checked)."""
        k = self.micro_batches
        if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            return f"micro_batches must be a positive int or 'auto', got {k!r}"
        for name in ("overlap", "check_finite", "dedup"):
            if not isinstance(getattr(self, name), bool):
                return f"{name} must be a bool, got {getattr(self, name)!r}"
        if self.hierarchy not in HIERARCHIES:
            return f"hierarchy must be 'auto', 'flat' or '2d', got {self.hierarchy!r}"
        if self.gemm not in GEMMS:
            return f"gemm must be 'auto', 'grouped' or 'loop', got {self.gemm!r}"
        t = self.timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or math.isnan(t)):
            return f"timeout must be a number of seconds or None, got {t!r}"
        if self.overflow not in ("raise", "drop"):  # a typo is an error with or without capacity
            return f"overflow must be 'raise' or 'drop', got {self.overflow!r}"
        c = self.capacity
        if c is not None:
            if isinstance(c, bool) or not isinstance(c, int) or c < 1:
                return f"capacity must be a positive int (rows per destination per call), got {c!r}"
            if isinstance(k, int) and k > c:
                return f"capacity ({c}) must be at least micro_batches ({k})"
            if self.hierarchy != "flat" or self.wire_dtype is not None:
                return ("capacity mode runs the flat exchange with rows in the compute dtype "
                        "(hierarchy='flat', wire_dtype=None)")
        return wire_problem(self.wire_dtype, self.wire_block, None)

    @classmethod
    def of(cls, config: "MC2Config | None" = None, **options: Any) -> "MC2Config":
        """``config`` (default: all defaults) with ``options`` replacing its fields.

        Raises:
            TypeError: an option that is not a field.
            ValueError: a value :meth:`problem` rejects.
        """
        if not options and (config is None or isinstance(config, MC2Config)):
            # first: the common cases, the ones torch.compile traces (no construction)
            return config if config is not None else DEFAULT
        unknown = set(options) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown mc2 option(s) {sorted(unknown)}; MC2Config has "
                            f"{[f.name for f in dataclasses.fields(cls)]}")
        if config is not None and not isinstance(config, MC2Config):
            raise TypeError(f"config must be an mc2.MC2Config, got {type(config).__name__}")
        base = config or cls()
        return dataclasses.replace(base, **options) if options else base

    def replace(self, **changes: Any) -> "MC2Config":
        """A copy with ``changes`` (validated)."""
        return MC2Config.of(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe fields (wire formats by name), for logs, configs and checkpoints."""
        out = dataclasses.asdict(self)
        out["wire_dtype"] = wire_names(self.wire_dtype)
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "MC2Config":
        """The inverse of :meth:`to_dict` (unknown keys raise ``TypeError``)."""
        values = dict(values)
        if isinstance(values.get("wire_dtype"), list):
            values["wire_dtype"] = tuple(values["wire_dtype"])
        return cls.of(**values)


DEFAULT = MC2Config()  # what a call without config or options runs with
