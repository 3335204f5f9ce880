"""Rank bodies of tests/test_megatron.py: Megatron-Core's own ``MoELayer`` (alltoall
dispatcher) against :class:`mc2.integrations.megatron.MC2MoELayer` with the same weights and
inputs, refusals, and a small ``GPTModel`` trained with and without mc2.

Every function runs inside a rank of ``mc2.run_local``: it installs the tests' CPU shims
(:mod:`tests.megatron_cpu`) and initialises Megatron's ``parallel_state`` with
``expert_model_parallel_size = world`` before building anything.
"""

from __future__ import annotations

import contextlib

import zlib
from typing import Any

import torch

# the cases of test_megatron.py: TransformerConfig fields over the base, and mc2's settings
HIDDEN, FFN, SEQ, BATCH = 16, 24, 6, 3
CASES: dict[str, dict[str, Any]] = {
    "top1": dict(num_moe_experts=4, moe_router_topk=1, moe_router_pre_softmax=True),
    "top2_aux_loss": dict(num_moe_experts=4, moe_router_topk=2,
                          moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1),
    "top8": dict(num_moe_experts=8, moe_router_topk=8),
    "sigmoid_expert_bias": dict(num_moe_experts=8, moe_router_topk=2,
                                moe_router_score_function="sigmoid",
                                moe_router_enable_expert_bias=True,
                                moe_router_load_balancing_type="seq_aux_loss",
                                moe_aux_loss_coeff=0.1),
    "group_limited_z_loss": dict(num_moe_experts=8, moe_router_topk=2, moe_router_num_groups=4,
                                 moe_router_group_topk=2, moe_z_loss_coeff=0.01,
                                 moe_router_pre_softmax=True),
    "capacity_drops": dict(num_moe_experts=4, moe_router_topk=2, moe_expert_capacity_factor=0.5,
                           moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1),
    "capacity_drops_position": dict(num_moe_experts=8, moe_router_topk=2,
                                    moe_expert_capacity_factor=0.75,
                                    moe_token_drop_policy="position"),
    # a router that sends nearly every token to expert 0 first: most of its slots dropped
    "capacity_drops_skewed": dict(num_moe_experts=8, moe_router_topk=2,
                                  moe_expert_capacity_factor=0.5, skew=True),
    "shared_experts": dict(num_moe_experts=4, moe_router_topk=2,
                           moe_shared_expert_intermediate_size=20),
    "shared_experts_gate_overlap": dict(num_moe_experts=4, moe_router_topk=2,
                                        moe_shared_expert_intermediate_size=20,
                                        moe_shared_expert_gate=True,
                                        moe_shared_expert_overlap=True),
    "dedup_micro_batches_3": dict(num_moe_experts=8, moe_router_topk=4, mc2=dict(dedup=True,
                                                                                micro_batches=3)),
    "serial": dict(num_moe_experts=4, moe_router_topk=2, mc2=dict(overlap=False,
                                                                 micro_batches=1)),
    "grouped_mlp": dict(num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True, bf16=True,
                        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1),
    "padding_mask": dict(num_moe_experts=4, moe_router_topk=2, padding=True,
                         moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1),
}

REFUSALS: dict[str, dict[str, Any]] = {
    "moe_pad_expert_input_to_capacity": dict(moe_expert_capacity_factor=1.0,
                                             moe_pad_expert_input_to_capacity=True),
    "moe_token_dispatcher_type": dict(moe_token_dispatcher_type="flex"),
    "add_bias_linear": dict(add_bias_linear=True),
    "moe_apply_probs_on_input": dict(moe_apply_probs_on_input=True, moe_router_topk=1,
                                     moe_router_pre_softmax=True),
    "gradient_accumulation_fusion": dict(gradient_accumulation_fusion=True),
    "delay_wgrad_compute": dict(delay_wgrad_compute=True),
    "expert_tensor_parallel_size": dict(expert_tensor_parallel_size=2),
    "tensor_model_parallel_size": dict(tensor_model_parallel_size=2),
    "moe_latent_size": dict(moe_latent_size=8),
    "fp8": dict(fp8="e4m3"),
    "cuda_graph_impl": dict(cuda_graph_impl="local"),
    "recompute_modules": dict(recompute_granularity="selective", recompute_modules=["moe"]),
    "moe_shared_expert_overlap": dict(moe_shared_expert_intermediate_size=20,
                                      moe_shared_expert_overlap=True,
                                      activation_func=torch.nn.functional.gelu),
    "glu_linear_offset": dict(moe_shared_expert_intermediate_size=20,
                              moe_shared_expert_overlap=True, glu_linear_offset=1.0),
    "activation_func_clamp_value": dict(moe_shared_expert_intermediate_size=20,
                                        moe_shared_expert_overlap=True,
                                        activation_func_clamp_value=7.0),
    "gated_linear_unit": dict(moe_shared_expert_intermediate_size=20,
                              moe_shared_expert_overlap=True, gated_linear_unit=False),
    "fp4": dict(fp4="e2m1"),
}


