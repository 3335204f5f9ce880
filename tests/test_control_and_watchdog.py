"""Control messages on a communicator of their own; the stream watchdog's deadlines and aborts.

* The handshake and the counts (exchange, and gather for the 2-D exchange) run on the control
  group, never on the communicator of the row transfers (on NCCL a communicator runs in order,
  so a handshake would otherwise wait behind another micro-batch's dispatch); results still
  equal the dense reference. A local call makes no group.
* The watchdog counts a stream backend's deadline from a device event recorded before the
  collective (a host that ran ahead does not abort a healthy job), aborts every group of the
  process in one action, and ends the process when that abort hangs or is impossible.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch

import mc2
from mc2.engine.transport import comm
from mc2.engine.transport.deadline import CommTimeout
from mc2.engine.transport.watchdog import EXIT_CODE, Watchdog, abort_groups, start_stamp
from tests import fake_stream_backend
from tests.problems import make_problem
from tests.reference import dense_moe
from tests.workers_faults import control_messages, stream_stall_aborts


# --- fakes of a stream backend's objects, on a clock the test moves -------------------------

class Clock:
    def __init__(self) -> None:
        self.t = 100.0


class FakeWork:
    """A collective's work: completes when the test's clock reaches ``done_at``."""

    def __init__(self, clock: Clock, done_at: float | None = None) -> None:
        self.clock, self.done_at = clock, done_at

    def is_completed(self) -> bool:
        return self.done_at is not None and self.clock.t >= self.done_at


class FakeEvent:
    """A device event recorded before the collective: reached when the device gets there."""

    def __init__(self, clock: Clock, reached_at: float) -> None:
        self.clock, self.reached_at = clock, reached_at

    def query(self) -> bool:
        return self.clock.t >= self.reached_at


class FakeGroup:
    def __init__(self, name: str, log: list | None = None) -> None:
        self.group_name, self.log = name, log

    def abort(self) -> None:
        if self.log is not None:
            self.log.append(self.group_name)


def _by_hand(wd: Watchdog) -> Watchdog:
    """No thread: the test polls on its own clock."""
    wd._thread = object()  # type: ignore[assignment]
    return wd


def _aborts() -> tuple[list[list[Any]], Any]:
    calls: list[list[Any]] = []
    return calls, lambda groups: calls.append(list(groups))


# --- (a) the deadline counts from the device -------------------------------------------------

def test_a_host_that_ran_ahead_does_not_abort_a_healthy_job() -> None:
    """The host issued the collective at t=100 and ran on; the device reaches it at t=110 and
    it takes 1 s. A deadline of 3 s counted from the host's issue would abort it at t=103."""
    clock, (calls, abort) = Clock(), _aborts()
    wd = _by_hand(Watchdog(abort=abort, groups=lambda: []))
    work = FakeWork(clock, done_at=111.0)
    wd.watch(work, "dispatch", deadline_s=3.0, start=FakeEvent(clock, 110.0), micro_batch=0,
             phase="backward", group=FakeGroup("world"))
    for t in (101.0, 103.5, 106.0, 109.9, 110.0, 110.5, 111.0):
        clock.t = t
        assert wd.poll(now=t) is None, f"expired at t={t}"
    assert wd.in_flight == 0 and calls == []
    wd.check()  # nothing recorded


def test_a_stalled_collective_expires_a_deadline_after_the_device_reached_it() -> None:
    clock = Clock()
    wd = _by_hand(Watchdog(abort=lambda groups: None, groups=lambda: []))
    wd.watch(FakeWork(clock), "combine", deadline_s=3.0, start=FakeEvent(clock, 110.0),
             micro_batch=1, phase="forward")
    for t in (105.0, 109.0, 110.0, 112.9):  # the clock starts at the first poll that sees it
        clock.t = t
        assert wd.poll(now=t) is None, t
    clock.t = 113.1
    expired = wd.poll(now=113.1)
    assert expired is not None and expired.operation == "combine"
    wd.expire(expired, now=113.1)
    with pytest.raises(CommTimeout, match=r"combine of micro-batch 1 in the forward waited 3\.1s"):
        wd.check()


