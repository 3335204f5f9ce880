"""Rank functions for expert-parallel groups that are subgroups of a larger world."""

from __future__ import annotations

import os
from typing import Any

from datetime import timedelta

import torch
import torch.distributed as dist

from tests.problems import Problem
from tests.workers import run_cases

EP_TIMEOUT_S = 45.0  # the EP groups' own timeout (not the world's 60 s, nor torch's 30 min)


def ep_group_of(rank: int, ep_groups: list[list[int]]) -> tuple[Any, int]:
    """Every rank makes every EP group, in one order (``new_group`` is a world collective);
    returns this rank's group and its index in ``ep_groups``."""
    made = [dist.new_group(ranks, timeout=timedelta(seconds=EP_TIMEOUT_S)) for ranks in ep_groups]
    index = next(i for i, ranks in enumerate(ep_groups) if rank in ranks)
    return made[index], index


def cases_in_ep_groups(rank: int, world: int, local_world: int, ep_groups: list[list[int]],
                       cases: list[list[tuple[Problem, dict[str, Any]]]]) -> list[dict]:
    """:func:`run_cases` of ``cases[g]`` on EP group ``g`` (this rank's), with the ranks
    presented as nodes of ``local_world`` ranks; every group runs at the same time."""
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
    group, index = ep_group_of(rank, ep_groups)
    member = ep_groups[index].index(rank)
    mine = [(problem, {**options, "group": group}) for problem, options in cases[index]]
    results = run_cases(member, len(ep_groups[index]), mine)
    from mc2.engine.transport.deadline import group_timeout
    from mc2.engine.transport.topology import topology_for

    intra, inter = topology_for(group).subgroups(group)  # made by the 2-D cases already
    return results + [{"node_group_timeouts": (group_timeout(intra), group_timeout(inter))}]


def state_goes_with_group(rank: int, world: int, problem: Any) -> dict:
    """Calls on a subgroup fill its state (planner, agreed capacity configuration, control
    communicator, topology); destroying the group drops the state."""
    import gc
    import weakref

    import mc2
    from mc2.engine.decide.call_plan import AgreedCapacity
    from mc2.engine.decide.planner import Planner
    from mc2.engine.transport import group_state

    sub = dist.new_group(list(range(world)))
    args = (problem.xs[rank], *problem.local_weights(rank), problem.ids[rank], problem.rws[rank])
    with torch.no_grad():
        mc2.fused_expert(*args, group=sub, micro_batches="auto")
        mc2.fused_expert(*args, group=sub, micro_batches=1, capacity=64)
        mc2.fused_expert(*args, group=sub, micro_batches=2, hierarchy="auto")
    state = group_state.known_state(sub)
    filled = {"planner": state.held(Planner) is not None,
              "agreed": bool(state.held(AgreedCapacity)),
              "control": state.control is not None, "topology": bool(state.topologies)}
    world_state = group_state.known_state(None)
    ref = weakref.ref(state)
    dist.destroy_process_group(sub)
    del sub, state
    gc.collect()
    return {"filled": filled, "dropped": ref() is None,
            "world_kept": group_state.known_state(None) is world_state}