def start(world: int) -> None:
    """The shims, then Megatron's process groups with every rank one expert-parallel rank."""
    from tests import megatron_cpu

    megatron_cpu.install()
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)


def transformer_config(world: int, **fields: Any) -> Any:
    """A float32 TransformerConfig of a small SwiGLU MoE, ``fields`` over the base."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    base: dict[str, Any] = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=FFN,
        moe_ffn_hidden_size=FFN, moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=world, use_cpu_initialization=True, add_bias_linear=False,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        bias_activation_fusion=False, moe_router_load_balancing_type="none",
        params_dtype=torch.float32)
    base.update(fields)
    return TransformerConfig(**base)


def _fill(module: torch.nn.Module, rank: int) -> None:
    """Every parameter (and the expert bias) from a generator seeded by its name; the routed
    experts' also by rank (each rank holds other experts), the rest alike on every rank."""
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if not t.is_floating_point() or "tokens_per_expert" in name:
                continue
            own = rank if name.startswith("experts.") else 0
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1000 * own)
            t.copy_(torch.randn(t.shape, generator=g) * (0.3 if "bias" in name else 0.5))


def _aux_losses() -> dict[str, float]:
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    return {name: float(v["values"].sum()) for name, v in
            get_moe_layer_wise_logging_tracker().items()}


def _run(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, padding: Any
         ) -> dict[str, Any]:
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()
    x = x.detach().clone().requires_grad_(True)
    out, bias = layer(x, padding_mask=padding)
    assert bias is None
    (out * grad).sum().backward()
    found = {"out": out.detach(), "x.grad": x.grad}
    found.update({f"grad {n}": p.grad for n, p in layer.named_parameters()})
    router = layer.router
    if getattr(router, "local_tokens_per_expert", None) is not None:
        found["router tokens_per_expert"] = router.local_tokens_per_expert.clone()
    losses = _aux_losses()
    return found, losses