def test_a_deadline_from_the_real_thread_counts_from_the_event() -> None:
    """The same through the watchdog's own thread, on the real clock, with wide margins:
    reached 1.0 s after the issue, done 0.3 s later, deadline 0.6 s."""

    class Timed:
        def __init__(self, at: float) -> None:
            self.at = at

        def is_completed(self) -> bool:
            return time.monotonic() >= self.at

        query = is_completed

    calls, abort = _aborts()
    wd = Watchdog(poll_s=0.01, abort=abort, groups=lambda: [])
    issued = time.monotonic()
    wd.watch(Timed(issued + 1.3), "dispatch", deadline_s=0.6, start=Timed(issued + 1.0))
    while wd.in_flight and time.monotonic() < issued + 10:
        time.sleep(0.02)
    assert wd.in_flight == 0 and calls == []
    wd.check()


def test_the_start_on_cpu_is_the_host_clock() -> None:
    before = time.monotonic()
    for stream in (False, True):
        stamp = start_stamp(torch.device("cpu"), stream)
        assert isinstance(stamp, float) and before <= stamp <= time.monotonic()
    assert isinstance(start_stamp(None, True), float)


# --- (b) every group in one action ---------------------------------------------------------

def test_a_passed_deadline_aborts_every_group_in_one_action() -> None:
    clock, (calls, abort) = Clock(), _aborts()
    world, control, sub, other = (FakeGroup(n) for n in ("world", "control", "sub", "other"))
    wd = _by_hand(Watchdog(abort=abort, groups=lambda: [world, control, other]))
    wd.watch(FakeWork(clock), "dispatch", deadline_s=1.0, start=100.0, group=world)
    wd.watch(FakeWork(clock), "dispatch", deadline_s=1.0, start=100.5, group=sub)
    wd.watch(FakeWork(clock), "counts exchange", deadline_s=1.0, start=100.5, group=control)
    clock.t = 101.2
    expired = wd.poll(now=101.2)
    assert expired is not None and expired.group is world
    wd.expire(expired, now=101.2)
    assert len(calls) == 1, "one abort for all the groups"
    assert {g.group_name for g in calls[0]} == {"world", "control", "sub", "other"}
    assert len(calls[0]) == 4, "each group once"
    assert wd.in_flight == 0, "nothing is left to watch once every group is aborted"
    with pytest.raises(CommTimeout, match="dispatch"):
        wd.check()


def test_abort_groups_aborts_each_group_from_one_place() -> None:
    log: list[str] = []
    abort_groups([FakeGroup("a", log), FakeGroup("b", log), FakeGroup("c", log)])
    assert log == ["a", "b", "c"]
    log.clear()
    with pytest.raises(RuntimeError, match="cannot abort"):  # the others are still aborted
        abort_groups([FakeGroup("a", log), object(), FakeGroup("c", log)])
    assert log == ["a", "c"]


def test_a_stream_stall_aborts_the_world_and_the_control_group_together() -> None:
    """In a real 2-rank world on the emulated stream backend: rank 1 holds a dispatch past the
    deadline; the watchdog's one abort takes every group (the world and the control group)."""
    results = mc2.run_local(
        stream_stall_aborts, 2, backend=fake_stream_backend.NAME,
        before_init=fake_stream_backend.install, deadline_s=120,
        rank_env=lambda r: {"MC2_FAKE_STALL": "1:2:4"})
    first = results[0]
    assert first["error"] == "dispatch", first
    assert first["aborts"] == 1, first
    assert first["aborted_groups"] == first["groups"] >= 2, first


# --- after a timeout: every later check names the first ------------------------------------

def test_every_check_after_an_expiry_raises_naming_the_first() -> None:
    """The watchdog's groups are aborted: the first check raises the timeout itself, every
    later one a ``CommTimeout`` that names it (never a raw error of a dead communicator)."""
    clock = Clock()
    wd = _by_hand(Watchdog(abort=lambda groups: None, groups=lambda: []))
    wd.watch(FakeWork(clock), "combine", deadline_s=1.0, start=100.0, micro_batch=2,
             phase="backward")
    clock.t = 101.5
    wd.expire(wd.poll(now=101.5), now=101.5)
    with pytest.raises(CommTimeout, match="combine of micro-batch 2 in the backward") as first:
        wd.check()
    for _ in range(2):
        with pytest.raises(CommTimeout) as later:
            wd.check()
        assert later.value.first is first.value, later.value
        assert "combine of micro-batch 2 in the backward waited 1.5s" in str(later.value)


