"""Count what an integration's calls into mc2 read to the host: around one forward and
backward of a framework's layer or model, the reads of each ``fused_expert*`` call the
integration makes (the experts stage included), and of the whole backward."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Iterator

import torch

NAMES = ("fused_expert", "fused_expert_module")


@contextlib.contextmanager
def counted_calls(module: Any) -> Iterator[dict[str, Any]]:
    """Patch ``module``'s ``fused_expert``/``fused_expert_module`` (the names it imported) and
    ``Tensor.backward`` inside the block; ``seen`` holds ``calls``, ``forward_reads`` (the most
    one call read), ``forward_read_ops``, ``backward_reads`` (the whole backward),
    ``micro_batches`` (the most any call ran), ``rows_once`` (any ran once per destination)
    and ``shared_inside`` (any ran shared experts), from a timeline of the calls."""
    import mc2
    from mc2.observation.host_syncs import HostSyncCounter

    seen: dict[str, Any] = {"calls": 0, "forward_reads": 0, "forward_read_ops": Counter(),
                            "backward_reads": 0}
    timeline = mc2.Timeline()
    originals = {name: getattr(module, name) for name in NAMES if hasattr(module, name)}

    def counting(original: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
            with HostSyncCounter() as syncs:
                out = original(*args, timeline=timeline, **kwargs)
            seen["calls"] += 1
            seen["forward_reads"] = max(seen["forward_reads"], syncs.reads)
            seen["forward_read_ops"].update(syncs.by_op)
            return out
        return counted

    backward = torch.Tensor.backward

    def counted_backward(tensor: torch.Tensor, gradient: Any = None, *args: Any,
                         **kwargs: Any) -> None:
        with HostSyncCounter() as syncs:
            torch.autograd.backward(tensor, gradient, *args, **kwargs)
        seen["backward_reads"] += syncs.reads

    for name, original in originals.items():
        setattr(module, name, counting(original))
    torch.Tensor.backward = counted_backward
    try:  # compiled framework kernels run eager under the counting mode, whose
        # __torch_function__ dynamo's guards cannot evaluate
        with torch._dynamo.config.patch(disable=True):
            yield seen
    finally:
        for name, original in originals.items():
            setattr(module, name, original)
        torch.Tensor.backward = backward
    seen["forward_read_ops"] = dict(seen["forward_read_ops"])
    seen["micro_batches"] = 1 + max((s.micro_batch for s in timeline.spans), default=0)
    seen["rows_once"] = any(s.name == "slots" for s in timeline.spans)
    seen["shared_inside"] = any(s.name == "local" for s in timeline.spans)