def compare_layers(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    """For each case: Megatron's MoELayer and MC2MoELayer (loaded from its state_dict) on the
    same input and output gradient. Returns, per case, the worst relative error of each
    tensor, the two layers' aux losses, the state-dict keys' equality, and the dropped-slot
    count (how many (token, expert) slots the router's capacity dropped on this rank)."""
    import mc2
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module

    from mc2.integrations.megatron import MC2MoELayer, use_mc2

    start(world)
    results: dict[str, Any] = {}
    for name in names:
        fields = dict(CASES[name])
        options = fields.pop("mc2", {"micro_batches": 2})
        padding = fields.pop("padding", False)
        skew = fields.pop("skew", False)
        config = transformer_config(world, **fields)
        spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts,
                                   moe_grouped_gemm=config.moe_grouped_gemm)
        reference = build_module(spec, config=config)
        layer = build_module(use_mc2(spec, config=mc2.MC2Config(**options)), config=config)
        assert type(layer) is MC2MoELayer, type(layer)
        for m in (reference, layer):
            m.set_layer_number(1)
            m.train()
        _fill(reference, rank)
        if skew:  # every token's logit of expert 0 raised by its shared offset
            with torch.no_grad():
                reference.router.weight[0].fill_(1.0)
        missing = layer.load_state_dict(reference.state_dict(), strict=True)
        g = torch.Generator().manual_seed(17 + rank)
        x = torch.randn(SEQ, BATCH, HIDDEN, generator=g) + (1.0 if skew else 0.0)
        grad = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
        mask = None
        if padding:  # [B, S], True for a real token; the last two positions pad
            mask = torch.ones(BATCH, SEQ, dtype=torch.bool)
            mask[:, -2:] = False
        want, want_losses = _run(reference, x, grad, mask)
        with _mc2_call_counted() as seen, mc2.count_traffic() as traffic:
            got, got_losses = _run(layer, x, grad, mask)
        errors = {}
        for key, ref in want.items():
            if ref is None:
                errors[key] = 0.0 if got[key] is None else float("inf")
                continue
            scale = float(ref.abs().max()) or 1.0
            errors[key] = float((got[key] - ref).abs().max()) / scale
        dropped, kept_rows = 0, None
        if config.moe_expert_capacity_factor is not None:
            with torch.no_grad():
                _, routing_map = layer.router(x)
            dropped = SEQ * BATCH * config.moe_router_topk - int(routing_map.sum())
            # the kept (token, expert) slots per destination rank: the rows that must travel
            kept_rows = routing_map.view(-1, world, config.num_moe_experts // world) \
                .sum((0, 2)).tolist()
        results[name] = {
            "errors": errors, "losses": (want_losses, got_losses),
            "keys_equal": sorted(reference.state_dict()) == sorted(layer.state_dict())
            and not missing.missing_keys and not missing.unexpected_keys,
            "dropped": dropped, "expert_grads": sum(k.startswith("grad experts.") for k in errors),
            "rows_sent": list(traffic.rows_sent), "kept_rows": kept_rows,
            **seen,
        }
    return results


def _mc2_call_counted() -> Any:
    """Around an ``MC2MoELayer``'s forward and backward: the host reads of its
    ``fused_expert_module`` call (the experts stage included) in the forward, and of the whole
    backward (the router's backward reads nothing); the K it ran and whether its rows went
    once per destination (:func:`tests.call_counting.counted_calls`)."""
    from mc2.integrations import megatron
    from tests.call_counting import counted_calls

    return counted_calls(megatron)


def refusals(rank: int, world: int) -> dict[str, str]:
    """Each refused setting: the ValueError's message (or what happened instead). Then one
    collective on the EP group, which every rank reaches: nobody was left inside one."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module

    from mc2.integrations.megatron import use_mc2

    start(world)
    found: dict[str, str] = {}
    for field, fields in REFUSALS.items():
        # set after Megatron's own checks (some settings need bf16, virtual pipelines, ...):
        # what is tested is the layer's refusal, not TransformerConfig's
        config = transformer_config(world, num_moe_experts=4, moe_router_topk=2,
                                    moe_router_pre_softmax=True)
        for name, value in fields.items():
            setattr(config, name, value)
        spec = use_mc2(get_moe_module_spec(use_te=False, num_experts=4, moe_grouped_gemm=False))
        try:
            build_module(spec, config=config)
            found[field] = "built"
        except ValueError as exc:
            found[field] = f"ValueError: {exc}"
    ones = torch.ones(1)
    torch.distributed.all_reduce(ones, group=parallel_state.get_expert_model_parallel_group())
    found["after"] = str(int(ones.item()))
    return found


def _gpt(config: Any, spec: Any) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel

    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=SEQ)


VOCAB, STEPS = 32, 4


def _batches(rank: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(5 + rank)
    position = torch.arange(SEQ).expand(BATCH, SEQ)
    causal = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)  # True: masked
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), position, causal)
            for _ in range(STEPS + 1)]


def ddp_training(config: Any, model: torch.nn.Module, batches: list[tuple[torch.Tensor, ...]],
                 overlap_grad_reduce: bool, after_step: Any = None,
                 **ddp_options: Any) -> list[float]:
    """``model`` under Megatron's DistributedDataParallel, one Adam step per batch (the
    gradients read from ``main_grad``, where Megatron's DDP puts them; Megatron's own
    optimizer allocates on CUDA and cannot run here); the losses. ``after_step(ddp)`` runs
    after each step; ``ddp_options``: more ``DistributedDataParallelConfig`` fields."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        overlap_grad_reduce=overlap_grad_reduce, **ddp_options), model)
    optimizer = torch.optim.Adam(list(ddp.parameters()), lr=1e-2)
    losses = []
    for ids, position, mask in batches:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp(ids, position, mask, labels=ids).mean()
        loss.backward()
        ddp.finish_grad_sync()
        for p in ddp.parameters():
            p.grad = p.main_grad
        optimizer.step()
        if after_step is not None:
            after_step(ddp)
        losses.append(float(loss))
    return losses


