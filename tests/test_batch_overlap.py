"""Batch overlap (two micro-batches interleaved across decoder layers) changes nothing but the
schedule: a tiny Mixtral on 2 ranks, with and without it."""

from __future__ import annotations

import pytest
import torch

import mc2
from tests.workers_overlap import with_and_without


def _same(plain: dict, got: dict, rtol: float, atol: float) -> None:
    torch.testing.assert_close(got["logits"], plain["logits"], rtol=rtol, atol=atol)
    torch.testing.assert_close(got["loss"], plain["loss"], rtol=rtol, atol=atol)
    if plain["aux"] is not None:  # Hugging Face computes it in float32 whatever the model's
        # dtype; the two micro-batches' router logits are concatenated in another order
        torch.testing.assert_close(got["aux"], plain["aux"], rtol=max(rtol, 1e-6), atol=0)
    assert got["grads"].keys() == plain["grads"].keys()
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("dtype,hostile,options,stack,tol", [
    ("float64", False, {}, {}, 1e-12),
    ("float64", True, {}, {"checkpointing": True}, 1e-12),  # everything to experts 0 and 1
    ("float32", False, {"wire_dtype": "bf16", "shared": None}, {"sync": True}, 1e-6),
], ids=["float64", "one-expert+checkpointing", "float32+bf16-wire+gradient-sync"])
def test_batch_overlap_equals_the_plain_model(dtype, hostile, options, stack, tol) -> None:
    options = {k: v for k, v in options.items() if k != "shared"}
    results = mc2.run_local(with_and_without, 2, args=(dtype, hostile, options, stack),
                            timeout_s=120)
    for r in results:
        assert r["chosen"] is True
        assert r["overlapped"]["labels"] == [0, 1]  # both micro-batches of every call traced
        assert -1 in r["plain"]["labels"]  # planning spans of plain calls carry no label
        _same(r["plain"], r["overlapped"], rtol=tol, atol=tol)
        torch.testing.assert_close(r["prefill"], r["plain"]["logits"], rtol=tol, atol=tol)
