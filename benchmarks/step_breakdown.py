"""Where one training step's time goes, pass by pass, from mc2's own spans.

Used by ``model_overlap.py --breakdown``. For each pass of a step (the forward from the step's
start to the loss, the backward from there to the end) on one rank:

- ``wall_s``: the pass's length;
- ``waits_s``: the host blocked waiting for rows that had not arrived (``wait`` spans): the
  communication the schedule left exposed;
- ``blocking_s``: collectives the host ran synchronously (``comm`` spans: the handshake, the
  counts, a synchronous exchange);
- ``moe_s``: mc2's compute (experts, gathers, scatters, the weighted sum, weight gradients);
- ``other_s``: the rest of the pass, outside every mc2 span: attention, norms, router,
  embedding, head and loss, and Python between them;
- ``link_busy_s``: when at least one asynchronous transfer was in flight (``transfer`` spans,
  from issue to completion; a synchronous exchange is a ``comm`` span instead),
  ``link_idle_s`` the rest: the time a schedule could still have filled;
- ``exposed``: each wait by name, micro-batch and order in the pass (the i-th call of the pass
  is a layer: forward bottom to top, backward top to bottom), longest first.

All lengths are unions of intervals (overlapping spans counted once).
"""

from __future__ import annotations

from typing import Any, Sequence

from mc2.observation.profiler import union_length as union


def _clipped(spans: Sequence[Any], a: float, b: float) -> list[tuple[float, float]]:
    return [(max(s.start, a), min(s.end, b)) for s in spans if s.end > a and s.start < b]


def pass_breakdown(spans: Sequence[Any], start: float, end: float) -> dict[str, Any]:
    """The breakdown of the pass between ``start`` and ``end`` (host seconds)."""
    inside = [s for s in spans if s.end > start and s.start < end and s.kind != "step"]
    kinds = {kind: _clipped([s for s in inside if s.kind == kind], start, end)
             for kind in ("wait", "comm", "compute", "transfer")}
    host = kinds["wait"] + kinds["comm"] + kinds["compute"]
    wall = end - start
    busy = union(kinds["transfer"])
    calls: dict[tuple[str, int], int] = {}  # (name, micro-batch) -> calls seen: the layer order
    exposed = []
    for s in sorted((s for s in inside if s.kind == "wait"), key=lambda s: s.start):
        key = (s.name, s.micro_batch)
        calls[key] = calls.get(key, -1) + 1
        exposed.append({"name": s.name, "micro_batch": s.micro_batch,
                        "call": calls.get(key, 0), "at_s": s.start - start,
                        "seconds": s.end - s.start})
    exposed.sort(key=lambda e: -e["seconds"])
    return {"wall_s": wall, "waits_s": union(kinds["wait"]), "blocking_s": union(kinds["comm"]),
            "moe_s": union(kinds["compute"]), "other_s": wall - union(host),
            "link_busy_s": busy, "link_idle_s": wall - busy, "exposed": exposed[:8]}


def step_breakdown(spans: Sequence[Any], start: float, middle: float, end: float
                   ) -> dict[str, Any]:
    """Both passes of one step (``middle``: where the forward ended)."""
    return {"forward": pass_breakdown(spans, start, middle),
            "backward": pass_breakdown(spans, middle, end)}


FIELDS = ("wall_s", "waits_s", "blocking_s", "moe_s", "other_s", "link_busy_s", "link_idle_s")


def print_breakdown(mode: str, per_rank: Sequence[Sequence[dict[str, Any]]]) -> None:
    """The median step's breakdown of each rank, pass by pass, and its longest waits."""
    import statistics

    for rank, steps in enumerate(per_rank):
        for phase in ("forward", "backward"):
            values = {f: statistics.median(s[phase][f] for s in steps) for f in FIELDS}
            print(f"  {mode:<6} rank {rank} {phase:<8} " + "  ".join(
                f"{f[:-2]} {values[f]:.2f}" for f in FIELDS))
            last = steps[-1][phase]["exposed"][:3]
            if last:
                print("      longest waits (last step): " + "; ".join(
                    f"{e['name']} mb{e['micro_batch']} call {e['call']} {e['seconds']:.2f} s "
                    f"at {e['at_s']:.2f}" for e in last))
