"""Topology discovery and the intra-/inter-node sub-groups, on 4 ranks as 2 nodes x 2."""

from __future__ import annotations

import os

import mc2
from tests.workers import topology_of


def test_two_nodes_of_two() -> None:
    results = mc2.run_local(topology_of, 4, args=(2,))
    for rank, r in enumerate(results):
        assert (r["nodes"], r["node"], r["local"]) == (2, rank // 2, rank % 2)
        node_ranks = [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert r["intra_sum"] == sum(node_ranks)
        assert r["inter_sum"] == (rank % 2) + (rank % 2 + 2)
        assert "2 node(s) [2, 2]" in r["text"]


def test_single_process_is_one_node() -> None:
    topo = mc2.engine.transport.topology.discover()
    assert (topo.nodes, topo.node, topo.local_rank, topo.source) == (1, 0, 0, "single")


def uneven_nodes(rank: int, world: int) -> tuple[str, int]:
    """3 ranks whose ``LOCAL_WORLD_SIZE`` differ, as torchrun sets it on nodes of 2 and 1
    ranks: where each discovery looked and how many nodes it found."""
    os.environ["LOCAL_WORLD_SIZE"] = "1" if rank == 2 else "2"
    topo = mc2.engine.transport.topology.discover()
    return topo.source, topo.nodes


def test_nodes_of_different_sizes_agree_on_where_they_look() -> None:
    """Every rank takes the hosts' names (one host: one node). Before, ranks 0 and 1 (2 does
    not divide 3) gathered names while rank 2 took its environment and went on: every rank
    waited out the group's timeout."""
    for found in mc2.run_local(uneven_nodes, 3, timeout_s=30):
        assert found == ("hostname", 1), found
