"""mc2 doctor reads interfaces and RDMA devices and gives advice."""

from __future__ import annotations

import subprocess
import sys

from mc2.tools.doctor import interfaces, rdma_devices


def test_reads_sysfs_layouts(tmp_path) -> None:
    nic = tmp_path / "net" / "eth9"
    nic.mkdir(parents=True)
    (nic / "operstate").write_text("up\n")
    (nic / "speed").write_text("200000\n")
    (nic / "mtu").write_text("9000\n")
    port = tmp_path / "ib" / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    (port / "link_layer").write_text("Ethernet\n")
    assert interfaces(tmp_path / "net") == [
        {"name": "eth9", "state": "up", "speed_mbps": "200000", "mtu": "9000"}]
    assert rdma_devices(tmp_path / "ib") == [
        {"device": "mlx5_0", "port": "1", "state": "4: ACTIVE", "rate": "200 Gb/sec (4X HDR)",
         "link_layer": "Ethernet"}]
    assert rdma_devices(tmp_path / "missing") == []


def test_doctor_command_prints_facts_and_advice() -> None:
    import os

    env = dict(os.environ, MC2_FORCE_SYNC="1")
    proc = subprocess.run([sys.executable, "-m", "mc2.tools.cli", "doctor"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "backend gloo: available (asynchronous collectives)" in proc.stdout
    assert "advice:" in proc.stdout and "MC2_FORCE_SYNC is set" in proc.stdout
