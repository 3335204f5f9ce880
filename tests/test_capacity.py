"""Capacity mode (``MC2Config(capacity=N)``): no host read, fixed sizes, two collectives.

Against the dense reference in real Gloo worlds of 2 and 4 ranks (every hostile routing, K
that does not divide the tokens, overlapped and serial, float64/float32/bfloat16, both
layouts, shared experts, a module stage); overflow raised on every rank, or dropped and
counted with the result equal to the reference without the dropped rows; and a small no-grad
call is two collectives and no host read.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import mc2
from tests.problems import DEDUP_ROUTINGS, make_problem
from tests.reference import dense_moe
from tests.test_fused_expert_distributed import assert_ranks_match
from tests.workers import capacity_collectives, capacity_overflow, run_cases

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _cases(world: int) -> list[tuple[str, object, dict]]:
    cases = []
    for r, k, o in itertools.product(DEDUP_ROUTINGS, (1, 3), (True, False)):
        p = make_problem(world, r, topk=3 if r == "same_rank" else 2, seed=len(r))
        cap = max(3, max(len(x) for x in p.xs))
        cases.append((f"{r} K{k} {'overlap' if o else 'serial'}", p,
                      {"micro_batches": k, "overlap": o, "capacity": cap}))
    for dtype, layout in ((torch.float32, "packed"), (torch.bfloat16, "split")):
        p = make_problem(world, "uniform", dtype=dtype, seed=2)
        cases.append((f"uniform {dtype} {layout}", p,
                      {"micro_batches": 2, "capacity": 64, "layout": layout}))
    p = make_problem(world, "uneven", dtype=torch.float32, seed=4)
    cases.append(("uneven float32 auto", p, {"micro_batches": "auto", "capacity": 64}))
    return cases


@pytest.fixture(scope="module", params=(2, 4))
def world(request):
    n = request.param
    cases = _cases(n)
    return n, cases, mc2.run_local(run_cases, n, args=([(p, o) for _, p, o in cases],),
                                   deadline_s=300)


def test_equals_the_dense_reference(world) -> None:
    _, cases, results = world
    for i, (name, problem, _) in enumerate(cases):
        assert_ranks_match([r[i] for r in results], problem, name, TOLERANCE)


def _kept(problem, capacity: int) -> list[torch.Tensor]:
    """Each rank's routing weights with the (token, rank) rows that do not fit zeroed: the
    first ``capacity`` tokens (in order) with an expert on a rank fit in its slab."""
    kept = []
    L = problem.local_experts
    for ids, rw in zip(problem.ids, problem.rws):
        rw = rw.clone()
        seen = [0] * problem.world
        for t, row in enumerate(ids.tolist()):
            for d in sorted({e // L for e in row}):
                seen[d] += 1
                if seen[d] > capacity:
                    rw[t] = torch.where(ids[t] // L == d, 0.0, rw[t])
        kept.append(rw)
    return kept


def test_overflow_raises_on_every_rank_or_drops_and_counts() -> None:
    p = make_problem(2, "one_expert", tokens=9, seed=3)  # every token to rank 0's experts
    results = mc2.run_local(capacity_overflow, 2, args=(p, 4), deadline_s=120)
    kept = _kept(p, 4)
    dropped = sum(int(((rw == 0) & (r != 0)).any(1).sum()) for rw, r in zip(kept, p.rws))
    assert dropped > 0
    L = p.local_experts
    for rank, r in enumerate(results):
        # counted on the device, raised where the host reads anyway: never a device assert
        assert r["device_asserts"] == 0, r["device_asserts"]
        # on a CPU the overflowing call raises at the end of its forward, and only once
        assert r["raised_at_once"] is not None and "capacity" in r["raised_at_once"], r
        assert r["after_at_once"] is None, r["after_at_once"]
        # as on an accelerator: no raise in the call; the next point the host reads raises
        assert r["raised_in_call"] is None, r["raised_in_call"]
        for point in ("raised", "raised_by_next_call"):  # mc2.check_overflow(), a handshake
            assert r[point] is not None and "capacity" in r[point], (rank, point, r[point])
            assert "overflow='drop'" in r[point] and f" {dropped} (token, rank) rows" in \
                r[point], (dropped, r[point])
        assert r["raised_again"] is None and r["next_call_after"] is None, r  # raised once
        assert r["raised_after_drop"] is None, r["raised_after_drop"]  # dropped, counted
        x = p.xs[rank].clone().requires_grad_(True)
        want = dense_moe(x, p.w_up, p.w_gate, p.w_down, p.ids[rank], kept[rank])
        want.backward(p.grad_outs[rank])
        torch.testing.assert_close(r["out"], want.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(r["x"], x.grad, rtol=0, atol=1e-12)
        assert r["dropped"] == int(((kept[rank] == 0) & (p.rws[rank] != 0)).any(1).sum())
        assert r["fits"] is not None
    assert L == 2


def test_a_small_no_grad_call_is_three_collectives_and_no_read() -> None:
    """The trusted handshake (host memory: nothing read from a device, nothing uploaded), the
    dispatch and the combine. The same call without capacity is three collectives too, with
    one read: its ids travel in the handshake, which counts its routes (no counts exchange)."""
    p = make_problem(2, "uniform", tokens=4, seed=1)
    for r in mc2.run_local(capacity_collectives, 2, args=(p,), deadline_s=120):
        assert (r["collectives"], r["reads"], r["uploads"]) == (3, 0, 0), r
        assert (r["plain_collectives"], r["plain_reads"]) == (3, 1), r  # handshake, dispatch, combine


@pytest.mark.parametrize("options,message", [
    ({"capacity": 0}, "capacity must be a positive int"),
    ({"capacity": 4, "overflow": "clip"}, "overflow must be"),
    ({"capacity": 2, "micro_batches": 4}, "at least micro_batches"),
    ({"capacity": 8, "hierarchy": "2d"}, "flat exchange"),
    ({"capacity": 8, "wire_dtype": "fp8"}, "flat exchange"),
])
def test_bad_capacity_settings(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mc2.MC2Config(**options)


def test_no_more_tokens_than_capacity_never_overflows_at_any_k() -> None:
    """Every token of a rank with ``T <= N`` tokens gets a slab row at every K (split by the
    slabs, not by the tokens: a micro-batch of 297 tokens split in 16 holds 20 where the slab
    of 298 holds 19), and each (token, destination) row appears exactly once."""
    from mc2.engine.decide.capacity import plan_routes

    g = torch.Generator().manual_seed(0)
    world, local, topk = 4, 2, 3
    for capacity, tokens, k in ((298, 297, 16), (37, 37, 5), (64, 3, 8), (9, 9, 9), (20, 0, 3)):
        ids = torch.rand(tokens, world * local, generator=g).topk(topk, -1).indices
        ids[:, 0] = 0  # every token to rank 0: its slab is full
        ids[: tokens // 2] = ids[: tokens // 2] % local  # half the tokens: rank 0 only
        handle = plan_routes(ids, torch.ones(tokens, topk), capacity=capacity,
                             micro_batches=k, world=world, local_experts=local, group=None,
                             style=None, overflow="raise")
        sent = torch.cat([r.slot_token for r in handle.micro_batches])
        dest = torch.cat([torch.arange(world).repeat_interleave(r.slot_token.numel() // world)
                          for r in handle.micro_batches])
        rows = {(t, d) for t, d in zip(sent.tolist(), dest.tolist()) if t < tokens}
        want = {(t, e // local) for t, row in enumerate(ids.tolist()) for e in row}
        assert rows == want, (capacity, tokens, k)
        assert len(rows) == int((sent < tokens).sum())  # once each
        errors = handle.micro_batches[0].tables[0, 2 * topk:2 * topk + 2]
        assert errors.tolist() == [0.0, 0.0], (capacity, tokens, k)


def test_the_overflow_counters_are_ordered_across_streams(monkeypatch) -> None:
    """On an accelerator the counters' adds, reads and resets run on whatever stream is
    current: capacity calls on a side stream, the handshake or ``check_overflow`` on another.
    Each waits for the stream of the one before (fake streams record the waits); nothing waits
    inside a capture, whose stream waited for the work before it when the capture began."""
    from mc2.engine.decide import overflow

    class Stream:
        def __init__(self, name: str) -> None:
            self.name, self.waited = name, []

        def wait_stream(self, other: "Stream") -> None:
            self.waited.append(other.name)

    side, main, graph = Stream("side"), Stream("main"), Stream("graph")
    now, capturing = [side], [False]
    monkeypatch.setattr(overflow, "current_stream", lambda device: now[0])
    monkeypatch.setattr(overflow, "capturing", lambda device: capturing[0])
    group = object()
    overflow.add_errors(group, torch.tensor([2.0, 0.0, 0.0]), overflow="raise", capacity=4)
    overflow.add_errors(group, torch.tensor([1.0, 0.0, 0.0]), overflow="raise", capacity=4)
    assert side.waited == []  # one stream: nothing to wait for
    now[0] = main
    assert overflow.pending(group, torch.device("cpu")).tolist() == [3, 0, 0]
    assert main.waited == ["side"]  # the handshake's read waits for the side stream's adds
    now[0], capturing[0] = graph, True
    overflow.add_errors(group, torch.tensor([0.0, 1.0, 0.0]), overflow="raise", capacity=4)
    assert graph.waited == []  # inside a capture: no wait
    now[0], capturing[0] = main, False
    with pytest.raises(overflow.CapacityOverflow):
        overflow.raise_counted(group, 3, 1)
    assert main.waited == ["side", "graph"]  # the reset waits for the captured add's stream


def test_dropped_rows_finds_a_devices_count_by_its_type_or_by_default(monkeypatch) -> None:
    """A call on a GPU counts its drops under its rows' device, ``cuda:0``: the default
    lookup (the current accelerator) and ``"cuda"`` find them there (an accelerator
    emulated; before, both made a new zero under another key, and drops went unseen)."""
    from mc2.engine.decide.capacity import DroppedRows, dropped_rows
    from mc2.engine.transport.group_state import group_state

    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda check_available=False: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    counts = group_state(None).of(DroppedRows)
    counted = counts[torch.device("cuda", 0)] = torch.tensor(5)  # what the call added
    try:
        assert dropped_rows() is counted and dropped_rows("cuda") is counted
        assert dropped_rows("cuda:0", None) is counted
    finally:
        counts.pop(torch.device("cuda", 0))
