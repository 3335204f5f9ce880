"""Count the host synchronisations a piece of code would make on an accelerator, on any device.

On a GPU each device-to-host read (``.item()``, ``.tolist()``, ``.cpu()``, ``int(t)``, ``nonzero``,
``bincount``, ...) waits for every kernel queued before it, and each upload of host data is a
copy the stream must order. On a CPU neither costs anything, so a CPU test cannot *time* them,
but it can *count* them: :class:`HostSyncCounter` is a ``TorchFunctionMode`` that sees every
tensor operation and counts the ones that read back or upload, whatever the device. The count
is what the same code does on a GPU, so mc2's budget (two reads and one upload per forward and
backward of :func:`mc2.fused_expert`, none in the backward) is checked in CI without one.

Usage::

    with HostSyncCounter() as syncs:
        out = mc2.fused_expert(...)
    print(syncs.reads, syncs.uploads, syncs.where)
"""

from __future__ import annotations

import inspect
import traceback
import weakref
from collections import Counter
from typing import Any

import torch
import torch.autograd
from torch.overrides import TorchFunctionMode

# operations that copy device data to the host, or need its values there to run
READS = frozenset({
    "item", "tolist", "cpu", "numpy", "__int__", "__bool__", "__float__", "__index__",
    "__complex__", "nonzero", "argwhere", "bincount", "unique", "unique_consecutive",
    "masked_select", "equal", "allclose", "is_nonzero",
})
# factories that turn host data (Python lists, numbers, numpy arrays) into a tensor
FACTORIES = frozenset({"tensor", "as_tensor", "from_numpy", "asarray"})


def _name(func: Any) -> str:
    return getattr(func, "__name__", str(func))


def _boolean_index(args: tuple) -> bool:
    """``t[mask]``: a boolean index's size is only known on the host."""
    if len(args) < 2:
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)


class HostSyncCounter(TorchFunctionMode):
    """Counts device-to-host reads and host-to-device uploads of the code run inside it.

    Attributes:
        reads: device-to-host reads (operations in :data:`READS`, boolean-mask indexing,
            ``repeat_interleave`` without ``output_size``, copies to the CPU).
        uploads: tensors made from host data (:data:`FACTORIES` with non-tensor data) and
            copies of CPU tensors to another device (one upload where host data is made into
            a tensor and that tensor, pinned or not, is then copied to the device).
        by_op: counts per operation name (``"read:tolist"``, ``"upload:tensor"``, ...).
        where: the first mc2 (or caller) frame of each counted operation, for diagnostics.

    A backward run inside it (``Tensor.backward``, ``torch.autograd.backward``/``grad``) is
    counted too. A ``TorchFunctionMode`` belongs to the thread that enters it: work handed to
    another thread (mc2's communication thread for the 2-D exchange on Gloo) is not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self.where: list[str] = []
        self._depth = 0
        # CPU tensors made from host data (and their pinned copies): already counted as an
        # upload, so their copy to the device is the same upload, not another
        self._from_host: dict[int, weakref.ref] = {}

    @property
    def reads(self) -> int:
        return sum(n for op, n in self.by_op.items() if op.startswith("read:"))

    @property
    def uploads(self) -> int:
        return sum(n for op, n in self.by_op.items() if op.startswith("upload:"))

    def _kind(self, func: Any, args: tuple, kwargs: dict) -> str | None:
        name = _name(func)
        if name in READS:
            # a CPU tensor made from host data (a count list handed on as a tensor) is read
            # back without waiting for any device
            return None if args and self._made_from_host(args[0]) else "read"
        if name == "__getitem__" and _boolean_index(args):
            return "read"
        if name == "repeat_interleave":
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
                return "read"
        if name in FACTORIES and args and not isinstance(args[0], torch.Tensor):  # host data
            return "upload"
        if name in ("to", "cuda", "copy_"):
            kind = self._copy_kind(name, args, kwargs)
            source = args[1] if name == "copy_" and len(args) > 1 else args[0] if args else None
            return None if kind == "upload" and self._made_from_host(source) else kind
        return None

    def _made_from_host(self, t: Any) -> bool:
        ref = self._from_host.get(id(t)) if isinstance(t, torch.Tensor) else None
        return ref is not None and ref() is t

    def _track(self, name: str, args: tuple, kind: str | None, result: Any) -> None:
        """Remember the CPU tensors that carry host data on its way to the device."""
        if not isinstance(result, torch.Tensor) or result.device.type != "cpu":
            return
        made = kind == "upload" and name in FACTORIES
        if made or (name in ("pin_memory", "to", "contiguous")
                    and args and self._made_from_host(args[0])):
            self._from_host[id(result)] = weakref.ref(result)

    @staticmethod
    def _copy_kind(name: str, args: tuple, kwargs: dict) -> str | None:
        source = args[0] if args else None
        if not isinstance(source, torch.Tensor):
            return None
        if name == "copy_":
            other = args[1] if len(args) > 1 else kwargs.get("src")
            if isinstance(other, torch.Tensor) and other.device != source.device:
                return "read" if source.device.type == "cpu" else "upload"
            return None
        target = kwargs.get("device")
        for a in args[1:]:
            if isinstance(a, (str, torch.device)):
                target = a
            elif isinstance(a, torch.Tensor):
                target = a.device
        if name == "cuda":
            target = "cuda"
        if target is None or torch.device(target).type == source.device.type:
            return None
        return "read" if torch.device(target).type == "cpu" else "upload"

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _AUTOGRAD_ENTRIES:
            return self._backward(func, args, kwargs)
        kind = None
        if self._depth == 0:  # count what the code asks for, not what torch does inside
            kind = self._kind(func, args, kwargs)
            if kind is not None:
                self.by_op[f"{kind}:{_name(func)}"] += 1
                self.where.append(f"{kind}:{_name(func)} at {_caller()}")
        self._depth += 1
        try:
            result = func(*args, **kwargs)
        finally:
            self._depth -= 1
        if self._depth == 0:
            self._track(_name(func), args, kind, result)
        return result

    def _backward(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run a backward (``Tensor.backward``, ``torch.autograd.backward`` or ``.grad``) with
        this counter on inside it.

        Torch hands a mode each of these as one call and takes the mode off its stack while it
        handles it, so every Function's backward the engine then runs would go uncounted (the
        backward would always count 0). The counter puts itself back on and calls
        ``torch.autograd.backward`` / ``.grad`` past their own check for modes (which would
        hand the call straight back here); everything the backward does is then counted like
        any other code. A backward started inside one re-enters here the same way.
        """
        if func is torch.Tensor.backward:
            bound = _TENSOR_BACKWARD.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            func, args, kwargs = torch.autograd.backward, (a["self"], a["gradient"]), {
                "retain_graph": a["retain_graph"], "create_graph": a["create_graph"],
                "inputs": a["inputs"]}
        checks = torch.autograd.has_torch_function

        def past_the_entry(*a: Any) -> bool:  # only the entry's own check: the first call
            torch.autograd.has_torch_function = checks
            return False

        depth, self._depth = self._depth, 0
        torch.autograd.has_torch_function = past_the_entry
        try:
            with self:
                return func(*args, **kwargs)
        finally:
            torch.autograd.has_torch_function = checks
            self._depth = depth


_AUTOGRAD_ENTRIES = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)
_TENSOR_BACKWARD = inspect.signature(torch.Tensor.backward)


def _caller() -> str:
    """The innermost frame outside torch and this module."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename
        if "/torch/" in path or path.endswith("host_syncs.py"):
            continue
        return f"{'/'.join(path.split('/')[-2:])}:{frame.lineno} {frame.name}"
    return "?"
