"""``mc2::grouped_mm_into``: both kernels write what ``grouped_mm`` returns, into the buffer.

The CPU kernel (one ``mm`` per group) and the kernel every other device runs (``grouped_mm``
and a copy, run here on CPU tensors through the op's own function) against
``torch.nn.functional.grouped_mm``, for both forms, with empty groups (first, middle, last),
transposed operands, and accumulation.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mc2.engine.compute.grouped_into import grouped_mm_into

KERNELS = {"cpu": grouped_mm_into, "elsewhere": grouped_mm_into._init_fn}
ENDS = (0, 3, 3, 7)  # groups of 0, 3, 0 and 4 rows; one more row past the last group


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("accumulate", (False, True))
def test_rows_grouped_by_offsets(kernel: str, accumulate: bool) -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 16, generator=g)
    b = torch.randn(4, 8, 16, generator=g).transpose(1, 2)  # [G, K, N], a transposed view
    offs = torch.tensor(ENDS, dtype=torch.int32)
    out = torch.randn(8, 8, generator=g)
    start = out.clone()
    KERNELS[kernel](a, b, offs, out, accumulate)
    want = F.grouped_mm(a, b, offs=offs)
    rows = ENDS[-1]
    torch.testing.assert_close(out[:rows], want[:rows] + (start[:rows] if accumulate else 0))
    if kernel == "cpu":  # rows past the last group are left as they were
        assert torch.equal(out[rows:], start[rows:])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("accumulate", (False, True))
def test_weight_gradient_form_zeroes_empty_groups(kernel: str, accumulate: bool) -> None:
    g = torch.Generator().manual_seed(1)
    a = torch.randn(8, 16, generator=g).t()  # [M, P], grouped along P
    b = torch.randn(8, 4, generator=g)
    offs = torch.tensor((0, 3, 3, 8), dtype=torch.int32)
    out = torch.randn(4, 16, 4, generator=g)
    start = out.clone()
    KERNELS[kernel](a, b, offs, out, accumulate)
    want = F.grouped_mm(a, b, offs=offs)
    torch.testing.assert_close(out, want + (start if accumulate else 0))
    if not accumulate:
        assert out[0].abs().max() == 0 and out[2].abs().max() == 0


@pytest.mark.parametrize("trusted", (False, True))
@pytest.mark.parametrize("accumulate", (False, True))
def test_a_kernel_that_leaves_empty_groups_unwritten_is_masked(monkeypatch, trusted: bool,
                                                               accumulate: bool) -> None:
    """Blackwell's ``grouped_mm`` leaves an empty group's block of the weight-gradient form
    non-zero (pytorch/pytorch#172439; emulated: NaN there). On a device not known to write
    zeros (every one but Hopper) the kernel sets those blocks to zero (or adds nothing); a
    device trusted to write them (emulated) is not masked, and the NaN would go through."""
    import mc2.engine.compute.grouped_into as module

    real = F.grouped_mm

    def leaves_garbage(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        out = real(a, b, offs=offs)
        sizes = torch.diff(offs, prepend=offs.new_zeros(1))
        out[sizes == 0] = float("nan")
        return out

    monkeypatch.setattr(module.F, "grouped_mm", leaves_garbage)
    monkeypatch.setattr(module, "zeroes_empty_groups", lambda device: trusted)
    g = torch.Generator().manual_seed(2)
    a = torch.randn(8, 16, generator=g).t()
    b = torch.randn(8, 4, generator=g)
    offs = torch.tensor((0, 3, 3, 8), dtype=torch.int32)
    out = torch.randn(4, 16, 4, generator=g)
    start = out.clone()
    grouped_mm_into._init_fn(a, b, offs, out, accumulate)
    want = real(a, b, offs=offs) + (start if accumulate else 0)
    assert bool(out.isnan().any()) is trusted
    if not trusted:
        torch.testing.assert_close(out, want)


def test_only_hopper_is_trusted_to_zero_empty_groups(monkeypatch) -> None:
    """And only NVIDIA's: ROCm's device type is "cuda" too, and an MI300 reports a major of 9
    (emulated here); ROCm is refused ``gemm="grouped"`` as well (never measured there)."""
    from mc2.engine.compute.grouped_into import zeroes_empty_groups
    from mc2.engine.decide.gemm_strategy import grouped_problem

    assert not zeroes_empty_groups(torch.device("cpu"))
    assert not zeroes_empty_groups(torch.device("meta"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda", 0)
    for hip, hopper in ((None, True), ("6.4", False)):
        monkeypatch.setattr(torch.version, "hip", hip)
        zeroes_empty_groups.cache_clear()
        assert zeroes_empty_groups(cuda) is hopper
        assert (grouped_problem(torch.bfloat16, cuda) is None) is hopper
    zeroes_empty_groups.cache_clear()
