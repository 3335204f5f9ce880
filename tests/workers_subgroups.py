"""Rank functions for expert-parallel groups that are subgroups of a larger world."""

from __future__ import annotations

import os
from typing import Any

from datetime import timedelta

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