# --- CUDA-graph capture: nothing polls, forks or reads a host clock --------------------------

def test_a_paused_watchdog_polls_nothing_until_an_eager_watch() -> None:
    class Counted(FakeWork):
        polls = 0

        def is_completed(self) -> bool:
            Counted.polls += 1
            return super().is_completed()

    clock = Clock()
    wd = _by_hand(Watchdog(abort=lambda groups: None, groups=lambda: []))
    wd.watch(Counted(clock), "dispatch", deadline_s=1.0, start=100.0)
    wd.pause()
    clock.t = 200.0  # far past the deadline: a poll would expire it
    assert wd.poll(now=200.0) is None and Counted.polls == 0 and wd.paused
    wd.watch(Counted(clock, done_at=0.0), "combine", deadline_s=1.0, start=200.0)
    assert not wd.paused
    assert wd.poll(now=200.0) is not None and Counted.polls == 2


def test_wait_idle_returns_once_every_work_is_seen_completed() -> None:
    clock = Clock()
    wd = _by_hand(Watchdog(abort=lambda groups: None, groups=lambda: []))
    assert wd.wait_idle(0.0)
    wd.watch(FakeWork(clock, done_at=105.0), "dispatch", deadline_s=10.0, start=100.0)
    assert not wd.wait_idle(0.0)
    clock.t = 105.0
    assert wd.poll(now=105.0) is None and wd.wait_idle(0.0)


def test_a_capacity_call_while_capturing_polls_forks_and_clocks_nothing() -> None:
    """On the emulated stream backend, default deadline, a timeline: eagerly the call is
    watched (device-event starts, ``is_completed`` polls), observed and timed; with mc2 told
    the stream is capturing, the same call (forward and backward) watches, polls, forks an
    observer and reads a host clock not once, and gives the same result. A capacity call
    with ``check_finite=True``, which reads the device in every call, is refused there, naming
    the option."""
    from tests.workers_deadlines import captured_capacity

    results = mc2.run_local(captured_capacity, 2, backend=fake_stream_backend.NAME,
                            before_init=fake_stream_backend.install, deadline_s=120)
    for rank, r in enumerate(results):
        eager, captured = r["eager_counts"], r["captured_counts"]
        for name in ("watch", "observe", "start_stamp", "clock"):
            assert eager[name] > 0, (rank, name, eager)  # the counters see the eager call
        assert r["eager"]["spans"] > 0, (rank, r)
        assert captured == dict.fromkeys(captured, 0), (rank, captured,
                                                         r["captured_clock_callers"])
        assert r["captured"]["spans"] == 0 and r["paused"], (rank, r)
        assert "check_finite=True" in (r["finite_captured"] or ""), r["finite_captured"]
        torch.testing.assert_close(r["captured"]["out"], r["eager"]["out"], rtol=0, atol=0)
        torch.testing.assert_close(r["captured"]["x"], r["eager"]["x"], rtol=0, atol=0)


# --- (c) an abort that hangs or cannot be done ends the process ------------------------------

_SCRIPT = textwrap.dedent("""
    import sys, time
    from mc2.engine.transport.watchdog import Watchdog

    class Never:
        def is_completed(self):
            return False

    class NoAbort:  # a backend without abort
        group_name = "no-abort"

    class Hangs:
        group_name = "hangs"

        def abort(self):
            time.sleep(3600)

    group = NoAbort() if sys.argv[1] == "no-abort" else Hangs()
    wd = Watchdog(poll_s=0.01, groups=lambda: [group])  # grace: MC2_ABORT_GRACE_S
    wd.watch(Never(), "dispatch", deadline_s=0.2, start=time.monotonic(), micro_batch=0,
             phase="backward", group=group)
    time.sleep(60)  # the caller, blocked behind the stalled collective
    print("still alive")
""")


