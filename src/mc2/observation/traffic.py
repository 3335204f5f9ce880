"""Count what a call puts on the wire: rows and bytes per destination, per call.

Usage::

    with mc2.count_traffic() as traffic:
        out = mc2.fused_expert(...)
    traffic.pairs, traffic.rows_sent, traffic.rows_across_nodes(node_of_rank, rank)

Why a counter and not a formula: where rows travel once per destination (``dedup=True``) the
rows a call sends depend on the routing, and the saving is claimed against
:func:`mc2.engine.decide.dedup.expected_destinations`; the counter reports what the exchanges
were actually sized for (the forward's dispatch; the combine and the backward's two exchanges
move the same rows back and forth). Host integers only: it reads nothing from the device.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Iterator

_ACTIVE: contextvars.ContextVar["Traffic | None"] = contextvars.ContextVar(
    "mc2_active_traffic", default=None)


@dataclass
class Traffic:
    """Totals over the calls made while active (this rank's view).

    Attributes:
        calls: fused calls counted.
        pairs: (token, expert) pairs routed.
        rows_sent: rows the forward's dispatch sent to each rank of the group (this rank
            included: those never leave it).
        row_bytes: bytes of one row as the dispatch encodes it (the last call's).
        node_rows: with the 2-D exchange, rows sent to each node in its first stage (this
            node included); empty for a flat exchange.
    """

    calls: int = 0
    pairs: int = 0
    rows_sent: list[int] = field(default_factory=list)
    row_bytes: int = 0
    node_rows: list[int] = field(default_factory=list)

    def add(self, *, pairs: int, rows_sent: list[int], row_bytes: int,
            node_rows: list[int] | None = None) -> None:
        self.calls += 1
        self.pairs += pairs
        self.rows_sent = _summed(self.rows_sent, rows_sent)
        self.row_bytes = row_bytes
        if node_rows is not None:
            self.node_rows = _summed(self.node_rows, node_rows)

    @property
    def rows(self) -> int:
        """Rows dispatched, to every destination."""
        return sum(self.rows_sent)

    def rows_across_nodes(self, node_of_rank: list[int], rank: int) -> int:
        """Rows that crossed to another node: the 2-D exchange's first stage where it ran,
        else the flat exchange's rows to ranks of other nodes."""
        node = node_of_rank[rank]
        if self.node_rows:
            return sum(n for i, n in enumerate(self.node_rows) if i != node)
        return sum(n for r, n in enumerate(self.rows_sent) if node_of_rank[r] != node)


def _summed(a: list[int], b: list[int]) -> list[int]:
    return [x + y for x, y in zip_longest(a, b, fillvalue=0)]


@contextmanager
def count_traffic() -> Iterator[Traffic]:
    """Count every fused call made inside the block (see the module docstring)."""
    traffic = Traffic()
    token = _ACTIVE.set(traffic)
    try:
        yield traffic
    finally:
        _ACTIVE.reset(token)


def active_traffic() -> Traffic | None:
    """The counter of the enclosing :func:`count_traffic`, if any."""
    return _ACTIVE.get()
