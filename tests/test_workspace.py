"""The workspace: buffers are reused only when nothing else holds them, and steady-state calls
allocate nothing, without changing a single number."""

from __future__ import annotations

import torch

import mc2
from mc2.engine.transport.workspace import Workspace

BIG = (256, 1024)  # above the size served by the allocator directly


def test_a_held_buffer_is_never_handed_out_again() -> None:
    ws = Workspace()
    a = ws.empty(BIG, torch.float32, "cpu")
    b = ws.empty(BIG, torch.float32, "cpu")
    assert a.data_ptr() != b.data_ptr()
    view = a[3:]  # anything derived from a keeps its memory in use
    del a
    c = ws.empty(BIG, torch.float32, "cpu")
    assert c.data_ptr() not in (b.data_ptr(), view.data_ptr() - 3 * 1024 * 4)
    del view
    d = ws.empty(BIG, torch.float32, "cpu")
    assert ws.allocations == 3
    assert d.data_ptr() not in (b.data_ptr(), c.data_ptr())


def test_a_free_buffer_is_reused_for_a_slightly_smaller_request() -> None:
    ws = Workspace()
    ptr = ws.empty(BIG, torch.float32, "cpu").data_ptr()
    again = ws.empty((240, 1024), torch.float32, "cpu")
    assert again.data_ptr() == ptr and ws.allocations == 1
    other = ws.empty(BIG, torch.float64, "cpu")
    assert ws.allocations == 2 and other.dtype == torch.float64


def _problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, 64, generator=g, dtype=torch.float64)
    gate_up = (torch.randn(4, 256, 64, generator=g, dtype=torch.float64) * 0.1).requires_grad_()
    down = (torch.randn(4, 64, 128, generator=g, dtype=torch.float64) * 0.1).requires_grad_()
    ids = torch.randint(0, 4, (300, 2), generator=g)
    return x, gate_up, down, ids


def test_steady_state_calls_allocate_nothing() -> None:
    ws = Workspace()
    x, gate_up, down, ids = _problem()
    counts = []
    for _ in range(5):
        gate_up.grad = down.grad = None
        out = mc2.fused_expert_packed(x, gate_up, down, ids, micro_batches=3, workspace=ws)
        out.sum().backward()
        counts.append(ws.allocations)
    assert counts[1] == counts[-1] > 0, counts


def test_kept_gradients_accumulate_correctly_over_reused_memory() -> None:
    """A gradient handed to autograd lives in pooled memory; keeping it (gradient accumulation)
    must keep that memory out of the next call's hands."""
    x, gate_up, down, ids = _problem()
    ws = Workspace()
    grads = []
    for _ in range(3):
        out = mc2.fused_expert_packed(x, gate_up, down, ids, micro_batches=2, workspace=ws)
        out.pow(2).sum().backward()
        grads.append((gate_up.grad.clone(), down.grad.clone()))
    for n, (g_gu, g_down) in enumerate(grads, start=1):
        torch.testing.assert_close(g_gu, grads[0][0] * n, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g_down, grads[0][1] * n, rtol=1e-12, atol=1e-12)


def test_pooled_and_plain_allocation_give_identical_results() -> None:
    x, gate_up, down, ids = _problem(1)
    results = []
    for ws in (Workspace(), Workspace(enabled=False)):
        gate_up.grad = down.grad = None
        xg = x.clone().requires_grad_()
        out = mc2.fused_expert_packed(xg, gate_up, down, ids, micro_batches=2, workspace=ws)
        out.sum().backward()
        results.append([out.detach(), xg.grad, gate_up.grad, down.grad])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_a_second_backward_through_the_same_call_is_refused_not_wrong() -> None:
    import pytest

    x, gate_up, down, ids = _problem(2)
    out = mc2.fused_expert_packed(x, gate_up, down, ids, micro_batches=2)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once per forward"):
        out.sum().backward()
