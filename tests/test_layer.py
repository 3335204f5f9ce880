"""MoELayer: router, losses, and checkpoints that move between EP sizes."""

from __future__ import annotations

import pytest
import torch

import mc2
import mc2.parallel.checkpoint
from tests.workers import layer_roundtrip


def full_state(shared: int) -> dict:
    torch.manual_seed(0)
    layer = mc2.MoELayer(16, 24, 8, topk=2, shared_experts=shared, dtype=torch.float64)
    layer.reset_parameters(std=0.3)
    torch.nn.init.normal_(layer.gate.weight, std=0.5)
    return {k: v.clone() for k, v in layer.state_dict().items()}  # one process: all experts


@pytest.mark.parametrize("shared", [0, 1])
def test_checkpoint_moves_between_ep_sizes(shared: int, tmp_path) -> None:
    full = full_state(shared)
    assert "expert_index" not in full  # it differs between ranks; checkpoints place experts
    x = torch.randn(24, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    single = layer_roundtrip(0, 1, full, x, shared)  # one process, all 8 experts
    path = str(tmp_path / "ep2")
    ep2 = mc2.run_local(layer_roundtrip, 2, args=(full, x, shared, path))
    # DCP reshards 2 -> 4, from a layer on a group to one on a mesh
    ep4 = mc2.run_local(layer_roundtrip, 4, args=(path, x, shared, None, True))
    for results in (ep2, ep4):
        world = len(results)
        out = torch.cat([r["out"] for r in results])
        torch.testing.assert_close(out, single["out"], rtol=0, atol=1e-10)
        for rank, r in enumerate(results):
            mine = list(range(rank * 8 // world, (rank + 1) * 8 // world))
            assert r["local_experts"] == mine
            torch.testing.assert_close(r["w_gate_up"], full["experts.w_gate_up"][mine], rtol=0, atol=0)
    # expert gradients are complete on their owner: EP-4 rank 1 holds experts 2 and 3
    w_gate_up_grad_single = single["w_gate_up_grad"]
    torch.testing.assert_close(ep4[1]["w_gate_up_grad"], w_gate_up_grad_single[2:4], rtol=0,
                               atol=1e-10)
    assert ep4[0]["local_keys"] == sorted(full)
    back = mc2.MoELayer(16, 24, 8, topk=2, shared_experts=shared, dtype=torch.float64)
    mc2.parallel.checkpoint.load(back, path)  # and back into one process
    for key, value in full.items():
        torch.testing.assert_close(back.state_dict()[key], value, rtol=0, atol=0)


def test_router_losses_are_balanced_at_one() -> None:
    layer = mc2.MoELayer(8, 8, 4, topk=1, dtype=torch.float64)
    torch.nn.init.zeros_(layer.gate.weight)  # uniform probabilities
    logits = torch.zeros(8, 4, dtype=torch.float64)
    ids = torch.arange(8).remainder(4).unsqueeze(-1)  # perfectly balanced assignment
    losses = layer.router_losses(logits, ids)
    assert losses.load_balancing.item() == pytest.approx(1.0)
    assert losses.z_loss.item() == pytest.approx(torch.log(torch.tensor(4.0)).item() ** 2)
    skewed = layer.router_losses(logits, torch.zeros(8, 1, dtype=torch.long))
    assert skewed.load_balancing.item() == pytest.approx(1.0)  # P uniform: f . P = 1/E
    peaked = torch.tensor([[5.0, 0, 0, 0]], dtype=torch.float64).expand(8, 4)
    assert layer.router_losses(peaked, torch.zeros(8, 1, dtype=torch.long)).load_balancing > 3


def test_bad_layer_arguments() -> None:
    with pytest.raises(ValueError, match="topk"):
        mc2.MoELayer(8, 8, 4, topk=5)


def test_a_split_layout_state_loads_into_the_packed_layer() -> None:
    torch.manual_seed(0)
    src = mc2.MoELayer(16, 24, 4, topk=2, dtype=torch.float64)
    src.reset_parameters(std=0.3)
    full = dict(src.state_dict())
    ffn = 24
    gate_up, down = full.pop("experts.w_gate_up"), full.pop("experts.w_down")
    old = {**full, "w_gate": gate_up[:, :ffn].transpose(1, 2), "w_up": gate_up[:, ffn:].transpose(1, 2),
           "w_down": down.transpose(1, 2)}
    dst = mc2.MoELayer(16, 24, 4, topk=2, dtype=torch.float64)
    mc2.load_full_state_dict(dst, old)
    x = torch.randn(10, 16, dtype=torch.float64)
    torch.testing.assert_close(dst(x), src(x), rtol=0, atol=0)


def test_a_state_from_before_the_experts_submodule_loads() -> None:
    src = mc2.MoELayer(16, 24, 4, topk=2, dtype=torch.float64)
    flat = {k.removeprefix("experts."): v for k, v in src.state_dict().items()}
    assert "w_gate_up" in flat
    dst = mc2.MoELayer(16, 24, 4, topk=2, dtype=torch.float64)
    dst.load_state_dict(flat)
    torch.testing.assert_close(dst.w_gate_up, src.w_gate_up, rtol=0, atol=0)


def test_moe_layer_sends_its_rows_in_the_wire_format() -> None:
    torch.manual_seed(0)
    plain = mc2.MoELayer(32, 24, 4, topk=2, micro_batches=2)
    wired = mc2.MoELayer(32, 24, 4, topk=2, micro_batches=2, wire_dtype=torch.bfloat16)
    wired.load_state_dict(plain.state_dict())
    x = torch.randn(10, 32)
    a, b = plain(x), wired(x)
    assert not torch.equal(a, b)  # the rows really went through bf16
    torch.testing.assert_close(b, a, rtol=0, atol=2 ** -7 * a.abs().max().item())


def test_a_meta_device_build_gets_real_experts_after_to_empty() -> None:
    with torch.device("meta"):
        layer = mc2.MoELayer(16, 24, 4, topk=2, shared_experts=1)
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    torch.nn.init.normal_(layer.gate.weight, std=0.02)
    assert layer.expert_index.tolist() == [0, 1, 2, 3]
    assert all(bool(torch.isfinite(p).all()) for p in layer.parameters())
    assert 0.015 < float(layer.w_gate_up.detach().std()) < 0.025
    assert layer(torch.randn(5, 16)).shape == (5, 16)


def _limited_reference(probs: torch.Tensor, groups: int, per_token: int, topk: int
                       ) -> torch.Tensor:
    """Group-limited top-k, one token at a time."""
    size = probs.shape[-1] // groups
    out = []
    for p in probs.tolist():
        score = [sum(sorted(p[g * size:(g + 1) * size])[-2:]) for g in range(groups)]
        best = sorted(range(groups), key=lambda g: -score[g])[:per_token]
        allowed = [e for e in range(len(p)) if e // size in best]
        out.append(sorted(allowed, key=lambda e: -p[e])[:topk])
    return torch.tensor(out)


def test_node_limited_routing_keeps_each_token_on_its_best_groups() -> None:
    from tests.reference import dense_moe

    torch.manual_seed(4)
    layer = mc2.MoELayer(16, 24, 8, topk=3, expert_groups=4, groups_per_token=2,
                         dtype=torch.float64)
    layer.reset_parameters(std=0.3)
    torch.nn.init.normal_(layer.gate.weight, std=0.5)
    x = torch.randn(40, 16, dtype=torch.float64)
    ids, weights, logits = layer.route(x)
    probs = logits.softmax(-1)
    want = _limited_reference(probs, 4, 2, 3)
    assert torch.equal(ids.sort(-1).values, want.sort(-1).values)
    assert all(len(set((row // 2).tolist())) <= 2 for row in ids)
    free = mc2.MoELayer(16, 24, 8, topk=3, dtype=torch.float64)
    free.load_state_dict(layer.state_dict())
    assert not torch.equal(free.route(x)[0].sort(-1).values, ids.sort(-1).values)  # it limits
    gate_up, down = layer.w_gate_up, layer.w_down
    up, gate = gate_up[:, 24:].transpose(1, 2), gate_up[:, :24].transpose(1, 2)
    dense = dense_moe(x, up, gate, down.transpose(1, 2), ids, weights)
    torch.testing.assert_close(layer(x), dense, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="must divide"):
        mc2.MoELayer(16, 24, 8, expert_groups=3, groups_per_token=1)
    with pytest.raises(ValueError, match="exceeds"):
        mc2.MoELayer(16, 24, 8, topk=3, expert_groups=4, groups_per_token=1)


def test_node_limited_routing_on_two_ranks_with_dedup() -> None:
    """Groups = ranks, one group a token: every token's rows go to one rank, once; equal to
    the same layer on one process."""
    from tests.workers import limited_layer

    torch.manual_seed(6)
    whole = mc2.MoELayer(16, 24, 8, topk=3, expert_groups=2, groups_per_token=1,
                         dtype=torch.float64)
    whole.reset_parameters(std=0.3)
    torch.nn.init.normal_(whole.gate.weight, std=0.5)
    state = {k: v.clone() for k, v in whole.state_dict().items()}
    x = torch.randn(2 * 11, 16, dtype=torch.float64, requires_grad=True)
    out = whole(x)
    out.pow(2).sum().backward()
    results = mc2.run_local(limited_layer, 2, args=(state, x.detach()), timeout_s=120)
    for rank, r in enumerate(results):
        assert all(len(set((row // 4).tolist())) == 1 for row in r["ids"])
        torch.testing.assert_close(r["out"], out.detach().chunk(2)[rank], rtol=0, atol=1e-12)
        torch.testing.assert_close(r["grad"], x.grad.chunk(2)[rank], rtol=0, atol=1e-12)


def test_the_experts_are_the_same_at_every_ep_size_and_differ_from_each_other() -> None:
    """Every rank runs with one seed (the replicated parameters need it): each expert is
    drawn from a generator of its own, by its global index, so a layer built over 2 ranks
    holds the experts of the one built whole, and no two experts start equal (before: the
    experts of rank 1 were rank 0's)."""
    from tests.workers_mesh import experts_by_layout

    for found in mc2.run_local(experts_by_layout, 2):
        assert torch.equal(found["spread"], found["whole"])
        experts = found["whole"]
        assert all(not torch.equal(experts[a], experts[b])
                   for a in range(len(experts)) for b in range(a))

