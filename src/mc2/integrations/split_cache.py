"""A prefill's KV cache under batch overlap: one cache per micro-batch, joined afterwards.

Hugging Face models make a ``DynamicCache`` on every forward with ``use_cache=True`` (their
default, training steps included), and each attention layer appends its keys and values to it
along the sequence. The micro-batches of batch overlap hold different sequences, so they
cannot append to one cache: each gets an empty copy of it, and once all are through the
layers their keys and values are concatenated along the batch, in the batch's order, into the
caller's cache, which then holds exactly what the unsplit forward would have put there.

Only an empty cache of plain (full-attention) layers is split: a cache that already holds
tokens is a decoding step (one token per sequence, nothing to split), and a sliding-window or
static cache keeps state that a concatenation would not reproduce.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch


def unsplittable(cache: Any) -> str | None:
    """Why ``cache`` cannot be split over micro-batches, or ``None``."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if cache.get_seq_length() != 0:
        return "the KV cache already holds tokens (a decoding step)"
    if type(cache) is not DynamicCache or any(type(layer) is not DynamicLayer
                                               for layer in cache.layers):
        return (f"a {type(cache).__name__} of "
                f"{sorted({type(layer).__name__ for layer in cache.layers})} cannot be split "
                "(only a DynamicCache of full-attention layers can)")
    return None


def split(cache: Any, parts: int) -> list[Any]:
    """``parts`` empty caches like ``cache``, one per micro-batch."""
    return [copy.deepcopy(cache) for _ in range(parts)]


def join(cache: Any, parts: Sequence[Any]) -> None:
    """Fill ``cache`` with the micro-batches' keys and values, in the batch's order."""
    for index, layers in enumerate(zip(*(part.layers for part in parts))):
        if layers[0].is_initialized:
            cache.update(torch.cat([layer.keys for layer in layers]),
                         torch.cat([layer.values for layer in layers]), index)
