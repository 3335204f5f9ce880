"""``benchmarks/device_check.py --dry-run``: the GPU check's script keeps working without a GPU.

It runs every part of the check on CPU (Gloo ranks with CPU tensors, a world of one with the
distributed path forced and the host-sync counter, tiny GEMMs) and must write a preset that
``mc2 simulate`` loads.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_device_check_dry_run(tmp_path) -> None:
    preset = tmp_path / "measured.toml"
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device_check.py"),
                           "--dry-run", "--preset", str(preset)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "all checks passed" in out
    assert "4 ranks 2d" in out and "wire float8_e4m3fn" in out
    assert "2 reads, 1 uploads" in out
    # (d) with the default deadline, not timeout=0; on CPU the capture is emulated (mc2 told
    # the stream captures): nothing watched, polled, forked or clocked in it
    graph = next(line for line in out.splitlines() if "capacity call K=2" in line)
    assert "default deadline" in graph and "capture emulated" in graph, graph
    assert "0 watched, 0 polls, 0 observer forks, 0 host clocks" in graph, graph
    assert graph.endswith(" ok"), graph
    from mc2.sim.presets import load_hardware

    hw = load_hardware(str(preset))
    assert hw.peak_tflops > 0 and hw.memory_gbps > 0
