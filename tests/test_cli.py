"""The command line: help text and a tiny end-to-end bench in a local world."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mc2.tools.cli import main


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``mc2 ARGV`` in this process (its ranks fork from the suite's preloaded server):
    ``(exit status, stdout, stderr)``, as the command line would end."""
    try:
        code = main(argv) or 0
    except SystemExit as exc:  # argparse's errors and --help
        code = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_help_explains_commands(capsys) -> None:
    try:
        main(["--help"])
    except SystemExit as exc:
        assert exc.code == 0
    text = capsys.readouterr().out
    assert "demo" in text and "bench" in text


def test_python_dash_m_mc2_is_the_command_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "mc2", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "simulate" in proc.stdout


def test_public_names_survive_the_package_layout() -> None:
    import mc2
    from mc2.parallel import checkpoint

    assert mc2.checkpoint is checkpoint and callable(mc2.checkpoint.save)
    assert issubclass(mc2.WireFormatWarning, UserWarning)
    with pytest.raises(AttributeError):
        mc2.no_such_name  # noqa: B018


def test_tiny_bench_prints_the_table(tmp_path, capsys) -> None:
    out = tmp_path / "report.json"
    code, stdout, stderr = _cli(
        ["bench", "--tokens-per-rank", "64", "--hidden", "32",
         "--ffn", "48", "--experts", "4", "--micro-batches", "2,4", "--repeats", "2",
         "--warmup", "0", "--split-sync", "--json", str(out)], capsys)
    assert code == 0, stderr
    for column in ("comm share", "tokens/s/rank", "speedup", "hidden", "max diff"):
        assert column in stdout
    report = json.loads(out.read_text())
    modes = [r["mode"] for r in report["results"]]
    assert modes == ["serial", "mc2 K=2", "mc2 K=4", "split K=2 (sync)", "split K=4 (sync)"]
    for r in report["results"]:
        assert r["step_s"] > 0 and r["max_diff"] < 1e-4


def test_bad_arguments_exit_cleanly(capsys) -> None:
    code, _, stderr = _cli(["bench", "--topk", "9"], capsys)
    assert code == 2 and "topk" in stderr


def test_bench_marks_a_sync_fallback(capsys, monkeypatch) -> None:
    monkeypatch.setenv("MC2_FORCE_SYNC", "1")  # the ranks take the caller's environment
    code, stdout, stderr = _cli(
        ["bench", "--tokens-per-rank", "32", "--hidden", "16",
         "--ffn", "16", "--experts", "4", "--micro-batches", "2", "--repeats", "1",
         "--warmup", "0"], capsys)
    assert code == 0, stderr
    assert "mc2 K=2 [SYNC FALLBACK]" in stdout
    assert "ran synchronously (MC2_FORCE_SYNC is set)" in stdout


def test_bench_times_each_wire_format(tmp_path, capsys) -> None:
    out = tmp_path / "report.json"
    code, _, stderr = _cli(
        ["bench", "--tokens-per-rank", "64", "--hidden", "32",
         "--ffn", "48", "--experts", "4", "--micro-batches", "2", "--repeats", "1",
         "--warmup", "0", "--wire-dtype", "none,bf16,fp8", "--wire-block", "16", "--json",
         str(out)], capsys)
    assert code == 0, stderr
    results = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert list(results) == ["serial", "mc2 K=2", "mc2 K=2 bf16", "mc2 K=2 fp8"]
    assert results["mc2 K=2"]["max_diff"] < 1e-5  # plain rows: exact
    assert 0 < results["mc2 K=2 bf16"]["max_diff"] < results["mc2 K=2 fp8"]["max_diff"]


@pytest.mark.parametrize("args,message", [
    (["--wire-dtype", "fp4"], "unknown wire format 'fp4'"),
    (["--wire-dtype", "fp8", "--hidden", "96"], "wire_block 128 must divide the hidden size 96"),
])
def test_bench_refuses_a_bad_wire_format_in_one_line(args, message, capsys) -> None:
    code, _, stderr = _cli(["bench", *args], capsys)
    assert code == 2 and message in stderr and "Traceback" not in stderr


def test_the_breakdown_refuses_options_it_would_ignore(capsys) -> None:
    """Before, ``--breakdown`` ran float32 on the CPU whatever ``--dtype`` said."""
    code, _, stderr = _cli(["bench", "--breakdown", "--dtype", "bfloat16"], capsys)
    assert code != 0 and "--dtype not supported with --breakdown" in stderr, stderr
