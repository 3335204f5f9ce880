"""The values every rank of a call must pass alike, by name.

The handshake (:func:`mc2.engine.decide.validation.agree`) reduces them in one ``all_reduce``
(each value and its negation, so one maximum gives both ends) and names the first that differs
in the error every rank raises. They travel as a flat vector, but nothing here or there is
positional: the vector is made from the fields in declaration order and read back by name, so
adding a field cannot shift the meaning of another (it once was a 19-name tuple zipped against a
19-value tuple and read back as ``highest[3:]``).

All are integers (codes for the enumerations), 0 where the call does not use the option. A
rank whose input is bad sends :meth:`SharedFacts.unknown` (all zeros): the handshake then raises
that rank's problem before comparing anything.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, field, fields
from typing import Any


def _fact(says: str) -> Any:
    """A shared value (0 where unused), and what an error calls it."""
    return field(default=0, metadata={"says": says})


@dataclass(frozen=True)
class SharedFacts:
    """One call's shared values; see the module docstring. The field's ``says`` metadata is
    what an error calls it."""

    micro_batches: int = _fact("micro_batches (0 means 'auto')")
    largest_k: int = _fact("the largest K (the planner's candidates)")
    hidden: int = _fact("hidden size")
    ffn: int = _fact("ffn size")
    local_experts: int = _fact("local experts")
    dtype: int = _fact("dtype")
    overlap: int = _fact("overlap")
    needs_grad: int = _fact("gradient mode")
    hierarchy: int = _fact("hierarchy")
    wire_dispatch: int = _fact("wire_dtype (dispatch)")
    wire_combine: int = _fact("wire_dtype (combine)")
    planner_calls: int = _fact(
        "the planner's calls on this group (a fresh planner on some ranks only)")
    exchange_measured: int = _fact(
        "the 2-D exchange's measurements on this group")
    dedup: int = _fact("dedup")
    capacity: int = _fact("capacity")
    overflow: int = _fact("overflow")
    gemm: int = _fact("gemm")
    timeout_ms: int = _fact("timeout (ms)")
    check_finite: int = _fact("check_finite")
    topk: int = _fact("topk (dedup and capacity mode send k-wide slot tables)")
    paired: int = _fact("pairing (forward_backward's overlap on some ranks only)")
    routing_grad: int = _fact("whether routing_weights need a gradient (dedup and capacity "
                              "mode send it back by tables every rank keeps alike)")

    @classmethod
    def unknown(cls) -> "SharedFacts":
        """What a rank whose input is bad sends: nothing is compared after its error."""
        return cls()

    def values(self) -> tuple[int, ...]:
        """The values in declaration order (the handshake's vector; a hashable key)."""
        return astuple(self)

    def described(self) -> dict[str, int]:
        """``{what an error calls the field: value}`` in declaration order."""
        return {f.metadata["says"]: getattr(self, f.name) for f in fields(self)}
