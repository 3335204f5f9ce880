"""Rank bodies of tests/test_megatron_overlap.py: a Megatron ``GPTModel`` built from
``use_mc2(spec, batch_overlap=True or "auto")`` against the same model on Megatron's own
``MoELayer`` (alltoall dispatcher), same weights, trained under Megatron's DDP (one or two
expert-parallel groups, and in pipeline stages under Megatron's own schedules); and the
refusals.

Each function runs inside a rank of ``mc2.run_local`` (Megatron's CPU shims and process groups
first, :func:`start_groups`)."""

from __future__ import annotations

from typing import Any

import torch

from tests.workers_megatron import (
    BATCH, SEQ, STEPS, VOCAB, _batches, _fill_model, _gpt, ddp_training, start,
    transformer_config)

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


def start_groups(world: int, ep: int | None = None, pp: int = 1,
                 vpp: int | None = None) -> None:
    """The shims, then Megatron's process groups: expert-parallel size ``ep`` (default: the
    world within each pipeline stage), ``pp`` pipeline stages of ``vpp`` virtual stages each."""
    if ep is None and pp == 1 and vpp is None:
        return start(world)
    from tests import megatron_cpu

    megatron_cpu.install()
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep or world // pp)


def _counted_begins() -> tuple[list[int], Any]:
    """``begin_module`` (the staged mc2 call) counted: the list its calls' token counts go to,
    and the function that puts the original back."""
    import mc2.integrations.megatron as integration

    begun: list[int] = []
    original = integration.begin_module

    def counted(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        begun.append(x.shape[0])
        return original(x, *args, **kwargs)

    integration.begin_module = counted

    def restore() -> None:
        integration.begin_module = original

    return begun, restore


def _both_models(world: int, kind: str, mode: bool | str, ep: int | None = None
                 ) -> tuple[Any, dict[str, Any]]:
    """Megatron's model of ``kind`` and the batch-overlap model (``use_mc2``'s
    ``batch_overlap=mode``) with the same weights, on process groups of expert-parallel size
    ``ep`` (default: the world): ``(config, {"megatron": ..., "mc2": ...})``."""
    import mc2
    import mc2.integrations.megatron as integration
    from megatron.core import parallel_state

    start_groups(world, ep)
    config = transformer_config(ep or world, hidden_dropout=0.0, attention_dropout=0.0,
                                **MODELS[kind])
    spec = _spec(config, kind)
    models = {"megatron": _gpt(config, spec),
              "mc2": _gpt(config, integration.use_mc2(spec, config=mc2.MC2Config(),
                                                       batch_overlap=mode, min_tokens=1))}
    # the routed experts by expert-parallel rank: the ranks holding the same experts start
    # with the same weights
    _fill_model(models["megatron"], parallel_state.get_expert_model_parallel_rank())
    models["mc2"].load_state_dict(models["megatron"].state_dict(), strict=True)
    return config, models


def batch_overlap_training(rank: int, world: int, kind: str, mode: bool | str = True,
                           ep: int | None = None) -> dict[str, Any]:
    """Megatron's model and the batch-overlap model (same weights), each under Megatron's DDP,
    ``STEPS`` Adam steps on the same batches; their losses, the begun staged calls per step,
    what the layers are, the state-dict keys and the expert bias's token counters. ``mode``:
    ``use_mc2``'s ``batch_overlap``; ``ep``: the expert-parallel size (default: the world; a
    smaller one makes several EP groups, each expert held by ``world // ep`` data-parallel
    ranks). Under ``"auto"`` also what the decision showed after the steps, and after the
    further no-grad forwards it took to decide, with the losses of those forwards."""

    from mc2.engine.decide.planner import planner_for
    from mc2.integrations.megatron_overlap import MC2TransformerLayer

    config, models = _both_models(world, kind, mode, ep)
    found: dict[str, Any] = {
        "layers": [(type(layer).__name__, type(layer.mlp).__name__)
                   for layer in models["mc2"].decoder.layers],
        "keys": {name: sorted(m.state_dict()) for name, m in models.items()},
        "sharded_keys": {name: sorted(m.sharded_state_dict()) for name, m in models.items()},
        "ep groups": sorted({tuple(torch.distributed.get_process_group_ranks(layer.mlp.ep_group))
                             for layer in models["mc2"].decoder.layers
                             if hasattr(layer.mlp, "ep_group")}),
        # where the stage's batch-overlap decision is agreed: its data-parallel ranks
        "decision group": tuple(torch.distributed.get_process_group_ranks(
            models["mc2"].decoder.layers[0].decision.group)),
    }
    begun, restore = _counted_begins()
    for name, model in models.items():
        calls: list[list[int]] = []

        def after_step(ddp: Any, calls: list[list[int]] = calls) -> None:
            calls.append(list(begun))
            begun.clear()

        losses = ddp_training(config, model, _batches(rank)[:STEPS], True, after_step)
        found[f"losses {name}"], found[f"calls {name}"] = losses, calls
        found[f"counters {name}"] = [
            layer.mlp.router.local_tokens_per_expert.tolist()
            for layer in model.decoder.layers
            if getattr(getattr(layer.mlp, "router", None), "local_tokens_per_expert", None)
            is not None]
        found[f"experts {name}"] = [float(p.detach().double().sum())
                                    for n, p in model.named_parameters() if ".mlp.experts." in n]
    ids, position, mask = _batches(rank)[STEPS]
    if mode == "auto":
        decision = models["mc2"].decoder.layers[0].decision
        planner = planner_for(decision.group)  # agreed on the stage's data-parallel ranks
        found["after steps"] = {"chosen": decision.chosen, "planner": planner.batch_overlaps()}
        # further forwards (no gradient: each timed alone) until "auto" has decided
        with torch.no_grad():
            want = float(models["megatron"].eval()(ids, position, mask, labels=ids).mean())
            models["mc2"].eval()
            forwards = []
            while decision.chosen is None and len(forwards) < 20:
                begun.clear()
                loss = float(models["mc2"](ids, position, mask, labels=ids).mean())
                forwards.append((loss, list(begun)))
            begun.clear()
            decided = float(models["mc2"](ids, position, mask, labels=ids).mean())
        found["deciding"] = {"want": want, "forwards": forwards,
                             "decided": (decided, list(begun)),
                             "chosen": decision.report()["forward_only"]["chosen"],
                             "planner": planner.batch_overlaps()}
    # one sequence cannot be split: the layers run one after the other, as Megatron's
    begun.clear()
    with torch.no_grad():
        found["one sequence"] = [
            float(m.eval()(ids[:1], position[:1], mask, labels=ids[:1]).mean())
            for m in models.values()]
    found["calls one sequence"] = list(begun)
    restore()
    found["overlap layers"] = sum(isinstance(m, MC2TransformerLayer)
                                  for m in models["mc2"].modules())
    return found


# the pipelines of the pipeline test: TransformerConfig fields and the virtual stages
PIPELINES: dict[str, dict[str, Any]] = {
    "pp": dict(num_layers=4, vpp=None),  # 2 stages of 2 layers
    "vpp": dict(num_layers=8, vpp=2),  # 2 stages of 2 virtual stages of 2 layers
}
MICRO_BATCHES = 2


def _on_host_schedules() -> None:
    """Megatron's schedules allocate their token counter with ``device="cuda"``; on a CPU the
    counter is made on the host (it counts, nothing else)."""
    import megatron.core.pipeline_parallel.schedules as schedules

    class _Torch:
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        @staticmethod
        def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
            return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)

    schedules.torch = _Torch()


