"""Work of mc2's own that leaves the caller's random numbers as they were.

Why: mc2 times work it makes up (the planner's calibration, the GEMM strategy's trial): random
rows, a permutation, and a module stage's own forward (dropout inside it). Drawn from the
global generators, these moved the user's random stream by a number of draws that depends on
timing (a line grows until it stands out of the noise): with the same seed, dropout masks
differed between runs and between ranks under ``micro_batches="auto"`` where they did not at
a fixed K (found by a review). Run inside :func:`kept_rng`, the draws happen on forked
generators, and the caller's continue as if none had been made.
"""

from __future__ import annotations

from typing import ContextManager

import torch

from mc2.device.streams import full_device


def kept_rng(device: torch.device) -> ContextManager[None]:
    """The CPU generator, and ``device``'s where it is an accelerator, restored on exit."""
    device = full_device(device)  # an accelerator's index: the current one where unnamed
    if device.type in ("cpu", "meta"):
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device.index], device_type=device.type)
