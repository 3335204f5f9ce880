"""Which ranks share a node: the fast link inside, the slow link between.

Discovery, in order: ``LOCAL_WORLD_SIZE`` (set by ``torchrun`` and by :func:`mc2.run_local`,
whose ranks are numbered node by node), else the host names of all ranks (a collective). The
intra-node and inter-node sub-groups that a hierarchical All-to-All needs are made on request,
once, by the group's members alone (:func:`mc2.engine.transport.comm.member_groups`), so an
expert-parallel group inside a larger mesh makes them without the other groups' ranks.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from mc2.engine.transport.comm import (
    gather_objects, group_rank, group_size, host_ranges, member_groups
)
from mc2.engine.transport.group_state import group_state


@dataclass
class Topology:
    """Node membership of the ranks of one process group.

    Attributes:
        node_of_rank: node index of every group rank (nodes numbered by first appearance).
        rank: this process's rank in the group.
        source: how it was discovered ("env", "hostname" or "single").
    """

    node_of_rank: list[int]
    rank: int
    source: str
    _groups: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def nodes(self) -> int:
        return max(self.node_of_rank) + 1 if self.node_of_rank else 1

    @property
    def node(self) -> int:
        return self.node_of_rank[self.rank]

    def ranks_of_node(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of_rank) if n == node]

    @property
    def local_rank(self) -> int:
        return self.ranks_of_node(self.node).index(self.rank)

    @property
    def uniform(self) -> bool:
        """Every node holds the same number of ranks, numbered node by node: what a 2-D
        All-to-All needs (its plan takes a rank's node and local rank as ``divmod`` of its
        rank; ranks dealt to hosts in turn, ``A, B, A, B``, made ranks meet in different
        exchanges and raise different errors; found by a review)."""
        return (len({len(self.ranks_of_node(n)) for n in range(self.nodes)}) == 1
                and self.node_of_rank == sorted(self.node_of_rank))

    def subgroups(self, group: Any = None) -> tuple[Any, Any]:
        """``(intra_node, inter_node)`` groups of this rank, made once (a collective of
        ``group``'s members).

        ``intra_node``: the ranks of this node; ``inter_node``: the ranks of every node with
        this local rank (the peers a 2-D All-to-All crosses the slow link with).
        """
        if "intra" not in self._groups:
            if not self.uniform:
                raise ValueError(f"a 2-D layout needs the same ranks per node, numbered node "
                                 f"by node: {self.describe()}")
            members = dist.get_process_group_ranks(group or dist.group.WORLD)
            per_node = [[members[r] for r in self.ranks_of_node(n)] for n in range(self.nodes)]
            across = [[ranks[local] for ranks in per_node] for local in range(len(per_node[0]))]
            made = member_groups(group or dist.group.WORLD, per_node + across)
            self._groups["intra"] = made[self.node]
            self._groups["inter"] = made[len(per_node) + self.local_rank]
        return self._groups["intra"], self._groups["inter"]

    def describe(self) -> str:
        sizes = [len(self.ranks_of_node(n)) for n in range(self.nodes)]
        return (f"{len(self.node_of_rank)} ranks on {self.nodes} node(s) {sizes}, this is rank "
                f"{self.rank} = node {self.node} local rank {self.local_rank} (from {self.source})")


def discover(group: Any = None) -> Topology:
    """The node layout of ``group``: from ``LOCAL_WORLD_SIZE`` where every rank's says the
    same (agreed: host numbers, one ``all_reduce``), else from the hosts' names. torchrun sets
    it per node, so nodes of different sizes differ; before, the ranks whose value did not
    divide the world gathered names while the others went on to their dispatch, and every
    rank waited out the group's timeout."""
    world, rank = group_size(group), group_rank(group)
    if world == 1:
        return Topology([0], 0, "single")
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    size = int(local) if local.isdigit() and int(local) > 0 \
        and dist.get_world_size() % int(local) == 0 else 0
    ((smallest, largest),) = host_ranges([size], group, "topology")
    if size and smallest == largest:
        # the world's node of each member, numbered by first appearance within the group
        # (global numbers made a subgroup of nodes 0 and 2 a layout of three nodes)
        nodes = [r // size for r in dist.get_process_group_ranks(group or dist.group.WORLD)]
        return Topology(_numbered(nodes), rank, "env")
    return Topology(_numbered(gather_objects(socket.gethostname(), group)), rank, "hostname")


def _numbered(nodes: list[Any]) -> list[int]:
    """Each rank's node as an index, nodes numbered by first appearance."""
    order = {n: i for i, n in enumerate(dict.fromkeys(nodes))}
    return [order[n] for n in nodes]


def topology_for(group: Any = None) -> Topology:
    """:func:`discover` once per group (cached with its sub-groups; every rank calls it)."""
    found, local = group_state(group).topologies, os.environ.get("LOCAL_WORLD_SIZE")
    if local not in found:
        found[local] = discover(group)
    return found[local]