def pipeline_training(rank: int, world: int) -> dict[str, Any]:
    """For each of :data:`PIPELINES`, in one world: Megatron's GPTModel in its pipeline stages
    (``pipeline_model_parallel_size=2``, EP = 2 within each stage, its layer spec: every
    layer MoE) and the same from ``use_mc2(spec, batch_overlap=True)``, same weights, each
    chunk under Megatron's DDP, ``STEPS`` Adam steps of ``MICRO_BATCHES`` micro-batches run by
    Megatron's own pipeline schedule (1F1B, interleaved with virtual stages). Returns per
    pipeline: the last stage's losses, how many parameters of this rank's chunks got a non-zero
    gradient in the first step and the largest difference of the two models' (relative to
    the largest gradient), the staged calls begun per step, and the layers each chunk
    holds."""
    import mc2
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mc2.integrations.megatron import use_mc2

    found: dict[str, Any] = {}
    for case, fields in PIPELINES.items():
        fields = dict(fields)
        vpp = fields.pop("vpp")
        start_groups(world, ep=2, pp=2, vpp=vpp)
        _on_host_schedules()
        config = transformer_config(
            2, num_moe_experts=4, moe_router_topk=2, hidden_dropout=0.0, attention_dropout=0.0,
            pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=vpp,
            pipeline_dtype=torch.float32, **fields)
        config.finalize_model_grads_func = finalize_model_grads
        spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
        specs = {"megatron": spec, "mc2": use_mc2(spec, config=mc2.MC2Config(),
                                                   batch_overlap=True, min_tokens=1)}
        stages = [None] if vpp is None else list(range(vpp))
        chunks: dict[str, list[torch.nn.Module]] = {
            name: [GPTModel(config=config, transformer_layer_spec=s, vocab_size=VOCAB,
                            max_sequence_length=SEQ, share_embeddings_and_output_weights=False,
                            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False,
                                                                   vp_stage=v),
                            post_process=ps.is_pipeline_last_stage(ignore_virtual=False,
                                                                   vp_stage=v),
                            vp_stage=v) for v in stages]
            for name, s in specs.items()}
        for ours, theirs in zip(chunks["mc2"], chunks["megatron"], strict=True):
            _fill_model(theirs, ps.get_expert_model_parallel_rank())
            ours.load_state_dict(theirs.state_dict(), strict=True)
        # a pipeline's stages read the same batches: seeded by the data-parallel rank
        dp = ps.get_data_parallel_rank()
        batches = list(zip(_batches(dp)[:STEPS], _batches(dp + world)[:STEPS]))
        result: dict[str, Any] = {
            "layers": [[type(layer).__name__ for layer in c.decoder.layers]
                       for c in chunks["mc2"]],
            "stage layers": [[layer.stage_layers for layer in c.decoder.layers]
                             for c in chunks["mc2"]],
            "last stage": ps.is_pipeline_last_stage(ignore_virtual=True)}
        begun, restore = _counted_begins()

        def step(data: Any, model: torch.nn.Module) -> Any:
            ids, position, mask = next(data)
            out = model(ids, position, mask, labels=ids)

            def loss(t: torch.Tensor) -> Any:
                mean = t.mean()
                return mean, {"loss": mean.detach()}
            return out, loss

        grads: dict[str, dict[str, torch.Tensor]] = {}
        for name, models in chunks.items():
            ddps = [DistributedDataParallel(config, DistributedDataParallelConfig(), m)
                    for m in models]
            optimizer = torch.optim.Adam([p for d in ddps for p in d.parameters()], lr=1e-2)
            losses, calls = [], []
            for micro in batches:
                for d in ddps:
                    d.zero_grad_buffer()
                optimizer.zero_grad()
                data = [iter(micro) for _ in ddps]
                out = get_forward_backward_func()(
                    forward_step_func=step, data_iterator=data if vpp else data[0],
                    model=ddps if vpp else ddps[0], num_microbatches=MICRO_BATCHES,
                    seq_length=SEQ, micro_batch_size=BATCH, forward_only=False)
                for d in ddps:
                    for p in d.parameters():
                        p.grad = p.main_grad
                if not losses:  # the first step's gradients, reduced by DDP
                    grads[name] = {f"{i}.{n}": p.main_grad.clone()
                                   for i, m in enumerate(models) for n, p in m.named_parameters()}
                optimizer.step()
                losses.append([float(o["loss"]) for o in out])
                calls.append(list(begun))
                begun.clear()
            result[f"losses {name}"], result[f"calls {name}"] = losses, calls
        restore()
        ours, theirs = grads["mc2"], grads["megatron"]
        assert ours.keys() == theirs.keys()
        result["gradients"] = sum(bool(g.any()) for g in theirs.values())
        result["gradient difference"] = max(
            float((ours[n] - g).abs().max()) for n, g in theirs.items()) / max(
            float(g.abs().max()) for g in theirs.values())
        found[case] = result
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