@pytest.mark.parametrize("backend,why", [("no-abort", "could not be aborted"),
                                         ("hangs", "did not return within 0.5s")])
def test_an_abort_that_hangs_or_cannot_be_done_ends_the_process(backend: str, why: str) -> None:
    import os

    env = dict(os.environ, MC2_ABORT_GRACE_S="0.5")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _SCRIPT, backend], env=env, text=True,
                          capture_output=True, timeout=50)
    took = time.monotonic() - start
    assert done.returncode == EXIT_CODE, (done.returncode, done.stderr[-2000:])
    assert "still alive" not in done.stdout
    assert "dispatch of micro-batch 0 in the backward" in done.stderr, done.stderr
    assert why in done.stderr and "MC2_ABORT_GRACE_S=0.5s" in done.stderr, done.stderr
    assert took < 40, took


def test_the_grace_period_is_read_from_the_environment_once(monkeypatch) -> None:
    from mc2.engine.transport.watchdog import ABORT_GRACE_S

    monkeypatch.delenv("MC2_ABORT_GRACE_S", raising=False)
    assert Watchdog().grace_s == ABORT_GRACE_S
    monkeypatch.setenv("MC2_ABORT_GRACE_S", "2.5")
    assert Watchdog().grace_s == 2.5 and Watchdog(grace_s=0.1).grace_s == 0.1
    monkeypatch.setenv("MC2_ABORT_GRACE_S", "soon")
    with pytest.raises(ValueError, match="MC2_ABORT_GRACE_S"):
        Watchdog()


# --- control messages -------------------------------------------------------------------------

def _reference(p: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    xs = [x.clone().requires_grad_(True) for x in p.xs]
    out = dense_moe(torch.cat(xs), p.w_up, p.w_gate, p.w_down, torch.cat(p.ids),
                    torch.cat(p.rws))
    out.backward(torch.cat(p.grad_outs))
    return list(out.detach().split([x.shape[0] for x in p.xs])), [x.grad for x in xs]


def test_handshake_and_counts_run_on_a_control_group_of_their_own() -> None:
    # 2 nodes of 1 rank: the 2-D exchange runs (its counts gather too) beside the flat one
    results = mc2.run_local(control_messages, 2, ranks_per_node=1, deadline_s=180)
    want, grads = _reference(make_problem(2, "uneven", seed=3))
    for rank, r in enumerate(results):
        by = r["by_sender"]
        assert by.get("handshake") and by.get("counts") and by.get("rows"), by
        control = set(by["handshake"]) | set(by["counts"])
        rows = set(by["rows"])
        assert control == {r["control"]}, (control, r["control"])
        assert r["control"] != r["world"] and r["world"] in rows, (r["control"], rows)
        assert not control & rows, (control, rows)
        assert len(by.get("setup", [])) <= 1, "the control group is made once"
        # held by the group's state: a group made anew over the same ranks has its own
        assert r["shared_by_ranks"] is False, "a new group's control group is its own"
        for name, got in r["results"].items():
            torch.testing.assert_close(got["out"], want[rank], rtol=0, atol=1e-10,
                                       msg=f"rank {rank} {name} out")
            torch.testing.assert_close(got["x"], grads[rank], rtol=0, atol=1e-10,
                                       msg=f"rank {rank} {name} grad x")


def test_a_local_call_makes_no_control_group(monkeypatch) -> None:
    import torch.distributed as dist

    made: list[Any] = []
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: made.append(a))
    assert comm.control_group(None) is None
    counts = torch.arange(6).view(2, 3)
    assert torch.equal(comm.exchange_counts(counts, None), counts)
    assert comm.gather_counts(counts, None).shape == (1, 2, 3)
    assert torch.equal(comm.all_reduce_max(counts, None, "handshake"), counts)
    p = make_problem(1, "uniform")
    out = mc2.fused_expert(p.xs[0], *p.local_weights(0), p.ids[0], p.rws[0], micro_batches=2)
    assert out.shape == p.xs[0].shape
    assert made == []