def gpt_training(rank: int, world: int, overlap_grad_reduce: bool,
                 checkpoint_dir: str | None = None) -> dict[str, Any]:
    """A 2-layer GPTModel (Megatron's local spec, 4 experts top-2, aux loss) built from the
    spec and from ``use_mc2(spec)``, the same weights, each wrapped in Megatron's
    DistributedDataParallel and trained ``STEPS`` Adam steps on the same batches (the
    gradients read from ``main_grad``, where Megatron's DDP puts them; Megatron's own optimizer
    allocates on CUDA and cannot run here). Returns both models' losses, their state-dict and
    sharded-state-dict keys, which layers are MC2MoELayer on Megatron's EP group, and the loss
    of an unpatched model loaded from the trained mc2 model's state_dict against the mc2
    model's on the next batch. With ``checkpoint_dir``: the same through Megatron's
    ``dist_checkpointing`` (its ``torch_dist`` format, every rank saving its own experts),
    both ways: the trained mc2 model saved and loaded into a model without mc2, and that
    model saved and loaded into a fresh mc2 model."""
    import mc2
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mc2.integrations.megatron import MC2MoELayer, use_mc2

    start(world)
    config = transformer_config(world, num_layers=2, num_moe_experts=4, moe_router_topk=2,
                                moe_router_load_balancing_type="aux_loss",
                                moe_aux_loss_coeff=0.01, hidden_dropout=0.0,
                                attention_dropout=0.0)
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    models = {"megatron": _gpt(config, spec),
              "mc2": _gpt(config, use_mc2(spec, config=mc2.MC2Config(micro_batches=2)))}
    _fill_model(models["megatron"], rank)
    models["mc2"].load_state_dict(models["megatron"].state_dict(), strict=True)
    ep = parallel_state.get_expert_model_parallel_group()
    found: dict[str, Any] = {
        "mc2_layers": [type(layer.mlp) is MC2MoELayer and layer.mlp.ep_group is ep
                       for layer in models["mc2"].decoder.layers],
        "megatron_layers": [type(layer.mlp).__name__ for layer in models["megatron"].decoder.layers],
        "keys": {name: sorted(m.state_dict()) for name, m in models.items()},
        "sharded_keys": {name: sorted(m.sharded_state_dict()) for name, m in models.items()},
    }
    batches = _batches(rank)
    for name, model in models.items():
        found[f"losses {name}"] = ddp_training(config, model, batches[:STEPS],
                                               overlap_grad_reduce)
    # the trained mc2 model's checkpoint in a model without mc2
    plain = _gpt(config, spec)
    plain.load_state_dict(models["mc2"].state_dict(), strict=True)
    ids, position, mask = batches[STEPS]
    with torch.no_grad():
        found["reload"] = [float(m.eval()(ids, position, mask, labels=ids).mean())
                           for m in (models["mc2"], plain)]
    if checkpoint_dir is not None:
        found["dist_checkpointing"] = _dist_checkpoint_round_trip(
            models["mc2"], lambda: _gpt(config, spec),
            lambda: _gpt(config, use_mc2(spec, config=mc2.MC2Config(micro_batches=2))),
            checkpoint_dir, batches[STEPS])
    return found


@contextlib.contextmanager
def _may_start_processes() -> Any:
    """Let this rank start processes for the block. Megatron's ``torch_dist`` writer hands its
    files to a multiprocessing ``Manager`` queue (a spawned process), which a daemonic
    process may not start; ``mc2.run_local``'s ranks are daemonic, torchrun's are not. The
    manager ends with the rank (multiprocessing's exit finalizers). Moves no data."""
    import multiprocessing

    config = multiprocessing.current_process()._config
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = daemon


