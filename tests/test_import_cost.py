"""``import mc2`` costs no more than the modules it needs: Dynamo (seconds, on every rank of
every job) is imported only when something is traced."""

from __future__ import annotations

import subprocess
import sys


def test_import_mc2_does_not_import_dynamo() -> None:
    code = ("import sys, time\n"
            "start = time.perf_counter(); import torch; torch_s = time.perf_counter() - start\n"
            "start = time.perf_counter(); import mc2; mc2_s = time.perf_counter() - start\n"
            "print('torch._dynamo' in sys.modules, f'{torch_s:.2f}', f'{mc2_s:.2f}')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    dynamo, torch_s, mc2_s = done.stdout.split()
    print(f"import torch {torch_s} s, then import mc2 {mc2_s} s")
    assert dynamo == "False"
