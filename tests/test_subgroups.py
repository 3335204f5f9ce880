"""Expert-parallel groups inside a larger world, as users run them (DP x EP across nodes).

8 Gloo ranks presented as 2 nodes x 4 (``LOCAL_WORLD_SIZE=4``), two EP groups of 4 that span
both nodes ({0,1,4,5} and {2,3,6,7}), both running at once: the flat, 2-D and measured
(``"auto"``) exchanges, rows once per destination across nodes, and capacity mode, each group's
result against its own dense reference. Before the 2-D exchange's node groups were made by
the EP group's members alone, the first group timed out in the counts gather and hung.
"""

from __future__ import annotations

import pytest

import mc2
from tests.problems import make_problem
from tests.test_fused_expert_distributed import assert_ranks_match
from tests.workers_subgroups import EP_TIMEOUT_S, cases_in_ep_groups

EP_GROUPS = [[0, 1, 4, 5], [2, 3, 6, 7]]
OPTIONS = [
    {"micro_batches": 2, "hierarchy": "flat"},
    {"micro_batches": 2, "hierarchy": "2d"},
    {"micro_batches": 3, "hierarchy": "2d", "overlap": False},
    {"micro_batches": "auto", "hierarchy": "auto"},
    {"micro_batches": 2, "hierarchy": "2d", "dedup": True},
    {"micro_batches": 1, "capacity": 64},
]
ROUTINGS = ("uniform", "uneven")


def _problems(group: int) -> list:
    return [make_problem(4, routing, seed=10 * group + i)
            for i, routing in enumerate(ROUTINGS) for _ in OPTIONS]


@pytest.fixture(scope="module")
def results():
    cases = [[(p, o) for p, o in zip(_problems(g), OPTIONS * len(ROUTINGS))]
             for g in range(len(EP_GROUPS))]
    return mc2.run_local(cases_in_ep_groups, 8, args=(4, EP_GROUPS, cases), ranks_per_node=4,
                         timeout_s=60, deadline_s=300)


@pytest.mark.parametrize("group", range(len(EP_GROUPS)))
def test_each_ep_group_equals_its_dense_reference(results, group: int) -> None:
    problems = _problems(group)
    for i, (problem, options) in enumerate(zip(problems, OPTIONS * len(ROUTINGS))):
        got = [results[rank][i] for rank in EP_GROUPS[group]]
        assert_ranks_match(got, problem, f"EP group {group} {options}")
    for rank in EP_GROUPS[group]:  # the node groups wait as long as their EP group
        assert results[rank][-1]["node_group_timeouts"] == (EP_TIMEOUT_S,) * 2, results[rank][-1]


def test_a_groups_state_is_dropped_with_the_group() -> None:
    """The engine's per-group state (:mod:`mc2.engine.transport.group_state`) is filled by the
    calls on a group and goes when ``destroy_process_group`` drops it; the world's stays."""
    from tests.workers_subgroups import state_goes_with_group

    p = make_problem(2, "uniform", tokens=16, seed=2)
    for r in mc2.run_local(state_goes_with_group, 2, args=(p,), deadline_s=120):
        assert all(r["filled"].values()), r["filled"]
        assert r["dropped"], "the destroyed group's state is still held"
        assert r["world_kept"]
