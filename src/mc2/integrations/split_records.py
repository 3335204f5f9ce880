"""Hugging Face's recorded outputs (router logits, attentions) under batch overlap.

With ``output_router_logits`` (what the auxiliary load-balancing loss is computed from) or
``output_attentions``, a Hugging Face model records the output of every router or attention
module through forward hooks into one list per kind, in call order. Batch overlap calls those
modules once per micro-batch, interleaved: the lists would hold an entry per micro-batch and
layer, each of a part of the batch, in schedule order, and ``load_balancing_loss_func`` lines
them up against the attention mask as one entry per layer: with padding, a wrong loss. So each
micro-batch records into lists of its own, and afterwards each layer's entries are
concatenated along the batch (the first micro-batch holds the first sequences), which is
exactly what the unsplit forward records.

``output_hidden_states`` is recorded by hooks on the decoder layers themselves, which batch
overlap does not call as a whole: such a forward runs without batch overlap (said once).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch


class SplitRecords:
    """The records of one forward, kept per micro-batch (labels 0, 1, ...) and joined by
    layer."""

    def __init__(self) -> None:
        try:  # Hugging Face's context variable of the active records
            from transformers.utils.output_capturing import _active_collector as var
        except ImportError:  # an older transformers, or none: nothing records
            var = None
        self._var = var
        active = self._var.get() if self._var is not None else None
        self.target: dict[str, Any] | None = active or None
        self._keys = [k for k, v in (active or {}).items() if isinstance(v, list)]
        self._parts: dict[int, dict[str, list[torch.Tensor]]] = {}

    def problem(self) -> str | None:
        """Why this forward cannot run with batch overlap, or ``None``."""
        if self.target is not None and "hidden_states" in self.target:
            return ("output_hidden_states asks for every decoder layer's output, recorded by "
                    "hooks on the layers, which batch overlap runs in parts")
        return None

    @contextmanager
    def of(self, label: int) -> Iterator[None]:
        """Records made inside go to micro-batch ``label``'s lists."""
        if self.target is None:
            yield
            return
        lists = self._parts.setdefault(label, {k: [] for k in self._keys})
        token = self._var.set(lists)
        try:
            yield
        finally:
            self._var.reset(token)

    def join(self) -> None:
        """Each layer's entries, one per micro-batch, concatenated along the batch (in label
        order, the batch's) into the forward's lists."""
        if self.target is None:
            return
        parts = [self._parts[label] for label in sorted(self._parts)]
        for key in self._keys:
            counts = [len(part[key]) for part in parts]
            if len(set(counts)) > 1:
                raise RuntimeError(f"batch overlap: the micro-batches recorded {counts} {key}")
            self.target[key].extend(torch.cat(entries)
                                    for entries in zip(*(part[key] for part in parts)))
