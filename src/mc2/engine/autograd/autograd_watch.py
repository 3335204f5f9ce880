"""Autograd run inside a forward, where a paired forward could not run it.

On an accelerator autograd runs a backward in a device thread of its own (one per device).
Under a pairing that thread runs micro-batch n's backward, and it stops, inside the backward,
each time it gives way to micro-batch n+1's forward in the partner thread. A forward that
runs autograd itself (``torch.autograd.grad`` for a chunked loss, ``.backward()`` of a part)
hands its accelerator work to that same device thread, which is stopped until the forward
hands back: neither moves again, and the step hangs. On a CPU autograd runs in the calling
thread, and nothing waits.

So the step's first forward, which runs alone in the caller's thread, is watched for such a
call (:class:`AutogradWatch`, a ``TorchFunctionMode``, installed only where an accelerator
is present, so a CPU run pays nothing): every micro-batch's forward is the same ``loss_fn``,
so a call in the first is a call in the others, and the step can refuse (or run unpaired)
before any forward runs beside a backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

_ENTRIES = {torch.Tensor.backward: "Tensor.backward", torch.autograd.backward:
            "torch.autograd.backward", torch.autograd.grad: "torch.autograd.grad"}


def in_a_device_thread(device: torch.device) -> bool:
    """Whether autograd runs the backward of tensors on ``device`` in a device thread of its
    own (every device but the CPU's; meta tensors run no backward)."""
    return device.type not in ("cpu", "meta")


def watched() -> bool:
    """Whether a first forward is watched at all: only where an accelerator is present."""
    return torch.accelerator.is_available()


class AutogradWatch(TorchFunctionMode):
    """Notes the first autograd call (``Tensor.backward``, ``torch.autograd.backward`` or
    ``.grad``) made on tensors autograd would hand to a device thread: :attr:`seen`, as
    ``"torch.autograd.grad on cuda:0"``; ``None`` while there was none."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: str | None = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.seen is None and func in _ENTRIES:
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor) and in_a_device_thread(leaf.device):
                    self.seen = f"{_ENTRIES[func]} on {leaf.device}"
                    break
        return func(*args, **kwargs)
