"""``mc2 doctor``: what this machine offers MC2, and what to fix (the ``hccn_tool`` moment).

Reads only local facts: torch's backends, accelerators, the launcher's environment, network
interfaces (``/sys/class/net``) and RDMA devices (``/sys/class/infiniband``). Nothing is sent
anywhere.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from mc2.engine.transport.backend import ASYNC_BACKENDS, STREAM_BACKENDS
from mc2.engine.transport.env import force_sync


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return "?"


def _entries(folder: Path) -> list[Path]:
    return sorted(folder.iterdir()) if folder.exists() else []


def interfaces(root: Path = Path("/sys/class/net")) -> list[dict[str, str]]:
    return [{"name": dev.name, "state": _read(dev / "operstate"),
             "speed_mbps": _read(dev / "speed"), "mtu": _read(dev / "mtu")}
            for dev in _entries(root)]


def rdma_devices(root: Path = Path("/sys/class/infiniband")) -> list[dict[str, str]]:
    return [{"device": dev.name, "port": port.name, "state": _read(port / "state"),
             "rate": _read(port / "rate"), "link_layer": _read(port / "link_layer")}
            for dev in _entries(root) for port in _entries(dev / "ports")]


def backends() -> dict[str, bool]:
    found = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
             "mpi": dist.is_mpi_available()}
    try:  # Ascend: torch_npu registers HCCL
        import torch_npu  # noqa: F401

        found["hccl"] = True
    except ImportError:
        found["hccl"] = False
    return found


def report() -> tuple[list[str], list[str]]:
    """``(facts, advice)`` lines."""
    facts = [f"torch {torch.__version__}, host {socket.gethostname()}"]
    avail = backends()
    for name, ok in avail.items():
        asynchronous = "asynchronous collectives" if name in ASYNC_BACKENDS else "synchronous only"
        if name in STREAM_BACKENDS:
            asynchronous += ", stream-ordered waits"
        facts.append(f"backend {name}: {'available' if ok else 'not available'}"
                     + (f" ({asynchronous})" if ok else ""))
    facts.append(f"CUDA devices: {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    env = {k: os.environ[k] for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                      "MASTER_ADDR", "MASTER_PORT") if k in os.environ}
    facts.append("launcher environment: " + (", ".join(f"{k}={v}" for k, v in env.items())
                                             or "none (single process; use torchrun)"))
    if "LOCAL_WORLD_SIZE" in env and "WORLD_SIZE" in env:
        nodes = int(env["WORLD_SIZE"]) // max(int(env["LOCAL_WORLD_SIZE"]), 1)
        facts.append(f"topology: {nodes} node(s) x {env['LOCAL_WORLD_SIZE']} ranks")
    nics, rdma = interfaces(), rdma_devices()
    facts += [f"interface {nic['name']}: {nic['state']}, speed {nic['speed_mbps']} Mb/s, "
              f"mtu {nic['mtu']}" for nic in nics]
    facts += [f"RDMA {dev['device']} port {dev['port']}: {dev['state']}, {dev['rate']}, "
              f"{dev['link_layer']}" for dev in rdma]
    if not rdma:
        facts.append("RDMA devices: none (/sys/class/infiniband is empty or missing)")

    advice = []
    if force_sync():
        advice.append("MC2_FORCE_SYNC is set: nothing will overlap; unset it for MC2 to work")
    if torch.cuda.is_available() and not avail["nccl"]:
        advice.append("CUDA is present but NCCL is not: install a CUDA build of torch")
    if not rdma:
        advice.append("no RDMA device: across nodes the All-to-All runs over TCP sockets (slow, "
                      "and it competes with compute for CPU); for RoCE check that the NIC driver "
                      "is loaded and RDMA is enabled (on Ascend: hccn_tool -i 0 -roce -s)")
    else:
        down = [d for d in rdma if "ACTIVE" not in d["state"]]
        if down:
            advice.append("RDMA ports not ACTIVE: " + ", ".join(
                f"{d['device']}/{d['port']} ({d['state']})" for d in down))
    if not any(n["state"] == "up" and n["name"] != "lo" for n in nics):
        advice.append("no network interface is up besides loopback: only single-node runs")
    if not advice:
        advice.append("nothing to fix")
    return facts, advice