def _accumulation(rank: int, world: int, kind: str) -> tuple[Any, dict[str, Any], list, Any,
                                                              Any]:
    """Megatron's model and the batch-overlap model (same weights), and ``STEPS`` steps of 3
    micro-batches each: ``(config, models, steps, position, mask)``."""

    config, models = _both_models(world, kind, True)
    g = torch.Generator().manual_seed(11 + rank)
    position = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
    steps = [[torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(3)]
             for _ in range(STEPS)]
    return config, models, steps, position, mask


def paired_accumulation(rank: int, world: int, kind: str) -> dict[str, Any]:
    """Megatron's model (the sequential loop) and the batch-overlap model under
    ``mc2.forward_backward(overlap=True)``, the same weights, each under Megatron's DDP:
    ``STEPS`` Adam steps, each accumulating 3 micro-batches; the losses of each step's
    micro-batches."""
    import mc2
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config, models, steps, position, mask = _accumulation(rank, world, kind)

    def loss_fn(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model(ids, position, mask, labels=ids).mean() / 3

    found: dict[str, Any] = {}
    for name, model in models.items():
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
            overlap_grad_reduce=False), model)
        optimizer = torch.optim.Adam(list(ddp.parameters()), lr=1e-2)
        losses = []
        for batches in steps:
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            if name == "mc2":
                step = mc2.forward_backward(ddp, batches, loss_fn, overlap=True)
            else:
                step = []
                for ids in batches:
                    loss = loss_fn(ddp, ids)
                    loss.backward()
                    step.append(loss.detach())
            ddp.finish_grad_sync()
            for p in ddp.parameters():
                p.grad = p.main_grad
            optimizer.step()
            losses.append([float(x) for x in step])
        found[name] = losses
    return found


