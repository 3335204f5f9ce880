"""``mc2 demo``: the auto row and its locked K, the article's regime where root and iproute2
allow it, and the line that says why not (with the simulator's prediction) where they do not.

The end-to-end runs use tiny shapes and one or two rounds: they check what is printed, never
how fast anything was (the demo's numbers are measurements, not assertions)."""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest

from mc2.tools import demo
from mc2.tools.bench import BenchConfig, BenchReport, ModeResult
from mc2.tools.cli import build_parser, main

TINY = ["demo", "--tokens-per-rank", "64", "--hidden", "32", "--ffn", "48", "--experts", "4",
        "--micro-batches", "2", "--warmup", "0"]
CAN = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


def _result(mode: str, k: int | str, step: float, comm: float) -> ModeResult:
    return ModeResult(mode=mode, micro_batches=k, overlap=mode != "serial", step_s=step,
                      exposed_comm_s=comm, compute_s=step - comm, tokens_per_s_per_rank=1 / step,
                      comm_share=comm / step, speedup=1.0, hidden_fraction=0.0)


def _report(serial: list[float], auto: list[float], auto_k: int = 1) -> BenchReport:
    report = BenchReport(BenchConfig(), 2, auto_k=auto_k, explore_calls=5)
    report.results = [_result("serial", 1, sorted(serial)[len(serial) // 2], 0.01),
                      _result("mc2 K=2", 2, 0.5, 0.0),
                      _result("mc2 auto", "auto", sorted(auto)[len(auto) // 2], 0.01)]
    report.step_samples = {"serial": serial, "mc2 K=2": [0.5] * len(serial), "mc2 auto": auto}
    report.auto_trials = {1: 0.4, 2: 0.5}
    return report


def test_auto_line_judges_auto_against_serial_round_by_round() -> None:
    same = demo.auto_line(_report([0.40, 0.41, 0.39, 0.60, 0.40], [0.40, 0.40, 0.40, 0.40, 0.41]))
    assert "keeps K = 1" in same and "locked K=1" in same
    assert "no slower than serial, within this run's noise" in same
    slower = demo.auto_line(_report([0.40, 0.41, 0.39, 0.40, 0.40], [0.48, 0.49, 0.47, 0.30, 0.48],
                                    auto_k=4))
    assert "splits into K = 4" in slower and "SLOWER than serial" in slower


def test_link_rate_aims_at_the_comm_share() -> None:
    """The rate makes the link take share/(1-share) x T_comp minus loopback's comm."""
    cfg = BenchConfig(tokens_per_rank=512, hidden=512, topk=2)
    report = _report([0.40] * 3, [0.40] * 3)
    rate, why = demo.rate_for_share(report, cfg, 0.5, world=2, ranks_per_node=1)
    link_s = 1.0 * (0.40 - 0.01) - 0.01  # share 0.5: comm = comp
    nbytes = demo.link_bytes_per_step(cfg, 2, 1)
    assert nbytes == 4 * 512 * 2 / 2 * 512 * 4  # half the rows cross, four exchanges, float32
    assert rate == f"{round(nbytes * 8 * demo.WIRE_OVERHEAD / link_s / 1e6)}mbit"
    assert "near 50%" in why


def test_cluster_problem_says_why_and_what_to_run(monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "not root" in demo.cluster_problem() and "sudo .venv/bin/mc2 demo" in \
        demo.cluster_problem()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "tc" else "/sbin/ip")
    assert "tc not found" in demo.cluster_problem() and "apt-get install iproute2" in \
        demo.cluster_problem()


def test_rounds_flag_and_demo_defaults() -> None:
    args = build_parser().parse_args(["demo", "--rounds", "3"])
    assert args.repeats == 3 and args.inter_node_bandwidth == "auto" and args.auto
    assert not args.no_cluster and args.comm_share == pytest.approx(0.47)


def test_demo_without_root_prints_why_and_the_prediction(monkeypatch, capsys) -> None:
    monkeypatch.setattr(demo, "cluster_problem",
                        lambda: "not root (network namespaces and tc need it): run `sudo "
                                ".venv/bin/mc2 demo` to measure the article's regime")
    assert main([*TINY, "--rounds", "1", "--no-gantt"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert any(line.startswith("serial ") for line in lines)
    assert any(line.startswith("mc2 auto ") for line in lines)  # the default, beside fixed K
    assert "mc2's default, micro_batches='auto'" in out and "locked K=" in out
    assert "2. the article's regime: not measured here: not root" in out
    assert "sudo .venv/bin/mc2 demo" in out
    assert "mixtral-8x7b on atlas-800i-a2" in out  # the simulator's prediction stands in
    assert "no Gantt picture (--no-gantt)" in out and "demo wall time" in out


@pytest.mark.skipif(not CAN, reason="needs root and iproute2 (ip, tc)")
def test_demo_as_root_runs_the_emulated_cluster(tmp_path, capsys) -> None:
    from mc2.tools.netns import leftover_namespaces

    mine = f"mc2-{os.getpid()}-"  # the demo runs here; another xdist worker may make its own
    before = leftover_namespaces(mine)
    plot = importlib.util.find_spec("matplotlib") is not None
    extra = ["--trace", str(tmp_path)] if plot else ["--no-gantt"]
    assert main([*TINY, "--rounds", "2", *extra]) == 0
    out = capsys.readouterr().out
    assert leftover_namespaces(mine) == before, "namespaces left behind"
    assert "2. the article's regime: 2 emulated nodes x 1 rank(s)" in out
    assert "chosen for a serial comm share near 47%" in out
    assert "no fusion (serial)" in out and "MC2, default (auto, locked K=" in out
    assert "MC2, best fixed K (K=2)" in out and "overlap alone can give at most" in out
    assert out.count("locked K=") >= 3  # each part's auto line and the table's auto row
    if plot:
        assert (tmp_path / "gantt.png").stat().st_size > 0
        assert "the emulated cluster" in out and str(tmp_path / "gantt.png") in out
