"""What the engine keeps about each process group: one object per group, dropped with it.

Why: state kept in module tables keyed by a group's ranks outlived the group. A process that
makes and destroys groups (elastic restarts, tests, a notebook) kept every control
communicator, topology, planner, agreed capacity configuration and timeout it ever had, and a
group rebuilt over the same ranks inherited its predecessor's: a group that once timed out
was refused for good, even rebuilt. Here each live ``ProcessGroup`` owns one
:class:`GroupState` in a ``WeakKeyDictionary``: ``destroy_process_group`` (or the group's
collection) drops it. A state never holds its own group (that would keep the group alive);
it may hold other groups (its control communicator, its topology's sub-groups), which it
owns.

What a floor above keeps per group (the planner, the agreed capacity configurations, the
capacity counters) is its own type, held in :meth:`GroupState.of`'s slots: the transport
floor names none of them, and each owner reads its slot typed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


@dataclass
class GroupState:
    """One group's state in this process (see the module docstring).

    Attributes:
        control: the communicator of its control messages
            (:func:`~mc2.engine.transport.comm.control_group`), or ``None`` before the first.
        host: a Gloo group over its ranks, where host numbers are agreed on a group whose
            collectives take no CPU tensors (:func:`~mc2.engine.transport.comm.host_max`).
        topologies: its nodes and sub-groups (:func:`~mc2.engine.transport.topology.topology_for`),
            by ``LOCAL_WORLD_SIZE`` (what discovery reads first).
        two_stage: whether the 2-D exchange measured faster, by (rows per peer, row bytes)
            (:func:`~mc2.engine.transport.hierarchy.two_stage_pays`).
        failure: its first timeout: later operations on it are refused
            (:mod:`~mc2.engine.transport.deadline`).
        abandoned: transfers left in flight by a timeout, kept alive for good (their buffers
            may still be written).
        slots: what the floors above keep for the group, one object per type (:meth:`of`).
        carries_for: for a control communicator, the state of the group whose control
            messages it carries (weakly): a timeout on it is that group's timeout.
    """

    control: dist.ProcessGroup | None = None
    host: dist.ProcessGroup | None = None
    topologies: dict[str | None, Any] = field(default_factory=dict)
    two_stage: dict[tuple[int, int], bool] = field(default_factory=dict)
    failure: BaseException | None = None
    abandoned: list[Any] = field(default_factory=list)
    slots: dict[type, Any] = field(default_factory=dict)
    carries_for: "weakref.ref[GroupState] | None" = None

    def of(self, kind: type[T]) -> T:
        """The group's ``kind`` object, ``kind()`` made on first use."""
        if kind not in self.slots:
            self.slots[kind] = kind()
        return self.slots[kind]

    def held(self, kind: type[T]) -> T | None:
        """The group's ``kind`` object where one was made, else ``None`` (makes nothing)."""
        return self.slots.get(kind)

    def owner(self) -> "GroupState":
        """The state a timeout here belongs to: the carried group's, for a control
        communicator (its handshake timing out leaves that group unusable), else this one."""
        owner = self.carries_for() if self.carries_for is not None else None
        return owner if owner is not None else self


# the one table: a live group's state, dropped with the group; and the state of calls made
# without torch.distributed (one process, one "group")
_STATES: "weakref.WeakKeyDictionary[Any, GroupState]" = weakref.WeakKeyDictionary()
_WITHOUT_DISTRIBUTED = GroupState()


def _process_group(group: Any) -> Any:
    return group if group is not None else dist.group.WORLD


def group_state(group: Any) -> GroupState:
    """``group``'s state (``None``: the default group), made on first use."""
    if not (dist.is_available() and dist.is_initialized()):
        return _WITHOUT_DISTRIBUTED
    pg = _process_group(group)
    state = _STATES.get(pg)
    if state is None:
        state = _STATES[pg] = GroupState()
    return state


def known_state(group: Any) -> GroupState | None:
    """``group``'s state where one was made, else ``None`` (makes nothing)."""
    if not (dist.is_available() and dist.is_initialized()):
        return _WITHOUT_DISTRIBUTED
    return _STATES.get(_process_group(group))


def live_states() -> list[GroupState]:
    """The states of every live group (and of calls without ``torch.distributed``)."""
    return [*_STATES.values(), _WITHOUT_DISTRIBUTED]
