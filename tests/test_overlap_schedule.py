"""The overlap is real: while micro-batch i's experts compute, micro-batch i+1's dispatch is
in flight (issued, not yet waited for), and micro-batch i-1's combine too.

Every other test compares results, which a schedule that ran the micro-batches one after the
other would get just as right. Here each rank of a real Gloo world records when its transport
issued each exchange and when the schedule waited for it (``tests/workers_schedule.py``), and
:func:`overlap_problems` checks the order against the experts' spans: forward and backward, the
flat exchange, rows once per destination (``dedup``), and the 2-D exchange on 4 ranks shown as
2 nodes of 2. The checker is itself checked: on the serial schedule (``overlap=False``) it must
find every pair not overlapped, and on the overlapped schedule with every exchange issued
blocking (``async_op=False`` forced at the transport) every pair issued blocking.
"""

from __future__ import annotations

import pytest
import torch

import mc2
from tests.problems import make_problem
from tests.workers_schedule import Exchange, Experts, record_schedules

K = 3
PHASES = ("forward", "backward")


def overlap_problems(exchanges: list[Exchange], experts: list[Experts], k: int) -> list[str]:
    """What is *not* overlapped in one call's schedule, as sentences (empty: all of it is).

    For each phase and each ``i < k - 1``: ``dispatch(i+1)`` must have been issued before
    ``experts(i)`` started and waited for only after it ended; ``combine(i)`` likewise around
    ``experts(i+1)``; and each of them issued asynchronously. Also a problem: a transfer
    missing, recorded twice, or never reported complete (the record would prove nothing)."""
    problems = []
    found = {(e.phase, e.name, e.micro_batch): e for e in exchanges}
    if len(found) != len(exchanges):
        problems.append(f"an exchange recorded twice: {sorted(found)}")
    ran = {(s.phase, s.micro_batch): s for s in experts}
    for phase in PHASES:
        for i in range(k):
            for name in ("dispatch", "combine"):
                e = found.get((phase, name, i))
                if e is None:
                    problems.append(f"{phase}: {name}({i}) never waited for")
                elif e.completed is None:
                    problems.append(f"{phase}: {name}({i}) never reported complete")
            if (phase, i) not in ran:
                problems.append(f"{phase}: experts({i}) never ran")
        for i in range(k - 1):
            pairs = (("dispatch", i + 1, i), ("combine", i, i + 1))
            for name, moving, computing in pairs:
                e, s = found.get((phase, name, moving)), ran.get((phase, computing))
                if e is None or s is None:
                    continue
                if not e.asynchronous:
                    problems.append(f"{phase}: {name}({moving}) issued blocking: done before "
                                    f"experts({computing}) ran, nothing overlapped")
                if not e.issued <= s.start < s.end <= e.waited:
                    problems.append(
                        f"{phase}: {name}({moving}) not overlapped with experts({computing}): "
                        f"issued at {e.issued:.6f}, waited at {e.waited:.6f}, experts ran "
                        f"{s.start:.6f}..{s.end:.6f}")
    return problems


def _cases(world: int) -> list[tuple[str, dict]]:
    hierarchy = "2d" if world == 4 else "flat"
    return [(f"{hierarchy} overlapped", {"hierarchy": hierarchy}),
            (f"{hierarchy} dedup overlapped", {"hierarchy": hierarchy, "dedup": True}),
            (f"{hierarchy} serial", {"hierarchy": hierarchy, "overlap": False}),
            (f"{hierarchy} blocking issues", {"hierarchy": hierarchy, "blocking_issues": True}),
            (f"{hierarchy} dedup blocking issues", {"hierarchy": hierarchy, "dedup": True,
                                                    "blocking_issues": True})]


@pytest.fixture(scope="module", params=(2, 4), ids=("2 ranks", "2 nodes x 2"))
def world(request) -> tuple[int, list[tuple[str, dict]], list[list[dict]]]:
    n = request.param
    cases = _cases(n)
    problem = make_problem(n, "uniform", tokens=13)
    results = mc2.run_local(record_schedules, n, args=([(problem, {**o, "micro_batches": K})
                                                        for _, o in cases],),
                            ranks_per_node=2, timeout_s=120)
    return n, cases, results


@pytest.mark.parametrize("case", range(5), ids=("overlapped", "dedup overlapped", "serial",
                                                 "blocking issues", "dedup blocking issues"))
