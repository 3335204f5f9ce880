"""Rank bodies of tests/test_megatron_overlap.py: a Megatron ``GPTModel`` built from
``use_mc2(spec, batch_overlap=True)`` against the same model on Megatron's own ``MoELayer``
(alltoall dispatcher), same weights, trained under Megatron's DDP; and the refusals.

Each function runs inside a rank of ``mc2.run_local`` (Megatron's CPU shims and process groups
first, :func:`tests.workers_megatron.start`)."""

from __future__ import annotations

from typing import Any

import torch

from tests.workers_megatron import (
    STEPS, _batches, _fill_model, _gpt, ddp_training, start, transformer_config)

# the two models of the test: TransformerConfig fields, and how the spec is built
MODELS: dict[str, dict[str, Any]] = {
    # Megatron's layer spec on every layer: two MoE layers, routed experts only
    "layer_spec": dict(num_layers=2, num_moe_experts=4, moe_router_topk=2),
    # its decoder-block spec: a dense first layer, then MoE layers with a gated shared expert
    # that runs inside mc2's call (moe_shared_expert_overlap), and the expert bias's counters
    "block_spec": dict(num_layers=3, moe_layer_freq=[0, 1, 1], num_moe_experts=4,
                       moe_router_topk=2, moe_shared_expert_intermediate_size=16,
                       moe_shared_expert_gate=True, moe_shared_expert_overlap=True,
                       moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
}


def _spec(config: Any, kind: str) -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec, get_gpt_layer_local_spec)

    if kind == "layer_spec":
        return get_gpt_layer_local_spec(num_experts=config.num_moe_experts,
                                        moe_grouped_gemm=False)
    return get_gpt_decoder_block_spec(config, use_transformer_engine=False)


def batch_overlap_training(rank: int, world: int, kind: str) -> dict[str, Any]:
    """Megatron's model and the batch-overlap model (same weights), each under Megatron's DDP,
    ``STEPS`` Adam steps on the same batches; their losses, the begun staged calls per step,
    what the layers are, the state-dict keys and the expert bias's token counters."""
    import mc2
    import mc2.integrations.megatron as integration
    from mc2.integrations.megatron_overlap import MC2TransformerLayer

    start(world)
    config = transformer_config(world, hidden_dropout=0.0, attention_dropout=0.0,
                                **MODELS[kind])
    spec = _spec(config, kind)
    models = {"megatron": _gpt(config, spec),
              "mc2": _gpt(config, integration.use_mc2(spec, config=mc2.MC2Config(),
                                                       batch_overlap=True, min_tokens=1))}
    _fill_model(models["megatron"], rank)
    models["mc2"].load_state_dict(models["megatron"].state_dict(), strict=True)
    found: dict[str, Any] = {
        "layers": [(type(layer).__name__, type(layer.mlp).__name__)
                   for layer in models["mc2"].decoder.layers],
        "keys": {name: sorted(m.state_dict()) for name, m in models.items()},
        "sharded_keys": {name: sorted(m.sharded_state_dict()) for name, m in models.items()},
    }
    begun: list[int] = []
    original = integration.begin_module

    def counted(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        begun.append(x.shape[0])
        return original(x, *args, **kwargs)

    integration.begin_module = counted
    for name, model in models.items():
        calls: list[list[int]] = []

        def after_step(calls: list[list[int]] = calls) -> None:
            calls.append(list(begun))
            begun.clear()

        losses = ddp_training(config, model, _batches(rank)[:STEPS], True, after_step)
        found[f"losses {name}"], found[f"calls {name}"] = losses, calls
        found[f"counters {name}"] = [
            layer.mlp.router.local_tokens_per_expert.tolist()
            for layer in model.decoder.layers
            if getattr(getattr(layer.mlp, "router", None), "local_tokens_per_expert", None)
            is not None]
    # one sequence cannot be split: the layers run one after the other, as Megatron's
    ids, position, mask = _batches(rank)[STEPS]
    begun.clear()
    with torch.no_grad():
        found["one sequence"] = [
            float(m.eval()(ids[:1], position[:1], mask, labels=ids[:1]).mean())
            for m in models.values()]
    found["calls one sequence"] = list(begun)
    integration.begin_module = original
    found["overlap layers"] = sum(isinstance(m, MC2TransformerLayer)
                                  for m in models["mc2"].modules())
    return found


# batch overlap's refusals: TransformerConfig fields, each with a value it refuses
REFUSED: dict[str, Any] = {
    "moe_aux_loss_coeff": dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01),
    "moe_z_loss_coeff": dict(moe_z_loss_coeff=1e-3),
    "moe_expert_capacity_factor": dict(moe_expert_capacity_factor=1.0),
    "recompute_granularity": dict(recompute_granularity="full", recompute_method="uniform",
                                  recompute_num_layers=1),
    "recompute_modules": dict(recompute_granularity="selective", recompute_modules=["layernorm"]),
    "mtp_num_layers": dict(mtp_num_layers=1),
}


def refusals(rank: int, world: int) -> dict[str, str]:
    """Each refused config built into a batch-overlap model: the error's text (every rank
    must raise), then one collective, so a rank that did not raise would hang the others."""
    import mc2
    from mc2.integrations.megatron import use_mc2

    start(world)
    found = {}
    for field, fields in REFUSED.items():
        config = transformer_config(world, num_layers=2, num_moe_experts=4, moe_router_topk=2,
                                    **fields)
        try:
            _gpt(config, use_mc2(_spec(config, "layer_spec"), batch_overlap=True))
            found[field] = "built"
        except ValueError as exc:
            found[field] = f"ValueError: {exc}"
    try:
        use_mc2(_spec(transformer_config(world, num_moe_experts=4), "layer_spec"),
                batch_overlap="sometimes")
        found["batch_overlap"] = "accepted"
    except ValueError as exc:
        found["batch_overlap"] = f"ValueError: {exc}"
    torch.distributed.barrier()
    del mc2
    return found
