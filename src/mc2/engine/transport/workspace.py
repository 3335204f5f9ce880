"""Buffers that stay put: a pool of flat tensors reused across calls and micro-batches.

Why: a forward + backward of :func:`mc2.fused_expert` needs tens of large temporaries (send and
receive rows, gate/up projections, weight gradients). With the CPU's default allocator (glibc),
blocks above its mmap threshold are returned to the kernel when freed and page-faulted back in,
zeroed, on the next call: measured here that costs more than 10% of a step, and it depends on
the process's malloc settings. This pool avoids it on the CPU, so speed does not depend on how
the process was started.

On accelerators the pool is off and every request goes to the device's caching allocator,
which already keeps freed blocks and, unlike a pool that reuses a buffer as soon as Python holds
no reference to it, knows which stream last used a block: a buffer read by a collective on a
communication stream, or by a side stream, is not handed out again until that stream is past it.

How a buffer comes back: the pool hands out tensors that share the storage of a pooled flat
buffer (not views of it, so autograd treats them as ordinary tensors and may keep a returned
gradient as ``.grad`` without a copy). A buffer is free again when nothing but the pool holds its
storage, i.e. every tensor handed out over it, and everything derived from those, is gone.
There is no explicit release, and so no way to release a buffer that is still in use.

Sizes are rounded up to 1/16 of their power of two, and a free buffer serves any request that
fits within 25% of it, so routing that changes a little from step to step reuses the same
buffers. Free buffers that no call used during the last ``max_idle_calls`` calls are dropped
(a steady state uses every buffer in every call, so only leftovers of other shapes go: a
changed batch, or ``"auto"`` trying another K).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mc2.engine.transport.sizes import bucket

_SMALL = 1 << 14  # elements; smaller requests go to the allocator directly
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _only_pool_holds(buffer: Tensor) -> bool:
    # 2 = the pool's tensor + the temporary storage object made by this query
    return _use_count is not None and _use_count(buffer.untyped_storage()._cdata) <= 2


@dataclass
class _Slot:
    buffer: Tensor
    last_call: int


class Workspace:
    """A per-process pool of reusable buffers (see the module docstring).

    Args:
        max_idle_calls: drop free buffers not used during this many calls of :meth:`tick`.
        enabled: ``False`` allocates every request anew (for comparisons).
    """

    def __init__(self, max_idle_calls: int = 2, enabled: bool = True) -> None:
        self.max_idle_calls = max_idle_calls
        self.enabled = enabled and _use_count is not None
        self._slots: dict[tuple[torch.dtype, torch.device], list[_Slot]] = {}
        self._calls = 0
        self.allocations = 0  # buffers created so far (a steady state adds none)

    @staticmethod
    def transient() -> "Workspace":
        """A pool that never reuses: plain allocation, for one-off callers."""
        return _TRANSIENT

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
              ) -> Tensor:
        """An uninitialised tensor of ``shape``, from a free pooled buffer when one fits."""
        numel = math.prod(shape)
        device = torch.device(device)
        if not self.enabled or numel < _SMALL or device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        slots = self._slots.setdefault((dtype, device), [])
        fits = [s for s in slots if numel <= s.buffer.numel() <= numel + numel // 4 + _SMALL
                and _only_pool_holds(s.buffer)]
        best = min(fits, key=lambda s: s.buffer.numel(), default=None)
        if best is None:
            self._drop_idle(current_call_only=True)
            slots = self._slots.setdefault((dtype, device), [])
            best = _Slot(torch.empty(bucket(numel), dtype=dtype, device=device), self._calls)
            slots.append(best)
            self.allocations += 1
        best.last_call = self._calls
        out = torch.empty(0, dtype=dtype, device=device)
        out.set_(best.buffer.untyped_storage(), 0, shape)
        return out

    def tick(self) -> None:
        """One call finished: forget buffers that were free and unused for too long."""
        self._calls += 1
        self._drop_idle(current_call_only=False)

    def _drop_idle(self, *, current_call_only: bool) -> None:
        """Forget free buffers unused for ``max_idle_calls`` calls, or (before allocating a new
        one) every free buffer not used since the last call ended: a request that fits no
        free buffer means the shapes changed, and the old ones should not stay beside the new."""
        limit = 0 if current_call_only else self.max_idle_calls
        for key, slots in self._slots.items():
            self._slots[key] = [s for s in slots if self._calls - s.last_call <= limit
                                or not _only_pool_holds(s.buffer)]

    def clear(self) -> None:
        """Drop every pooled buffer (tensors still in use stay valid)."""
        self._slots.clear()


_TRANSIENT = Workspace(enabled=False)


@functools.cache
def default_workspace() -> Workspace:
    """The process's shared pool, made on first use (``mc2.fused_expert``'s default)."""
    return Workspace()
