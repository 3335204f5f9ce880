"""``out (+)= grouped_mm(a, b, offs)`` into a buffer the caller owns.

Why: ``torch.nn.functional.grouped_mm`` returns a fresh tensor. On an accelerator that is one
more block from the caching allocator; on the CPU a fresh block above glibc's mmap threshold is
page-faulted in, zeroed, on every call, and for the weight gradients of capacity mode (every
local expert's gradient written, whatever the routing) that cost more than the GEMMs themselves
(docs/accelerators.md). Writing into pooled buffers (:mod:`mc2.engine.transport.workspace`)
avoids it.

One operator, two kernels:

- on the CPU, one ``mm`` per group straight into ``out``: the group bounds are read from
  ``offs``, as torch's own CPU ``grouped_mm`` reads them (a CPU tensor *is* on the host, so the
  read stalls nothing);
- elsewhere, ``grouped_mm`` itself, then a copy (or add) into ``out``: no host read, fixed
  shapes, what a CUDA graph can capture.

The operator is opaque to ``TorchFunctionMode``s, so :class:`mc2.observation.host_syncs.HostSyncCounter`
counts what the caller does, the same on every device, as it does around torch's own kernels.

Two forms, as ``grouped_mm``'s: ``a [M, K]`` rows grouped by ``offs``, ``b [G, K, N]`` ->
``out [M, N]`` (rows past the last group hold no result: the CPU kernel leaves them as they
are, ``grouped_mm`` leaves them unwritten and the copy brings that in, so callers mask them);
and ``a [M, P]``, ``b [P, N]`` grouped along ``P`` -> ``out [G, M, N]`` (an empty group's
block is zero, or kept when adding: set to zero here where the device's ``grouped_mm`` is not
known to write zeros, :func:`zeroes_empty_groups`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor


@functools.cache
def zeroes_empty_groups(device: torch.device) -> bool:
    """Whether ``grouped_mm`` on ``device`` writes zeros for an empty group in the form
    grouped along the inner dimension (the weight gradients): known on Hopper (compute
    capability 9.x). Blackwell's kernels (10.x) leave them non-zero (pytorch/pytorch#172439,
    open): an expert that got no row would get a gradient anyway. Elsewhere unknown: not
    trusted, ROCm's included (its device type is ``"cuda"`` too, and an MI300 reports a
    major of 9). A host fact of the device, so no read of the device and nothing a capture
    forbids."""
    return device.type == "cuda" and torch.version.hip is None \
        and torch.cuda.get_device_capability(device)[0] == 9


def empty_groups_zeroed(result: Tensor, offs: Tensor) -> Tensor:
    """``result [G, M, N]`` with the blocks of the groups ``offs`` leaves empty set to zero
    (on the device: no count is read)."""
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    return torch.where((sizes > 0).view(-1, 1, 1), result, 0)


@torch.library.custom_op("mc2::grouped_mm_into", mutates_args=("out",))
def grouped_mm_into(a: Tensor, b: Tensor, offs: Tensor, out: Tensor, accumulate: bool) -> None:
    """``out (+)= grouped_mm(a, b, offs=offs)`` (see the module docstring)."""
    result = F.grouped_mm(a, b, offs=offs)
    if b.dim() == 2 and not zeroes_empty_groups(result.device):
        result = empty_groups_zeroed(result, offs)
    out.add_(result) if accumulate else out.copy_(result)


@grouped_mm_into.register_kernel("cpu")
def _on_cpu(a: Tensor, b: Tensor, offs: Tensor, out: Tensor, accumulate: bool) -> None:
    by_rows = b.dim() == 3
    start = 0
    for group, end in enumerate(offs.tolist()):
        if by_rows:
            target, left, right = out[start:end], a[start:end], b[group]
        else:
            target, left, right = out[group], a[:, start:end], b[start:end]
        # an empty group: nothing to do, except an empty weight block, which is zero (``mm``
        # over an empty inner dimension writes zeros)
        if end > start or not (by_rows or accumulate):
            if accumulate:
                target.addmm_(left, right)
            else:
                torch.mm(left, right, out=target)
        start = end


@grouped_mm_into.register_fake
def _shapes(a: Tensor, b: Tensor, offs: Tensor, out: Tensor, accumulate: bool) -> None:
    return None