def test_the_next_dispatch_travels_while_the_experts_compute(world, case: int) -> None:
    n, cases, results = world
    name, options = cases[case]
    for rank, per_case in enumerate(results):
        got = per_case[case]
        assert {e.via for e in got["exchanges"]} == \
            {"TwoStageExchange" if n == 4 else "FlatExchange"}, (name, rank)
        problems = overlap_problems(got["exchanges"], got["experts"], K)
        if options.get("blocking_issues"):  # the overlapped schedule, every issue blocking:
            # the checker must refuse every pair, both phases
            blocked = [p for p in problems if "issued blocking" in p]
            assert len(blocked) == len(problems) == len(PHASES) * 2 * (K - 1), \
                (name, rank, problems)
        elif options.get("overlap", True):
            assert got["fell_back"] is None, (name, rank)
            assert problems == [], (name, rank)
        else:  # the checker must see through a serial schedule: every pair, both phases,
            # in the order of its steps and in the way it issued them
            pairs = len(PHASES) * 2 * (K - 1)
            overlapped = [p for p in problems if "not overlapped" in p]
            blocked = [p for p in problems if "issued blocking" in p]
            assert len(overlapped) == len(blocked) == pairs and len(problems) == 2 * pairs, \
                (name, rank, problems)


def test_on_a_stream_backend_the_transfers_overlap_too() -> None:
    """The stream-backend path (NCCL, HCCL; here the emulated one,
    :mod:`tests.fake_stream_backend`, whose waits are watched by the watchdog instead of
    timed on the host): the same overlap, flat and once per destination; and with every
    exchange issued blocking the checker refuses every pair there too."""
    from tests import fake_stream_backend

    problem = make_problem(2, "uniform", tokens=13)
    cases = [{}, {"dedup": True}, {"blocking_issues": True}]
    results = mc2.run_local(
        record_schedules, 2,
        args=([(problem, {**o, "micro_batches": K, "emulated_stream": True}) for o in cases],),
        backend=fake_stream_backend.NAME, before_init=fake_stream_backend.install,
        timeout_s=120)
    for rank, (plain, dedup, blocking) in enumerate(results):
        for name, got in (("overlapped", plain), ("dedup overlapped", dedup)):
            assert got["fell_back"] is None, (name, rank)
            assert overlap_problems(got["exchanges"], got["experts"], K) == [], (name, rank)
        problems = overlap_problems(blocking["exchanges"], blocking["experts"], K)
        blocked = [p for p in problems if "issued blocking" in p]
        assert len(blocked) == len(problems) == len(PHASES) * 2 * (K - 1), (rank, problems)


def test_shared_experts_run_under_the_fill_and_the_drain() -> None:
    """The shared experts' forward in two parts, one while the first dispatch travels (issued
    before, waited for after), the other while the last combine travels; their backward while
    the first gradient dispatch travels (its drain carries the routed weight gradients). In
    the serial schedule, which has neither, the same parts with no transfer around them."""
    problem = make_problem(2, "uniform", tokens=13)
    g = torch.Generator().manual_seed(4)
    hidden = problem.xs[0].shape[-1]
    shared = [torch.randn(1, hidden, 8, generator=g, dtype=problem.xs[0].dtype) * 0.3
              for _ in range(2)] + [torch.randn(1, 8, hidden, generator=g,
                                                dtype=problem.xs[0].dtype) * 0.3]
    cases = [{"micro_batches": k, "shared_experts": shared} for k in (1, K)]
    cases.append({"micro_batches": K, "shared_experts": shared, "overlap": False})
    results = mc2.run_local(record_schedules, 2, args=([(problem, o) for o in cases],),
                            timeout_s=120)
    for rank, per_case in enumerate(results):
        for k, got in zip((1, K), per_case[:2]):
            found = {(e.phase, e.name, e.micro_batch): e for e in got["exchanges"]}
            fill, drain = [s for s in got["local"] if s.phase == "forward"]
            (backward,) = [s for s in got["local"] if s.phase == "backward"]
            for phase, span in (("forward", fill), ("backward", backward)):
                first = found[(phase, "dispatch", 0)]
                assert first.asynchronous, (k, rank, phase)
                assert first.issued <= span.start < span.end <= first.waited, (k, rank, phase)
            last = found[("forward", "combine", k - 1)]
            assert last.asynchronous, (k, rank)
            assert last.issued <= drain.start < drain.end <= last.waited, (k, rank)
        assert len(per_case[2]["local"]) == 3, rank