def _dist_checkpoint_round_trip(trained: Any, without_mc2: Any, with_mc2: Any, root: str,
                                batch: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """``trained`` (mc2) saved with ``dist_checkpointing`` and loaded into a model built by
    ``without_mc2``; that one saved and loaded into a fresh ``with_mc2`` model. The losses of
    the three on ``batch``, and the layer types that ran."""
    from pathlib import Path

    from megatron.core import dist_checkpointing

    from mc2.integrations.megatron import MC2MoELayer

    def save(model: Any, name: str) -> str:
        path = Path(root) / name
        if torch.distributed.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
        torch.distributed.barrier()
        with _may_start_processes():
            dist_checkpointing.save(model.sharded_state_dict(), str(path))
        return str(path)

    def load(build: Any, path: str) -> Any:
        model = build()
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path),
                              strict=True)
        return model.eval()

    plain = load(without_mc2, save(trained, "from_mc2"))
    back = load(with_mc2, save(plain, "from_megatron"))
    ids, position, mask = batch
    with torch.no_grad():
        losses = [float(m.eval()(ids, position, mask, labels=ids).mean())
                  for m in (trained, plain, back)]
    return {"losses": losses,
            "layers": [[type(layer.mlp) is MC2MoELayer for layer in m.decoder.layers]
                       for m in (plain, back)]}


def _fill_model(model: torch.nn.Module, rank: int) -> None:
    """:func:`_fill` over a model: the routed experts (``.mlp.experts.``) by rank."""
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.is_floating_point() or "tokens_per_expert" in name:
                continue
            own = rank if ".mlp.experts." in name else 0
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1000 * own)
            scale = 0.0 if name.endswith("bias") else 0.5 if "layernorm" not in name else 0.1
            t.copy_(torch.randn(t.shape, generator=g) * scale + (1.0 if "layernorm.weight" in name
                                                                    or name.endswith("norm.weight")
                                                                    else 0.0))


def patched_specs(rank: int, world: int, env: str) -> dict[str, Any]:
    """``import mc2.integrations.megatron_patch`` with ``MC2_MEGATRON_CONFIG=env``, then the
    GPT spec functions a pretrain_gpt-style script calls: what their MoE specs build and with
    which config; then the same after ``unpatch()``."""
    import os

    os.environ["MC2_MEGATRON_CONFIG"] = env
    start(world)
    import mc2.integrations.megatron_patch as patch
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    config = transformer_config(world, num_layers=2, num_moe_experts=4, moe_router_topk=2)

    def moe_modules() -> list[Any]:
        block = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        layer = specs.get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
        moe = get_moe_module_spec(use_te=False, num_experts=4, moe_grouped_gemm=False)
        mlps = [s.submodules.mlp for s in block.layer_specs] + [layer.submodules.mlp, moe]
        return [(m.module.__name__, m.params.get("mc2_config")) for m in mlps]

    def layer_modules() -> list[str]:
        block = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        layer = specs.get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
        dense = specs.get_gpt_layer_local_spec()
        return [s.module.__name__ for s in [*block.layer_specs, layer, dense]]

    found = {"patched": moe_modules(), "layers": layer_modules()}
    model = _gpt(config, specs.get_gpt_decoder_block_spec(config, use_transformer_engine=False))
    found["built"] = [type(layer.mlp).__name__ for layer in model.decoder.layers]
    found["built layers"] = [type(layer).__name__ for layer in model.decoder.layers]
    from megatron.core.pipeline_parallel import schedules

    def schedule() -> str:
        return "mc2's" if hasattr(schedules.get_forward_backward_func(),
                                  "__mc2_original__") else "Megatron's"

    found["schedule"] = [schedule()]
    patch.unpatch()
    found["schedule"].append(schedule())
    found["unpatched"] = moe_modules()
    found["unpatched layers"] = layer_modules()
    return found


