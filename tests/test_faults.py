"""The fault matrix: every case in a real multi-process world, each with a bounded run time.

A stalled peer (SIGSTOP: alive but silent) and a dead one (exits), in the forward, in the
backward and during ``"auto"``'s calibration: the survivors raise within the deadline plus a
few seconds. Non-finite tokens, with and without ``check_finite``. Ctrl-C during ``mc2 bench``
and ``mc2 train``: nothing left behind. (Disagreements and one-rank bad input are in
``test_bad_input.py``; hostile routings, zero tokens and K above the tokens in
``test_fused_expert_distributed.py`` and here.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import mc2
from mc2.tools.launch import LocalWorldError
from tests.workers_faults import TIMEOUT_S, faulty_peer, nonfinite_token

SLACK_S = 5.0  # "within the deadline plus a few seconds"


def _survivors(kind: str, where: str) -> dict[int, dict]:
    try:
        values = mc2.run_local(faulty_peer, 3, args=(kind, where), timeout_s=60, deadline_s=40)
        return dict(enumerate(values))
    except LocalWorldError as exc:  # the culprit never reports (stopped) or died
        return exc.values


@pytest.mark.parametrize("where", ["forward", "backward", "calibration"])
def test_a_stalled_peer_becomes_comm_timeout_on_every_survivor(where: str) -> None:
    start = time.monotonic()
    survivors = _survivors("stalled", where)
    assert sorted(survivors) == [0, 1], survivors
    for rank, r in survivors.items():
        assert r["raised"] == "CommTimeout", (rank, r)
        assert r["after_s"] <= TIMEOUT_S + SLACK_S, (rank, r["after_s"])
        assert "torchrun --max-restarts" in r["message"]
        assert f"in the {'backward' if where == 'backward' else 'forward'}" in r["message"]
        if where == "backward":
            assert "micro-batch" in r["message"], r["message"]
        if where == "calibration":  # past the handshake, inside "auto"'s measurements
            assert "planner measurement" in r["message"], r["message"]
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("where", ["forward", "backward", "calibration"])
def test_a_dead_peer_is_an_error_on_every_survivor(where: str) -> None:
    """The survivors learn it from their closed connections, before their deadlines, as
    mc2's ``CommTimeout`` naming where (not Gloo's bare read error), or, where a survivor
    was not reading from the dead peer, at its deadline."""
    survivors = _survivors("dead", where)
    assert sorted(survivors) == [0, 1], survivors
    for rank, r in survivors.items():
        assert r["raised"] == "CommTimeout", (rank, r)
        assert "torchrun --max-restarts" in r["message"], (rank, r["message"])
        assert r["after_s"] <= TIMEOUT_S + SLACK_S, (rank, r["after_s"])


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_nonfinite_token_stays_in_its_row_but_poisons_its_experts_gradients(value) -> None:
    results = mc2.run_local(nonfinite_token, 2, args=(value, False))
    assert results[0]["bad_rows"] == [3] and results[1]["bad_rows"] == []
    assert results[0]["bad_grad_rows"] == [3]  # input gradients stay per token too
    visited = results[0]["token_experts"]  # global ids; 2 local experts per rank
    for rank, r in enumerate(results):
        mine = [e - 2 * rank for e in visited if e // 2 == rank]
        assert sorted(r["poisoned_local_experts"]) == sorted(mine), (rank, r)


@pytest.mark.parametrize("capacity", [None, 32])
def test_check_finite_raises_on_every_rank(capacity: int | None) -> None:
    """Also in capacity mode after a first call agreed the configuration, whose later calls
    trust a handshake of configuration facts only: with ``check_finite`` each call's
    handshake checks the data (before: a NaN in a steady call passed silently)."""
    results = mc2.run_local(nonfinite_token, 2, args=(float("nan"), True, capacity),
                            deadline_s=60)
    assert "x holds NaN or Inf in 1 token row(s), the first is 3" in results[0]["error"]
    assert "rank 0" in results[1]["error"] and "NaN" in results[1]["error"]


def test_zero_tokens_everywhere_and_k_above_the_tokens() -> None:
    x = torch.zeros(0, 8, dtype=torch.float64, requires_grad=True)
    w = [torch.randn(2, 8, 12, dtype=torch.float64, requires_grad=True),
         torch.randn(2, 8, 12, dtype=torch.float64, requires_grad=True),
         torch.randn(2, 12, 8, dtype=torch.float64, requires_grad=True)]
    out = mc2.fused_expert(x, *w, torch.zeros(0, 2, dtype=torch.long), micro_batches=4)
    out.sum().backward()
    assert out.shape == (0, 8) and all(torch.equal(p.grad, torch.zeros_like(p)) for p in w)
    from tests.problems import make_problem
    from tests.test_fused_expert_distributed import assert_close, reference
    from tests.workers import run_cases

    p = make_problem(2, "uniform", tokens=3)  # 3 and 6 tokens, K = 8
    got = mc2.run_local(run_cases, 2, args=([(p, {"micro_batches": 8})],))
    ref = reference(p)
    for rank, r in enumerate(got):
        assert_close(r[0]["out"], ref["out"][rank], torch.float64, f"rank {rank} out")
        assert_close(r[0]["x"], ref["x"][rank], torch.float64, f"rank {rank} grad x")


def test_a_timeout_names_its_setting_and_env(monkeypatch) -> None:
    from mc2.engine.transport.deadline import CommTimeout, resolve_timeout

    monkeypatch.setenv("MC2_TIMEOUT", "7.5")
    assert resolve_timeout(None) == 7.5 and resolve_timeout(2) == 2.0
    assert resolve_timeout(0) is None
    monkeypatch.setenv("MC2_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="MC2_TIMEOUT must be a number"):
        resolve_timeout(None)
    monkeypatch.delenv("MC2_TIMEOUT")
    assert resolve_timeout(None) == float("inf")  # the group's own (wait_deadline)
    err = CommTimeout("dispatch", 3.2).at(micro_batch=1, phase="backward")
    assert isinstance(err, RuntimeError)
    assert "dispatch of micro-batch 1 in the backward waited 3.2s" in str(err)


class _Options:
    def __init__(self, seconds: float) -> None:
        from datetime import timedelta

        self._timeout = timedelta(seconds=seconds)


class _Group:
    """What torch tells of a group's own timeout: its backend's options."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds

    def _get_backend(self, device):
        if self.seconds is None:
            raise RuntimeError("No backend type associated with device type cpu")
        backend = type("Backend", (), {})()
        backend.options = _Options(self.seconds)
        return backend


