"""A cluster of several nodes inside one Linux box, for benchmarks and tests.

Each emulated node is a network namespace of its own. The ranks of one node talk over that
namespace's local routes (fast, like HCCS/NVLink); nodes are joined through a bridge in a
"switch" namespace by veth links whose egress is shaped with ``tc`` (token bucket), the slow
link between nodes. Only namespaces, interfaces and addresses this module creates are used
(``10.213.0.0/24`` inside its own namespaces), and everything is torn down on exit, on an
exception and on Ctrl-C. Needs root and iproute2 (``ip``, ``tc``).

The kernel here has no ``netem``, so only bandwidth is shaped; no latency option is offered.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

SUBNET = "10.213.0"
CLONE_NEWNET = 0x40000000


class NetnsError(RuntimeError):
    """The emulated cluster cannot be built here (not root, tools missing, kernel refused)."""


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")


def cluster_problem() -> str | None:
    """Why an emulated cluster cannot be built here, with what to do about it; ``None`` if it
    can. The one check behind :class:`EmulatedCluster`, the command line's ``--nodes`` and
    ``mc2 demo``'s part 2, and a function of its own so that tests can pretend to be an
    unprivileged user."""
    if os.geteuid() != 0:
        return ("not root: an emulated cluster needs root (network namespaces and tc): run it "
                "with sudo, e.g. `sudo .venv/bin/mc2 demo`; nothing of the host's network is "
                "touched (or use --ranks-per-node alone for an unshaped layout)")
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    return f"{' and '.join(missing)} not found: apt-get install iproute2" if missing else None


def parse_rate(text: str) -> str:
    """Validate a tc rate such as ``2gbit``, ``500mbit``; returns it normalised."""
    t = text.strip().lower()
    units = ("kbit", "mbit", "gbit", "bit")
    if not any(t.endswith(u) and t[: -len(u)].replace(".", "", 1).isdigit() for u in units):
        raise ValueError(f"bandwidth must look like 2gbit, 500mbit or 100kbit; got {text!r}")
    return t


@dataclass
class EmulatedCluster:
    """``nodes`` namespaces joined by shaped links; use as a context manager.

    Attributes:
        nodes, ranks_per_node: the layout.
        bandwidth: tc rate of each node's link to the switch (``None``: unshaped).
    """

    nodes: int
    ranks_per_node: int
    bandwidth: str | None = "2gbit"
    prefix: str = field(default_factory=lambda: f"mc2-{os.getpid()}")
    _made: list[str] = field(default_factory=list, repr=False)
    interface: ClassVar[str] = "mc2eth"  # each node's link to the switch

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def node_ns(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def __enter__(self) -> "EmulatedCluster":
        if (problem := cluster_problem()) is not None:
            raise NetnsError(problem)
        if self.nodes < 2 or self.ranks_per_node < 1:
            raise ValueError(f"need >= 2 nodes and >= 1 rank per node, got {self.nodes} x "
                             f"{self.ranks_per_node}")
        if self.bandwidth is not None:
            self.bandwidth = parse_rate(self.bandwidth)
        atexit.register(self.teardown)
        previous = signal.getsignal(signal.SIGINT)

        def interrupted(signum: int, frame: Any) -> None:
            self.teardown()
            signal.signal(signal.SIGINT, previous)
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, interrupted)
        self._previous_sigint = previous
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.teardown()
        signal.signal(signal.SIGINT, self._previous_sigint)

    def _build(self) -> None:
        _run("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for node in range(self.nodes):
            ns = self.node_ns(node)
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            peer = f"sw{node}"
            _run("ip", "-n", ns, "link", "add", self.interface, "type", "veth", "peer", "name",
                 peer, "netns", self.switch)
            _run("ip", "-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", self.interface)
            _run("ip", "-n", ns, "link", "set", self.interface, "up")
            _run("ip", "-n", self.switch, "link", "set", peer, "master", "br0")
            _run("ip", "-n", self.switch, "link", "set", peer, "up")
            if self.bandwidth is not None:
                for where, dev in ((ns, self.interface), (self.switch, peer)):
                    _run("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root",
                         "tbf", "rate", self.bandwidth, "burst", "512kb", "latency", "100ms")

    def teardown(self) -> None:
        """Delete every namespace this cluster made (their links go with them)."""
        while self._made:
            ns = self._made.pop()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def rank_environment(self, rank: int) -> dict[str, str]:
        """What a rank needs to join the world from inside its node's namespace."""
        return {"MC2_NETNS": self.node_ns(rank // self.ranks_per_node),
                "MASTER_ADDR": self.address(0), "GLOO_SOCKET_IFNAME": self.interface}


def torchrun_on_nodes(cluster: EmulatedCluster, program: list[str], *, port: int = 29611,
                      timeout_s: float = 3600.0) -> None:
    """Run ``torchrun --nnodes <nodes> ... <program>`` with one agent inside each node.

    A real multi-node launch: each agent runs in its node's namespace, the agents meet through
    torchrun's c10d rendezvous at node 0's address across the shaped link, and torchrun numbers
    the ranks node by node (so EP groups of ``ranks_per_node`` stay inside a node). Gloo binds
    to the node's interface. If one agent fails, or ``timeout_s`` passes, every agent is
    killed with its workers.

    Args:
        program: what follows the torchrun options, e.g. ``["-m", "mc2.tools.train", "--steps", "5"]``.

    Raises:
        NetnsError: an agent failed or the run timed out.
    """
    env = {**os.environ, "GLOO_SOCKET_IFNAME": cluster.interface}
    agents = []
    for node in range(cluster.nodes):
        cmd = ["ip", "netns", "exec", cluster.node_ns(node), sys.executable, "-m",
               "torch.distributed.run", "--nnodes", str(cluster.nodes),
               "--nproc-per-node", str(cluster.ranks_per_node), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"{cluster.address(0)}:{port}", "--rdzv-id", cluster.prefix,
               "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}",
               "--local-addr", cluster.address(node), "--max-restarts", "0", *program]
        agents.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            codes = [a.poll() for a in agents]
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                raise NetnsError(f"torchrun on node {failed[0]} exited with {codes[failed[0]]}")
            if None not in codes:
                return
            if time.monotonic() > deadline:
                raise NetnsError(f"torchrun across {cluster.nodes} nodes passed {timeout_s:.0f}s")
            time.sleep(0.2)
    finally:
        _stop(agents)


def _stop(agents: list[subprocess.Popen]) -> None:
    """SIGTERM first (torchrun then ends its workers), SIGKILL what is left after 10 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [a for a in agents if a.poll() is None]
        for agent in alive:
            try:
                os.killpg(agent.pid, sig)
            except ProcessLookupError:
                pass
        for agent in alive:
            try:
                agent.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def enter_namespace(name: str) -> None:
    """Move this process into network namespace ``name`` (before it opens any socket)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise NetnsError(f"setns into {name} failed: {os.strerror(err)}")
    finally:
        os.close(fd)


def leftover_namespaces(prefix: str = "mc2-") -> list[str]:
    """Namespaces whose name starts with ``prefix`` (for checks that nothing is left behind)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]
