"""Gradient sync that runs during the backward, in buckets, as DDP's does.

:func:`mc2.average_gradients` waits for the whole backward, then sends every gradient. Here a
hook on each parameter notes when its gradient is complete. As soon as a bucket (about
``bucket_mb`` of gradients of one sync class, in reverse registration order, which is roughly
the order the backward produces them) is complete, its all-reduce starts asynchronously, and
the backward goes on with the layers below. :meth:`GradientSync.wait` is what is left: it waits
for the buckets in flight, starts any that never completed (parameters this backward did not
reach count as zero), and writes the averaged gradients back.

Buckets start strictly in one order that every rank shares. So ranks whose hooks fire at
different moments still pair their collectives correctly. The sync uses process groups of its
own, made at construction, so its collectives never interleave with the All-to-Alls that
``mc2.fused_expert`` runs on the EP group from the same backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mc2.parallel.grad_sync import SyncClass, divide_grads, flat_grads, sync_classes, write_back


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    group: Any
    divide_by: int
    ready: set[int] = field(default_factory=set)
    nbytes: int = 0  # while it fills
    flat: Tensor | None = None
    work: Any = None

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)


def _own_groups(groups: list[Any]) -> dict[int, Any]:
    """A new process group for each of ``groups``, with the same ranks.

    ``new_group`` must be called by every rank for every group, in one order; each rank knows
    only its own groups (its DP group, say), so the ranks first tell each other theirs.
    """
    world = dist.get_world_size()
    mine = [tuple(dist.get_process_group_ranks(g)) if g is not None else tuple(range(world))
            for g in groups]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    made = {ranks: dist.new_group(list(ranks))
            for ranks in sorted({r for theirs in everyone for r in theirs})}
    return {id(g): made[ranks] for g, ranks in zip(groups, mine)}


class GradientSync:
    """Average gradients over the ranks while the backward still runs.

    Usage::

        sync = mc2.GradientSync(model, mesh=mesh)  # once, on every rank
        for batch in data:
            loss = model(batch).loss
            loss.backward()
            sync.wait()          # gradients are now those of the mean loss
            optimizer.step()
            optimizer.zero_grad()

    ``wait()`` replaces :func:`mc2.average_gradients` (same arguments, same result). For
    gradient accumulation, run every backward but the last inside ``with sync.no_sync():``.

    Args:
        model, group, mesh: as for :func:`mc2.average_gradients`.
        bucket_mb: bucket size; smaller starts sooner, larger sends fewer messages.
    """

    def __init__(self, model: nn.Module, group: Any = None, *, mesh: Any = None,
                 bucket_mb: float = 8.0) -> None:
        classes = sync_classes(model, group, mesh=mesh)
        self._divide_only = [c for c in classes if not c.summed]
        own = _own_groups([c.group for c in classes if c.summed]) if classes else {}
        self._buckets = self._make_buckets([c for c in classes if c.summed], own,
                                           int(bucket_mb * 2 ** 20))
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        self._next = 0  # buckets start in list order on every rank
        self._armed = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for b in self._buckets for p in b.params]

    @staticmethod
    def _make_buckets(classes: list[SyncClass], own: dict[int, Any], limit: int
                      ) -> list[_Bucket]:
        """Walk the parameters backwards; each class fills its own buckets of one dtype."""
        open_: dict[tuple[int, torch.dtype], _Bucket] = {}
        buckets: list[_Bucket] = []
        for c, p in reversed([(k, q) for k in classes for q in k.params]):
            key = (id(c.group), p.dtype)
            bucket = open_.setdefault(key, _Bucket([], own[id(c.group)], c.divide_by))
            bucket.params.append(p)
            bucket.nbytes += p.numel() * p.element_size()
            if bucket.nbytes >= limit:
                buckets.append(open_.pop(key))
        buckets.extend(open_.values())
        return buckets

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._armed:
            return
        bucket = self._bucket_of[id(p)]
        if bucket.flat is not None:
            raise RuntimeError("GradientSync: a second backward reached a bucket already sent; "
                               "run all but the last accumulation step inside sync.no_sync()")
        bucket.ready.add(id(p))
        self._start_ready()

    def _start_ready(self, force: bool = False) -> None:
        while self._next < len(self._buckets):
            bucket = self._buckets[self._next]
            if not (force or bucket.complete):
                return
            bucket.flat = flat_grads(bucket.params)
            bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)
            self._next += 1

    def wait(self) -> None:
        """Finish the sync of this backward: every gradient is then the mean loss's."""
        self._start_ready(force=True)
        for bucket in self._buckets:
            bucket.work.wait()
            write_back(bucket.params, bucket.flat, bucket.divide_by)
            bucket.flat, bucket.work = None, None
            bucket.ready.clear()
        self._next = 0
        for c in self._divide_only:
            divide_grads(c.params, c.divide_by)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate locally; the next one outside syncs the sum."""
        self._armed = False
        try:
            yield
        finally:
            self._armed = True

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