def test_the_default_deadline_is_the_groups_own_timeout(monkeypatch) -> None:
    """No ``timeout=`` and no ``MC2_TIMEOUT``: a wait may take as long as its group's own
    timeout (never stricter than the backend would be); an explicit shorter one stays the
    user's; a longer one is the group's (the backend ends the collective there anyway)."""
    from mc2.engine.transport.deadline import group_timeout, resolve_timeout, wait_deadline

    monkeypatch.delenv("MC2_TIMEOUT", raising=False)
    seven, unknown = _Group(7.0), _Group(None)
    assert group_timeout(seven, "cpu") == 7.0 and group_timeout(unknown, "cpu") is None
    assert wait_deadline(resolve_timeout(None), seven, "cpu") == 7.0
    assert wait_deadline(resolve_timeout(2), seven, "cpu") == 2.0
    assert wait_deadline(resolve_timeout(100), seven, "cpu") == 7.0
    assert wait_deadline(resolve_timeout(0), seven, "cpu") is None
    assert wait_deadline(resolve_timeout(None), unknown, "cpu") is None  # the backend's own
    assert wait_deadline(resolve_timeout(5), unknown, "cpu") == 5.0
    monkeypatch.setenv("MC2_TIMEOUT", "3")
    assert wait_deadline(resolve_timeout(None), seven, "cpu") == 3.0