def gathered_training(rank: int, world: int, wait: bool = True,
                      batch_overlap: bool = False) -> dict[str, Any]:
    """Megatron's distributed optimizer with ``overlap_param_gather``: a 2-layer GPTModel with
    shared experts run inside mc2's call (``moe_shared_expert_overlap``) and Megatron's own,
    the same weights, each under ``DistributedDataParallel(use_distributed_optimizer=True,
    overlap_param_gather=True)``; ``STEPS`` Adam steps, each followed by DDP's asynchronous
    parameter all-gather (``start_param_sync``), which the next forward's pre-hooks wait for.
    The gradients are reduce-scattered: outside a rank's shard its Adam step is wrong and the
    gather overwrites it with the owner's, so a forward reading a parameter before its gather
    lands computes with the wrong values. ``wait=False`` turns mc2's waits off (what the test
    shows fails); ``batch_overlap``: the mc2 model's layers as batch overlap's (its staged
    calls read the same parameters). Returns both models' losses, or the error."""
    import mc2
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mc2.integrations import megatron as mc2_megatron

    if not wait:
        mc2_megatron.wait_param_gathers = lambda module: None
    start(world)
    config = transformer_config(world, num_layers=2, num_moe_experts=4, moe_router_topk=2,
                                moe_shared_expert_intermediate_size=FFN,
                                moe_shared_expert_overlap=True, hidden_dropout=0.0,
                                attention_dropout=0.0)
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    models = {"megatron": _gpt(config, spec),
              "mc2": _gpt(config, mc2_megatron.use_mc2(spec, config=mc2.MC2Config(
                  micro_batches=2), batch_overlap=batch_overlap, min_tokens=1))}
    _fill_model(models["megatron"], rank)
    models["mc2"].load_state_dict(models["megatron"].state_dict(), strict=True)
    staged = []  # the MoE layers' staged calls (batch overlap's), counted
    begin = mc2_megatron.MC2MoELayer.begin_staged
    mc2_megatron.MC2MoELayer.begin_staged = \
        lambda self, *a, **k: staged.append(1) or begin(self, *a, **k)
    found: dict[str, Any] = {}
    for name, model in models.items():
        try:  # each step's asynchronous gather, waited by the next forward's hooks
            found[name] = ddp_training(config, model, _batches(rank)[:STEPS], False,
                                       lambda ddp: ddp.start_param_sync(),
                                       use_distributed_optimizer=True,
                                       overlap_param_gather=True)
        except AssertionError as exc:  # Megatron's: a bucket group never waited
            found[name] = f"AssertionError: {exc}"
    found["staged calls"] = len(staged)
    return found


def _user_change(kind: str, layer: torch.nn.Module) -> None:
    """What a user adds to a Megatron MoE layer's modules (``hook_cases``)."""
    if kind == "shared forward hook":
        layer.shared_experts.register_forward_hook(lambda m, a, o: o * 2.0)
    elif kind == "shared forward replaced":
        own = layer.shared_experts.forward
        layer.shared_experts.forward = lambda x: own(x) * 2.0
    elif kind == "experts clamp hook":
        layer.experts.register_forward_hook(lambda m, a, o: (o[0].clamp(-0.2, 0.2), o[1]))
    else:
        raise AssertionError(kind)


def hook_case(rank: int, world: int, case: str, kind: str) -> dict[str, Any]:
    """Megatron's MoELayer and MC2MoELayer, same weights, both changed by ``kind``: the
    largest relative difference over the output and the gradients, or the error."""
    import warnings

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module

    import mc2
    from mc2.integrations.megatron import use_mc2

    start(world)
    fields = dict(CASES[case])
    fields.pop("mc2", None)
    config = transformer_config(world, **fields)
    spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts,
                               moe_grouped_gemm=config.moe_grouped_gemm)
    ref = build_module(spec, config=config)
    got = build_module(use_mc2(spec, config=mc2.MC2Config(micro_batches=2)), config=config)
    for m in (ref, got):
        m.set_layer_number(1)
        m.train()
    _fill(ref, rank)
    got.load_state_dict(ref.state_dict(), strict=True)
    for m in (ref, got):
        _user_change(kind, m)
    g = torch.Generator().manual_seed(17 + rank)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    grad = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    want, _ = _run(ref, x, grad, None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "runs beside", said once
            have, _ = _run(got, x, grad, None)
    except ValueError as exc:
        return {"error": str(exc)}
    worst = max(float((have[k] - v).abs().max()) / (float(v.abs().max()) or 1.0)
                for k, v in want.items() if v is not None and have.get(k) is not None)
    return {"error": None, "worst": worst}
