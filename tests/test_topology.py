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


def subgroup_layout(rank: int, world: int) -> dict:
    """8 ranks as 4 nodes of 2 (``LOCAL_WORLD_SIZE``), an EP group of nodes 0 and 2 and one
    of nodes 1 and 3: each group's layout and a 2-D call's error, if any."""
    import torch.distributed as dist

    from mc2.engine.transport.topology import topology_for
    from tests.problems import make_problem

    members = [[0, 1, 4, 5], [2, 3, 6, 7]]
    groups = [dist.new_group(m) for m in members]
    mine = next(i for i, m in enumerate(members) if rank in m)
    p, me = make_problem(4, "uniform", seed=3), members[mine].index(rank)
    error = None
    try:
        mc2.fused_expert(p.xs[me], *p.local_weights(me), p.ids[me], p.rws[me],
                         group=groups[mine], hierarchy="2d", micro_batches=2)
    except ValueError as exc:
        error = str(exc)
    topo = topology_for(groups[mine])
    return {"nodes": topo.node_of_rank, "error": error}


def test_a_subgroup_numbers_its_own_nodes() -> None:
    """Node numbers from ``LOCAL_WORLD_SIZE`` were the world's: a group of nodes 0 and 2
    read as three nodes of [2, 0, 2] ranks, so ``"2d"`` raised and ``"auto"`` stayed flat
    (found by a review). Numbered within the group: 2 nodes of 2, and the 2-D call runs."""
    for r in mc2.run_local(subgroup_layout, 8, ranks_per_node=2, timeout_s=60):
        assert r == {"nodes": [0, 0, 1, 1], "error": None}, r


def dealt_hosts(rank: int, world: int) -> str | None:
    """Ranks dealt to hosts A, B, A, B (no ``LOCAL_WORLD_SIZE``): a 2-D call's error."""
    import socket

    from tests.problems import make_problem

    os.environ.pop("LOCAL_WORLD_SIZE", None)
    socket.gethostname = lambda: "AB"[rank % 2]
    p = make_problem(world, "uniform", seed=3)
    try:
        mc2.fused_expert(p.xs[rank], *p.local_weights(rank), p.ids[rank], p.rws[rank],
                         hierarchy="2d", micro_batches=2)
    except ValueError as exc:
        return str(exc)
    return None


def test_ranks_dealt_to_hosts_in_turn_refuse_2d_on_every_rank() -> None:
    """The 2-D plan takes a rank's node and local rank as ``divmod`` of its rank: ranks dealt
    to hosts in turn met in different exchanges and raised different errors (Gloo's size
    check on two, a timeout on the others; found by a review). Now a ``ValueError`` on every
    rank, naming why."""
    for error in mc2.run_local(dealt_hosts, 4, timeout_s=30):
        assert error is not None and "numbered node by node" in error, error
