"""Under ``torch.autocast`` batch overlap computes as the plain call does: in the autocast
dtype, with the same values, and gradients in the parameters' own dtype.

The plain call casts its floating inputs on the way in
(:func:`mc2.engine.autograd.prepare.autocast_inputs`); a staged call
(:func:`mc2.engine.autograd.staged.begin_packed`, what batch overlap runs) that did not would
compute a float32 model in float32 under a bfloat16 autocast. One process, float32 weights.
"""

from __future__ import annotations

import torch

import mc2
from mc2.integrations.batch_overlap import BatchOverlapStack

AUTOCAST = torch.bfloat16


def _layer(seed: int = 0) -> mc2.MoELayer:
    torch.manual_seed(seed)
    layer = mc2.MoELayer(16, 24, 4, topk=2, shared_experts=1, dtype=torch.float32)
    layer.reset_parameters(std=0.3)
    return layer


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in module.named_parameters()}


def test_a_staged_call_computes_in_the_autocast_dtype() -> None:
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(1))
    plain, staged = _layer(), _layer()
    with torch.autocast("cpu", dtype=AUTOCAST):
        want = plain(x)
        call = staged.begin_staged(x)
        call.experts()
        got = call.end()
    assert want.dtype == AUTOCAST  # what the plain call promises
    assert got.dtype == AUTOCAST
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    want.float().pow(2).sum().backward()
    got.float().pow(2).sum().backward()
    for name, grad in _grads(plain).items():
        mine = _grads(staged)[name]
        assert mine.dtype == torch.float32, name  # the parameters' own dtype
        torch.testing.assert_close(mine, grad, rtol=0, atol=0, msg=name)


class _Block(torch.nn.Module):
    """A decoder-layer stand-in with a ``forward_staged`` (batch overlap's protocol)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = torch.nn.Linear(16, 16)
        self.moe = _layer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(x))  # under autocast: bfloat16
        return h + self.moe(h)

    def forward_staged(self, x: torch.Tensor):
        h = torch.tanh(self.mix(x))
        out = yield self.moe.begin_staged(h)
        return h + out


def test_batch_overlap_equals_the_plain_stack_under_autocast() -> None:
    x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(2))  # 4 sequences
    torch.manual_seed(0)
    blocks = [_Block(), _Block()]
    plain = torch.nn.Sequential(*blocks)
    staged = BatchOverlapStack(blocks, batch_overlap=True, min_tokens=1)
    with torch.autocast("cpu", dtype=AUTOCAST):
        want = plain(x)
        got = staged(x)
    assert got.dtype == want.dtype == AUTOCAST
    # the two micro-batches' rows go through the same bfloat16 GEMMs, split in two
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