GROUP_TIMEOUT_S = 4.0


def test_a_late_peer_is_kept_until_the_groups_timeout_and_later_calls_name_the_first() -> None:
    """A world whose process groups time out after 4 s, no ``timeout=``: a peer 1 s late is
    waited for (same result); one 9 s late makes the waiting rank raise ``CommTimeout`` after
    the group's 4 s, not before. After it, every call on those groups (the pending backward,
    a new forward) raises ``CommTimeout`` naming that first timeout, and issues nothing."""
    from tests.workers_deadlines import late_peer

    try:
        results = dict(enumerate(mc2.run_local(late_peer, 2, args=(1.0, 9.0),
                                               timeout_s=GROUP_TIMEOUT_S, deadline_s=90)))
    except LocalWorldError as exc:  # the late rank may see its peer's teardown instead
        results = exc.values
    waiting = results[0]
    assert waiting["control_timeout_s"] == GROUP_TIMEOUT_S, waiting  # made like its group
    assert waiting["short"]["raised"] is None, waiting["short"]
    assert waiting["same_result"] is True
    long = waiting["long"]
    assert long["raised"] == "CommTimeout", long
    assert long["operation"] == "handshake" and "in the forward" in long["message"], long
    assert GROUP_TIMEOUT_S * 0.9 <= long["after_s"] <= GROUP_TIMEOUT_S + SLACK_S, long
    for name in ("backward_after", "forward_after"):
        after = waiting[name]
        assert after["raised"] == "CommTimeout", (name, after)
        assert after["first"] == "handshake", (name, after)
        assert "handshake in the forward waited" in after["message"], (name, after)
    assert waiting["collectives_after"] == 0, waiting


