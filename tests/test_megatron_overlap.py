"""Batch overlap in Megatron-Core 0.16.1: a ``GPTModel`` built from
``use_mc2(spec, batch_overlap=True)`` trains under Megatron's DDP with the losses of the same
model on Megatron's own ``MoELayer`` (same weights), the decoder's two halves of each batch run
stage by stage (two staged mc2 calls per MoE layer and step), with Megatron's state-dict keys;
what it cannot split equal is refused on every rank, naming the field
(tests/workers_megatron_overlap.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import mc2  # noqa: E402
from tests.workers_megatron import BATCH, SEQ, STEPS  # noqa: E402
from tests.workers_megatron_overlap import (  # noqa: E402
    MODELS, REFUSED, batch_overlap_training, refusals)

TOLERANCE = 1e-5


@pytest.mark.parametrize("world,kind", [(2, "layer_spec"), (2, "block_spec"),
                                        (4, "block_spec")])
def test_gpt_model_with_batch_overlap_trains_as_megatrons(world: int, kind: str) -> None:
    moe_layers = sum(MODELS[kind].get("moe_layer_freq", [1] * MODELS[kind]["num_layers"]))
    halves = [BATCH // 2 + BATCH % 2, BATCH // 2]
    for rank, found in enumerate(mc2.run_local(batch_overlap_training, world, args=(kind,),
                                               deadline_s=600)):
        megatron, ours = found["losses megatron"], found["losses mc2"]
        assert len(ours) == STEPS and len(set(megatron)) == STEPS
        assert ours == pytest.approx(megatron, rel=TOLERANCE), (rank, ours, megatron)
        # every step ran each MoE layer as two staged calls, one per half of the batch
        assert found["calls mc2"] == [[h * SEQ for h in halves] * moe_layers] * STEPS, \
            found["calls mc2"]
        assert found["calls megatron"] == [[]] * STEPS
        assert found["overlap layers"] == MODELS[kind]["num_layers"]
        assert all(layer == "MC2TransformerLayer" for layer, _ in found["layers"])
        assert sum(mlp == "MC2MoELayer" for _, mlp in found["layers"]) == moe_layers
        assert found["keys"]["mc2"] == found["keys"]["megatron"]
        assert found["sharded_keys"]["mc2"] == found["sharded_keys"]["megatron"]
        assert found["counters mc2"] == found["counters megatron"]
        plain, split = found["one sequence"]
        assert split == pytest.approx(plain, rel=TOLERANCE) and found["calls one sequence"] == []
        if kind == "block_spec":
            assert found["counters mc2"] and any(any(c) for c in found["counters mc2"])


def test_batch_overlap_refuses_what_it_cannot_split_equal_on_every_rank() -> None:
    for rank, found in enumerate(mc2.run_local(refusals, 2, deadline_s=300)):
        for field in [*REFUSED, "batch_overlap"]:
            message = found[field]
            assert message.startswith("ValueError: "), f"rank {rank}, {field}: {message}"
            assert field in message, f"rank {rank}: {message} does not name {field}"


def test_a_block_spec_with_a_layer_batch_overlap_cannot_run_is_refused() -> None:
    """Every layer of a block takes part in batch overlap (a layer left as it was would run
    between recorded ones, and the stack's last would never be reached): a block spec with
    another layer class is refused, naming it."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from mc2.integrations.megatron import use_mc2

    layer = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    block = TransformerBlockSubmodules(layer_specs=[layer, ModuleSpec(module=IdentityOp)])
    with pytest.raises(ValueError, match=r"layer_specs\[1\] \(IdentityOp\)"):
        use_mc2(block, batch_overlap=True)
    assert use_mc2(dataclasses.replace(block, layer_specs=[layer, layer]), batch_overlap=True)
