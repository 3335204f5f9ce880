"""Topology discovery and the intra-/inter-node sub-groups, on 4 ranks as 2 nodes x 2."""

from __future__ import annotations

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