def test_soak_keeps_memory_threads_and_descriptors_put() -> None:
    """200 calls (``benchmarks/soak.py`` runs 2,000) with the 2-D hierarchy and "auto" on 2 x 2
    ranks: after 50 calls of warm-up nothing grows."""
    from pathlib import Path

    benchmarks = str(Path(__file__).resolve().parent.parent / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.append(benchmarks)  # spawned ranks inherit sys.path and import it by name
    import soak

    results = mc2.run_local(soak.soak_rank, 4, args=(200, 50), deadline_s=300)
    for rank, r in enumerate(results):
        (rss0, threads0, fds0), (rss1, threads1, fds1) = r["warm"], r["end"]
        assert rss1 <= rss0 * 1.05, (rank, rss0, rss1)
        # nothing grows (a descriptor of the warm-up closed later is no leak)
        assert threads1 <= threads0 and fds1 <= fds0, (rank, r)


def _no_processes_left(session: int) -> list[str]:
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session and fields[0] != "Z":  # field 6: session id
            left.append(pid)
    return left


def _sigint_as_in_a_terminal() -> None:
    """``preexec_fn``: a program started from a terminal gets Ctrl-C's default action, but one
    started under a test runner that was itself started in the background by a
    non-interactive shell inherits SIGINT *ignored* (and Python then installs no
    KeyboardInterrupt handler), so the Ctrl-C these tests send would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("command", [
    ["bench", "--tokens-per-rank", "2048", "--hidden", "256", "--ffn", "512", "--repeats", "50"],
    ["train", "--steps", "500", "--batch", "2", "--seq", "32"],
], ids=["bench", "train"])
def test_ctrl_c_leaves_no_process_behind(command: list[str], tmp_path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "mc2.tools.cli", *command, "--out", str(tmp_path)]
                            if command[0] == "train" else [sys.executable, "-m", "mc2.tools.cli",
                                                           *command],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_sigint_as_in_a_terminal)
    try:
        deadline = time.monotonic() + 90
        seen = ""
        while time.monotonic() < deadline:  # wait until the ranks are at work
            line = proc.stderr.readline()
            seen += line
            if "repeat" in line or "it/s" in line or "warmup" in line:
                break
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        proc.wait(timeout=60)
        time.sleep(1)
        assert _no_processes_left(proc.pid) == [], seen[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("argv,missing,expected", [
    (["bench", "--trace", "out"], "matplotlib", "--trace draws gantt.png and needs matplotlib: "
                                                "pip install 'mc2[plot]'"),
    (["train", "--steps", "1"], "transformers", "needs transformers: pip install 'mc2[train]'"),
    (["simulate", "--plot", "x.png"], "matplotlib", "needs matplotlib"),
])
def test_a_missing_optional_dependency_is_one_line_before_any_work(argv, missing, expected,
                                                                   monkeypatch, capsys) -> None:
    import mc2.tools.requirements
    from mc2.tools.cli import main

    real = mc2.tools.requirements._has
    monkeypatch.setattr(mc2.tools.requirements, "_has", lambda m: m != missing and real(m))
    start = time.monotonic()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1 and "Traceback" not in err
    assert time.monotonic() - start < 2  # nothing ran


def test_nodes_without_root_says_so(monkeypatch, capsys) -> None:
    from mc2.tools.cli import main

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["bench", "--nodes", "2", "--ranks-per-node", "1"]) == 2
    assert "needs root" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() != 0 or not __import__("shutil").which("tc"),
                    reason="emulated nodes need root and iproute2 (CI runs as root)")
def test_ctrl_c_during_bench_across_nodes_leaves_nothing_behind() -> None:
    from mc2.tools.netns import leftover_namespaces

    proc = subprocess.Popen([sys.executable, "-m", "mc2.tools.cli", "bench", "--nodes", "2",
                             "--ranks-per-node", "1", "--inter-node-bandwidth", "100mbit",
                             "--tokens-per-rank", "512", "--hidden", "128", "--repeats", "200"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_sigint_as_in_a_terminal)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if "repeat" in proc.stderr.readline():
                break
        # the bench's own namespaces (named by its pid: another job's, a demo running beside
        # the suite, are not this test's to count)
        mine = f"mc2-{proc.pid}-"
        assert len(leftover_namespaces(mine)) == 3  # switch + 2 nodes, in use
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        time.sleep(1)
        assert _no_processes_left(proc.pid) == []
        assert leftover_namespaces(mine) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_closed_connection_in_a_wait_is_a_comm_timeout_naming_it() -> None:
    """A host backend's wait that fails because a peer's connection closed (Gloo's read
    error: a peer that passed its deadline first, died, or was killed) raises mc2's
    ``CommTimeout`` with the backend's words, not the backend's bare error; any other error
    of the wait is left as it was."""
    from mc2.engine.transport.deadline import CommTimeout, wait_work

    class Broken:
        def __init__(self, text: str) -> None:
            self.text = text

        def wait(self, timeout: object = None) -> bool:
            raise RuntimeError(self.text)

    closed = ("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:41234: "
              "Connection reset by peer\nmore")
    for seconds in (None, 30.0):
        with pytest.raises(CommTimeout) as caught:
            wait_work(Broken(closed), "dispatch", seconds)
        assert caught.value.lost == closed.splitlines()[0]
        told = caught.value.at(micro_batch=1, phase="forward")
        assert told.lost == caught.value.lost
        assert "dispatch of micro-batch 1 in the forward lost its connection" in str(told)
        assert "torchrun --max-restarts" in str(told)
        assert "lost a peer before (the dispatch of micro-batch 1 in the forward lost its " \
            "connection" in str(told.refused("combine"))
        with pytest.raises(RuntimeError, match="size mismatch") as other:
            wait_work(Broken("size mismatch"), "dispatch", seconds)
        assert not isinstance(other.value, CommTimeout)