def _forward_step(position: torch.Tensor, mask: torch.Tensor) -> Any:
    """A ``forward_step_func`` of a ``pretrain_gpt.py``-style script: the mean output as the
    loss, reported as ``"lm loss"``."""
    def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        ids = next(data_iterator)
        output = model(ids, position, mask, labels=ids)

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss = output.float().mean()
            return loss, {"lm loss": loss.detach()}
        return output, loss_func
    return forward_step


def _trained_by(schedule: Any, config: Any, model: Any, steps: list, forward_step: Any,
                timed: dict[str, int] | None = None) -> list[list[float]]:
    """``model`` under Megatron's DDP with its ``no_sync`` and a grad-sync finalize, trained
    by ``schedule`` (Megatron's ``forward_backward_func`` signature): an Adam step per entry of
    ``steps`` (its micro-batches); the losses Megatron's ``forward_data_store`` holds, per
    step. ``timed``: filled with how often each of Megatron's timers started and stopped."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        overlap_grad_reduce=False), model)
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = \
        lambda chunks, tokens, pg_collection=None, force_all_reduce=False: [
            c.finish_grad_sync() for c in chunks]
    optimizer = torch.optim.Adam(list(ddp.parameters()), lr=1e-2)
    losses = []
    config.timers = _Timers()
    for batches in steps:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        store = schedule(forward_step_func=forward_step, data_iterator=iter(batches),
                         model=[ddp], num_microbatches=len(batches), seq_length=SEQ,
                         micro_batch_size=BATCH)
        for p in ddp.parameters():
            p.grad = p.main_grad
        optimizer.step()
        losses.append([float(s["lm loss"]) for s in store])
    if timed is not None:
        timed.update(config.timers.calls)
    config.timers = None
    return losses


class _Timers:
    """Megatron's ``config.timers`` as a schedule calls it (``timers(name, log_level=)``, then
    ``start(barrier=)``/``stop(barrier=)``): how often each timer started and stopped."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def __call__(self, name: str, log_level: int = 0) -> Any:
        from types import SimpleNamespace

        def count(what: str) -> Any:
            def call(barrier: bool = False) -> None:
                key = f"{name} {what}"
                self.calls[key] = self.calls.get(key, 0) + 1
            return call

        return SimpleNamespace(start=count("start"), stop=count("stop"))


def schedule_against_megatrons(rank: int, world: int, kind: str) -> dict[str, Any]:
    """Megatron's ``forward_backward_no_pipelining`` on Megatron's model against
    ``forward_backward_paired`` on the batch-overlap model (same weights), each under
    Megatron's DDP (:func:`_trained_by`): ``STEPS`` Adam steps of 3 micro-batches; the losses
    per step, and how often each of Megatron's timers ran. Also what the paired function
    raises on Megatron's own model (nothing to pair)."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from mc2.integrations.megatron_schedule import forward_backward_paired
    from tests import megatron_cpu

    config, models, steps, position, mask = _accumulation(rank, world, kind)
    megatron_cpu.cpu_schedules()
    forward_step = _forward_step(position, mask)
    found: dict[str, Any] = {"timers": {name: {} for name in models}}
    found.update({
        name: _trained_by(forward_backward_paired if name == "mc2"
                          else forward_backward_no_pipelining, config, model, steps,
                          forward_step, found["timers"][name]) for name, model in models.items()})
    try:
        forward_backward_paired(forward_step_func=forward_step, data_iterator=iter(steps[0]),
                                model=[models["megatron"]], num_microbatches=3,
                                seq_length=SEQ, micro_batch_size=BATCH)
        found["refused"] = None
    except ValueError as exc:
        found["refused"] = str(exc)
    return found


def megatrons_flag_through_the_patch(rank: int, world: int, kind: str) -> dict[str, Any]:
    """Megatron's own switch: ``import mc2.integrations.megatron_patch``, a config with
    ``overlap_moe_expert_parallel_comm=True``, the model built from the patched GPT specs and
    trained through Megatron's ``get_forward_backward_func()``;
    against Megatron's model without the flag, unpatched specs, same weights, same function.
    The losses per step, the paired schedule's calls, the layers, the same for a model built
    with ``use_mc2`` before the patch (Megatron's ``TransformerLayer``: its ``MC2MoELayer``
    calls pair inside the layers), and what Megatron's pipelined schedule does with the flag."""
    import mc2
    import mc2.integrations.megatron_patch as megatron_patch
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    from mc2.integrations import megatron_schedule
    from mc2.integrations.megatron import use_mc2
    from tests import megatron_cpu

    start_groups(world)
    fields = dict(hidden_dropout=0.0, attention_dropout=0.0, **MODELS[kind])
    config = transformer_config(world, **fields)
    # Megatron's config check refuses the flag without bf16 or fp16 (a limit of its own
    # kernels), and bf16 would make its attention compute in bf16: the flag is set after the
    # check, so that both models compute in float32 and compare to rounding
    flagged = transformer_config(world, **fields)
    flagged.overlap_moe_expert_parallel_comm = True
    megatron_patch.unpatch()
    models = {"megatron": _gpt(config, _spec(config, kind)),
              "mc2 in-layer": _gpt(flagged, use_mc2(_spec(flagged, kind)))}
    found: dict[str, Any] = {}
    megatron_patch.patch(mc2.MC2Config())
    try:
        models["mc2"] = _gpt(flagged, _spec(flagged, kind))
        _fill_model(models["megatron"], parallel_state.get_expert_model_parallel_rank())
        for name in ("mc2", "mc2 in-layer"):
            models[name].load_state_dict(models["megatron"].state_dict(), strict=True)
        found["layers"] = [type(layer).__name__ for layer in models["mc2"].decoder.layers]
        found["in-layer layers"] = [type(layer).__name__
                                    for layer in models["mc2 in-layer"].decoder.layers]
        paired: list[int] = []
        run_pairs = megatron_schedule.run_pairs
        megatron_schedule.run_pairs = lambda count, *a, **k: paired.append(count) or \
            run_pairs(count, *a, **k)
        megatron_cpu.cpu_schedules()
        g = torch.Generator().manual_seed(11 + rank)
        position = torch.arange(SEQ).expand(BATCH, SEQ)
        mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
        steps = [[torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(3)]
                 for _ in range(STEPS)]
        forward_step = _forward_step(position, mask)
        for name, model in models.items():
            found[name] = _trained_by(schedules.get_forward_backward_func(),
                                      config if name == "megatron" else flagged, model, steps,
                                      forward_step)
            if name == "mc2 in-layer":
                found["in-layer paired"], paired[:] = list(paired), []
        found["paired"] = paired
        try:  # with pipeline stages: refused, not Megatron's combined 1F1B on mc2's layers
            schedules.forward_backward_pipelining_without_interleaving(
                forward_step_func=forward_step, data_iterator=iter(steps[0]),
                model=[models["mc2"]], num_microbatches=3, seq_length=SEQ,
                micro_batch_size=BATCH)
        except ValueError as exc:
            found["pipelined"] = str(exc)
    finally:
        megatron_patch.unpatch()
    return found


def hooked_parts(rank: int, world: int, kind: str) -> dict[str, Any]:
    """Megatron's model and the batch-overlap model (same weights), a no-grad forward each:
    with a forward hook scaling the output of the last layer's MoE layer (``mlp``) on both,
    their losses and the staged calls begun; with a hook on a decoder layer of the batch-
    overlap model, what it raised."""
    _, models = _both_models(world, kind, True)
    ids, position, mask = _batches(rank)[0]
    for model in models.values():
        model.decoder.layers[-1].mlp.register_forward_hook(
            lambda module, args, out: (out[0] * 1.5, *out[1:]))
        model.eval()
    begun, restore = _counted_begins()
    with torch.no_grad():
        losses = {name: float(m(ids, position, mask, labels=ids).mean())
                  for name, m in models.items()}
        found: dict[str, Any] = {"losses": losses, "begun": list(begun)}
        models["mc2"].decoder.layers[0].register_forward_hook(lambda module, args, out: None)
        try:
            models["mc2"](ids, position, mask, labels=ids)
            found["layer hook"] = "no error"
        except ValueError as exc:
            found["layer hook"] = str(exc)
    restore()
    return found
