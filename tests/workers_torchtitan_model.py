"""Rank functions for tests/test_torchtitan.py: a whole TorchTitan 0.3.0 Qwen3 MoE debug model
(its own ``Qwen3Model.Config`` and ``_build_qwen3_moe_layers``, smaller numbers than
``debugmodel_moe``) trained a few AdamW steps under TorchTitan's own ``parallelize_qwen3``:
FSDP over the 4 ranks for the dense parameters (``fsdp`` mesh), EP = 2 for the experts,
FSDP-sharded over the ``efsdp`` mesh (size 2). Built twice from the same seed, once as it is
and once after TorchTitan's ``apply_overrides`` with mc2's override, and trained on the same
tokens: the per-step losses of the two are what the test compares.

The trainer's steps are followed where they matter here: the sharding configs
``update_from_config`` sets, then the override, then the build, ``parallelize_qwen3``, TorchTitan's
``CrossEntropyLoss`` normalised by the global token count, and its
``register_moe_load_balancing_hook`` (the expert-bias update) on the optimizer.

Shims, in this file only, each where the trainer needs an accelerator:

- **Attention**: ``get_attention_config`` accepts ``"flex"``, ``"flex_flash"`` and
  ``"varlen"`` for language models and refuses ``"sdpa"`` (``ValueError: sdpa is no longer
  supported for language models``). Flex runs through ``torch.compile`` with
  ``max_autotune`` (minutes of inductor compilation per rank on this CPU) and needs a
  ``BlockMask``; varlen is the CUDA flash kernel. The layers are built with ``"flex"`` and
  their inner attention config is then swapped for TorchTitan's own
  ``ScaledDotProductAttention.Config`` (causal, no mask): the rest of each layer, and its
  sharding configs, stay TorchTitan's.
- **update_from_config** takes the trainer's whole config. For this parallelism (no TP, CP,
  PP, no DeepEP dispatcher) all it does is ``set_qwen3_sharding_config(enable_sp=False,
  enable_ep=True)``, called here directly (tests/test_torchtitan_trainer.py runs TorchTitan's
  ``Trainer`` itself, which calls it).
- **Weights**: built and initialised on the CPU (``init_weights`` with a fixed seed) before
  ``parallelize_qwen3``, not on the meta device and after it as the trainer does, so that both
  models start from the same weights (checked) without a checkpoint.
- **Gradient reduction**: TorchTitan's ``disable_fsdp_gradient_division`` (divide factor 1)
  makes FSDP reduce-scatter with ``ReduceOp.PREMUL_SUM(1.0)``, which Gloo refuses
  (``RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo``). FSDP's own
  ``set_force_sum_reduction_for_comms(True)`` (its path for devices with SUM only) sends SUM
  and skips the division by 1: the same gradients.
- **Meshes**, as in tests/workers_torchtitan.py: the mesh device falls back to ``"cuda"``
  without an accelerator (set to ``"cpu"``), and size-1 axes take the ``"fake"`` backend,
  registered by importing ``torch.testing._internal.distributed.fake_pg``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend
from torch import Tensor

MC2 = "mc2.integrations.torchtitan.mc2_routed_experts"
# a Qwen3 MoE far smaller than debugmodel_moe (dim 256, 8 layers, 64 experts top-8)
VOCAB, DIM, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 64, 2, 4, 2, 16
EXPERTS, TOP_K, MOE_HIDDEN = 8, 2, 64
BATCH, SEQ = 2, 16  # tokens per rank and step: 32
EP, LR = 2, 1e-2
SHARED_GAIN = 8.0


def qwen3_moe_config(shape: dict[str, int] | None = None) -> Any:
    """TorchTitan's Qwen3 MoE model config, as ``_debugmodel_moe`` writes it with smaller
    numbers (``shape`` overrides them: ``dim``, ``layers``, ``heads``, ``kv_heads``,
    ``head_dim``, ``experts``, ``top_k``, ``moe_hidden``, ``seq``, ``vocab``), the inner
    attention swapped for SDPA (the module docstring says why)."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT, _LINEAR_INIT, Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm)

    n = dict(dim=DIM, layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
             experts=EXPERTS, top_k=TOP_K, moe_hidden=MOE_HIDDEN, seq=SEQ, vocab=VOCAB)
    n.update(shape or {})
    layers = _build_qwen3_moe_layers(
        fuse_qkv=True, n_layers=n["layers"], dim=n["dim"], n_heads=n["heads"],
        n_kv_heads=n["kv_heads"], head_dim=n["head_dim"], moe_hidden_dim=n["moe_hidden"],
        num_experts=n["experts"], top_k=n["top_k"], attn_backend="flex",
        moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=n["head_dim"], max_seq_len=n["seq"], theta=1000000.0))
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Qwen3Model.Config(
        vocab_size=n["vocab"], dim=n["dim"], norm=_qwen3_norm(n["dim"]),
        tok_embeddings=Embedding.Config(num_embeddings=n["vocab"], embedding_dim=n["dim"],
                                        param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=n["dim"], out_features=n["vocab"],
                              param_init=_LINEAR_INIT),
        layers=layers)


def shared_expert_config(dim: int, hidden: int) -> Any:
    """A shared expert as TorchTitan's DeepSeek-V3 builds one (``make_ffn_config``)."""
    from torchtitan.models.common.config_utils import make_ffn_config
    from torchtitan.models.qwen3 import _LINEAR_INIT

    return make_ffn_config(dim=dim, hidden_dim=hidden, w1_param_init=_LINEAR_INIT,
                           w2w3_param_init=_LINEAR_INIT)


def parallelism(world: int, backend: str) -> Any:
    """TorchTitan's ``ParallelismConfig`` for FSDP over the world with EP = 2."""
    from torchtitan.config import ParallelismConfig

    return ParallelismConfig(data_parallel_shard_degree=world, expert_parallel_degree=EP,
                             spmd_backend=backend)


def parallel_dims(world: int, backend: str) -> Any:
    """The trainer's ``ParallelDims`` (dp_shard = world, ep = 2) with its meshes built."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.utils import set_spmd_backend

    parallel_dims_module.device_type = "cpu"  # TorchTitan falls back to "cuda" without one
    dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=EP,
                        world_size=world, spmd_backend=backend)
    set_spmd_backend(backend)
    dims.build_mesh()
    return dims


def build_model(world: int, backend: str, mc2: dict | None, override: str = MC2,
                shared: bool = False, shape: dict[str, int] | None = None,
                ep: int = EP) -> torch.nn.Module:
    """The model as the trainer configures it (the sharding configs ``update_from_config``
    sets, then ``override`` when ``mc2`` is given, applied as the trainer applies it: from a
    root that holds the model config in a ``ModelSpec``), built and initialised from seed 0
    on the CPU. ``shared``: every MoE block with a shared expert (a SwiGLU ``FeedForward`` of
    the routed experts' width), as DeepSeek-V3's blocks have; ``shape``: as
    :func:`qwen3_moe_config`; ``ep``: the expert-parallel degree it is configured for."""
    from torchtitan.config import OverrideConfig, apply_overrides
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config
    from torchtitan.protocols.model_spec import ModelSpec

    cfg = qwen3_moe_config(shape)
    if shared:
        for layer in cfg.layers:
            layer.moe.shared_experts = shared_expert_config(
                cfg.dim, (shape or {}).get("moe_hidden", MOE_HIDDEN))
    # what Qwen3Model.Config.update_from_config does for this parallelism (module docstring)
    set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=ep > 1)
    if mc2 is not None:
        spec = ModelSpec(name="qwen3", flavor="test", model=cfg, parallelize_fn=None,
                         pipelining_fn=None, post_optimizer_build_fn=None,
                         state_dict_adapter=None)
        applied = apply_overrides(OverrideConfig(imports=[(override, mc2)]), spec)
        assert len(applied) == (len(cfg.layers) if override == MC2 else 1), applied
        assert spec.model is cfg
    torch.manual_seed(0)
    model = cfg.build()
    with torch.no_grad():
        model.init_weights()
        for layer in model.layers.values() if shared else ():
            # the shared expert's output well above bfloat16 rounding in the loss, so that a
            # shared expert lost or counted twice shows
            layer.moe.shared_experts.w2.weight.mul_(SHARED_GAIN)
    return model


def same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Every parameter and buffer of ``a`` equals ``b``'s (same names, bitwise)."""
    sa = dict(a.named_parameters()) | dict(a.named_buffers())
    sb = dict(b.named_parameters()) | dict(b.named_buffers())
    return sa.keys() == sb.keys() and all(torch.equal(sa[n], sb[n]) for n in sa)


def parallelize(model: torch.nn.Module, dims: Any, world: int, backend: str,
                ac_config: Any = None) -> torch.nn.Module:
    """TorchTitan's own ``parallelize_qwen3`` with the trainer's default training config
    (bfloat16 FSDP parameters, float32 reduction), no compile, no activation checkpointing
    unless ``ac_config`` names a policy."""
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.qwen3 import parallelize_qwen3

    model = parallelize_qwen3(model, parallel_dims=dims, training=TrainingConfig(),
                              parallelism=parallelism(world, backend),
                              compile_config=CompileConfig(), ac_config=ac_config,
                              dump_folder="/tmp")
    sum_reductions_for_gloo(model)
    model.train()
    return model


def sum_reductions_for_gloo(model: torch.nn.Module) -> None:
    """FSDP's reduce-scatter as a plain SUM: TorchTitan sets the gradient divide factor to 1
    (it normalises by the global token count itself), which FSDP sends as
    ``ReduceOp.PREMUL_SUM(1.0)``, an op Gloo lacks. FSDP's own
    ``set_force_sum_reduction_for_comms`` sends SUM and divides by the factor afterwards, a
    division it skips for 1: the same sum."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def sharding(model: torch.nn.Module) -> dict:
    """What FSDP + EP left on this rank. Per MoE layer: the experts node's type and EP group
    size, and each expert weight's mesh axes, placements, the tensor dim its ``efsdp``
    placement shards (``None``: not sharded there) and its local and global shapes. For the
    other parameters: the (mesh axes, placements) they carry."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    # FSDP over a dim EP already shards places a _StridedShard, which is no Shard subclass
    shards = (Shard, _StridedShard)

    layers = []
    experts = set()
    for layer in model.layers.values():
        node = layer.moe.routed_experts
        group = getattr(node, "ep_group", None)
        weights = {}
        for name, p in node.inner_experts.named_parameters():
            experts.add(p)
            axes = tuple(p.device_mesh.mesh_dim_names)
            on_efsdp = p.placements[axes.index("efsdp")] if "efsdp" in axes else None
            weights[name] = {"mesh": axes, "placements": tuple(str(x) for x in p.placements),
                             "efsdp_dim": on_efsdp.dim if isinstance(on_efsdp, shards) else None,
                             "local": tuple(p.to_local().shape), "global": tuple(p.shape)}
        layers.append({"node": type(node).__name__,
                       "group_size": None if group is None else group.size(),
                       "weights": weights})
    dense = sorted({(tuple(p.device_mesh.mesh_dim_names), tuple(str(x) for x in p.placements))
                    for p in model.parameters() if p not in experts})
    return {"layers": layers, "dense": dense}


def same_shards(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Every parameter's local shard of ``a`` equals ``b``'s (after parallelize)."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(
        torch.equal(pa[n].to_local(), pb[n].to_local()) for n in pa)


def batches(rank: int, steps: int) -> list[tuple[Tensor, Tensor]]:
    """This rank's (tokens, labels) per step, seeded by rank, the same for both models. The
    label is a fixed function of the token (a bigram the model can learn in a few steps), so
    that the loss moves well beyond the two models' rounding differences."""
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append((tokens, (tokens * 7 + 3) % VOCAB))
    return out


class Trainer:
    """One model's optimizer, loss and load-balancing hook, as TorchTitan's trainer sets
    them up; :meth:`step` is its ``train_step`` without gradient accumulation."""

    def __init__(self, model: torch.nn.Module, dims: Any) -> None:
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.components.optimizer.optimizer import register_moe_load_balancing_hook

        self.model, self.dims = model, dims
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        register_moe_load_balancing_hook(self.optimizer, [model], dims)
        self.loss_fn = CrossEntropyLoss.Config().build()

    def step(self, tokens: Tensor, labels: Tensor) -> float:
        """Forward, backward and optimizer step; the global mean loss over all ranks."""
        self.optimizer.zero_grad()
        group = self.dims.get_mesh("batch").get_group()
        valid = torch.tensor(labels.numel(), dtype=torch.int64)
        dist.all_reduce(valid, group=group)
        loss, _ = self.loss_fn(self.model(tokens), labels, valid)
        loss.backward()
        self.optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        return float(total)


class AccumulatingTrainer(Trainer):
    """:class:`Trainer` with gradient accumulation as TorchTitan's ``train_step`` runs it:
    the global count of valid labels over all of a step's micro-batches, then
    ``self.fwd_bwd_fn(inputs, labels, global_valid_tokens, extra_kwargs)`` once per
    micro-batch (TorchTitan's ``_forward_backward_body`` unless replaced), the gradients read
    only after the last (the optimizer step). Holds the attributes of TorchTitan's trainer
    that ``mc2.integrations.torchtitan_schedule`` reads."""

    def __init__(self, model: torch.nn.Module, dims: Any, micro_batches: int) -> None:
        from types import SimpleNamespace
        import contextlib

        super().__init__(model, dims)
        self.model_parts, self.parallel_dims = [model], dims
        self.gradient_accumulation_steps = micro_batches
        self.train_context = contextlib.nullcontext
        self.config = SimpleNamespace(training=SimpleNamespace(disable_cuda_graphs=True))
        self.fwd_bwd_fn = self.forward_backward_body

    def forward_backward_body(self, inputs: Tensor, labels: Tensor, valid: Tensor,
                              extra_kwargs: dict) -> Tensor:
        with self.train_context():
            loss, _ = self.loss_fn(self.model(inputs, **extra_kwargs), labels, valid)
            loss.backward()
        return loss

    def accumulate(self, micro_batches: list[tuple[Tensor, Tensor]]) -> float:
        """One optimizer step over ``micro_batches``; the global loss (summed over the
        micro-batches, all ranks)."""
        self.optimizer.zero_grad()
        group = self.dims.get_mesh("batch").get_group()
        valid = torch.tensor(sum(labels.numel() for _, labels in micro_batches),
                             dtype=torch.int64)
        dist.all_reduce(valid, group=group)
        total = torch.zeros([])
        for tokens, labels in micro_batches:
            total += self.fwd_bwd_fn(tokens, labels, valid, {}).detach()
        self.optimizer.step()
        dist.all_reduce(total, group=group)
        return float(total)


PAIRED = "mc2.integrations.torchtitan_schedule.mc2_paired_accumulation"


def checkpoint_tree() -> Any:
    """A config tree with TorchTitan's checkpoint node as its ``Trainer.Config`` has one (a
    ``BaseCheckpointManager.Config`` field holding the DCP manager's config)."""
    from dataclasses import dataclass, field

    from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager
    from torchtitan.config import Configurable

    @dataclass(kw_only=True, slots=True)
    class Root(Configurable.Config):
        checkpoint: BaseCheckpointManager.Config = field(default_factory=CheckpointManager.Config)

    return Root()


def through_override(trainer: Any) -> Any:
    """What TorchTitan's ``Trainer`` does with ``--override.imports`` naming :data:`PAIRED`:
    the override applied to the config tree by TorchTitan's ``apply_overrides``, the checkpoint
    manager built with the arguments the trainer passes it, and its ``load`` as ``train()``
    begins. The manager."""
    from torchtitan.config import OverrideConfig, apply_overrides

    tree = checkpoint_tree()
    apply_overrides(OverrideConfig(imports=[PAIRED]), tree)
    manager = checkpoint_manager(tree, trainer)
    manager.load(step=-1)
    return manager


def checkpoint_manager(tree: Any, trainer: Any) -> Any:
    """``tree``'s checkpoint manager, built with the arguments TorchTitan's ``Trainer`` passes
    it (no optimizer, scheduler or data loader here: checkpointing is off)."""
    return tree.checkpoint.build(dataloader=None, model_parts=trainer.model_parts,
                                 optimizers=None, lr_schedulers=None,
                                 states={"train_state": trainer}, sd_adapter=None,
                                 base_folder="")


def accumulation_against_torchtitan(rank: int, world: int, steps: int,
                                    micro_batches: int) -> dict:
    """TorchTitan's Qwen3 MoE through its own accumulation loop, and the same model with mc2's
    override through that loop with ``pair_accumulation``'s ``fwd_bwd_fn``, ``steps`` AdamW
    steps of ``micro_batches`` micro-batches under FSDP + EP: the global losses per step of
    both, how many of the paired forward's exchanges travelled across a backward's compute,
    whether every parameter was sharded again after the steps, and what ``pair_accumulation``
    refused of a trainer with CUDA graphs or TorchTitan's chunked loss."""
    from types import SimpleNamespace

    import mc2
    from mc2.integrations.torchtitan_schedule import pair_accumulation
    from tests.workers_pairing import _forward_transfers_under_backward
    from tests.workers_schedule import ScheduleRecorder

    dims = parallel_dims(world, "partial_dtensor")
    ref = parallelize(build_model(world, "partial_dtensor", None), dims, world, "partial_dtensor")
    got = parallelize(build_model(world, "partial_dtensor", {"micro_batches": 2}), dims, world,
                      "partial_dtensor")
    ref_trainer = AccumulatingTrainer(ref, dims, micro_batches)
    got_trainer = AccumulatingTrainer(got, dims, micro_batches)
    own = got_trainer.fwd_bwd_fn
    through_override(got_trainer)  # as TorchTitan's Trainer runs the documented override
    paired_by_override = got_trainer.fwd_bwd_fn is not own
    data = batches(rank, steps * micro_batches)
    steps_of = [data[i:i + micro_batches] for i in range(0, len(data), micro_batches)]
    recorder = ScheduleRecorder()
    ref_losses, losses = [], []
    with recorder.installed(), mc2.profile() as prof:
        for step in steps_of:
            losses.append(got_trainer.accumulate(step))
    for step in steps_of:
        ref_losses.append(ref_trainer.accumulate(step))
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.activation_checkpoint import MemoryBudgetAC

    def config(**fields: Any) -> Any:
        return SimpleNamespace(training=SimpleNamespace(disable_cuda_graphs=True), **fields)

    refused = {}
    for name, change in (("cuda graphs", lambda t: setattr(
            t, "config", SimpleNamespace(training=SimpleNamespace(disable_cuda_graphs=False)))),
                         ("chunked loss", lambda t: setattr(t, "loss_fn", _chunked_loss())),
                         ("memory budget", lambda t: setattr(t, "config", config(
                             activation_checkpoint=MemoryBudgetAC.Config()))),
                         ("compiled", lambda t: setattr(t, "config", config(
                             compile=CompileConfig(enable=True, components=["model"]))))):
        trainer = AccumulatingTrainer(got, dims, micro_batches)
        change(trainer)
        try:
            pair_accumulation(trainer)
            refused[name] = None
        except ValueError as exc:
            refused[name] = str(exc)
    return {"ref_losses": ref_losses, "losses": losses, "paired_by_override": paired_by_override,
            "under_backward": _forward_transfers_under_backward(recorder.exchanges(),
                                                                prof.spans),
            "sharded": all(type(p).__name__ == "DTensor" and p.to_local().numel() < p.numel()
                           for p in got.parameters() if p.numel() >= world),
            "refused": refused}


def _chunked_loss() -> Any:
    """TorchTitan's ``ChunkedLossWrapper`` object (not built: only its type is asked)."""
    from torchtitan.components.loss import ChunkedLossWrapper

    return ChunkedLossWrapper.__new__(ChunkedLossWrapper)


def train_against_torchtitan(rank: int, world: int, options: dict, steps: int,
                             backend: str = "partial_dtensor", override: str = MC2,
                             shared: bool = False, until_decided: bool = False,
                             hooked: str | None = None) -> dict:
    """TorchTitan's Qwen3 MoE and the same with mc2's ``override``, same weights and tokens,
    trained ``steps`` AdamW steps under FSDP + EP: losses per step, the nodes that ran,
    state-dict keys and the sharding of both; whether the weights were equal before and after
    parallelize; the block types, and the staged calls begun and the in-layer calls made per
    step (their token shapes, and whether the shared experts ran inside). ``until_decided``
    (batch overlap ``"auto"``): also what its decision showed after the steps, then the
    no-grad forwards it took to decide (whether each split, and its loss against
    TorchTitan's), the forward after it decided, and the EP group it agreed on. ``hooked``:
    a forward hook scaling what it returns on that part of both models' last block (``"moe"``
    or ``"moe.routed_experts"``)."""
    import mc2.integrations.torchtitan as node

    dims = parallel_dims(world, backend)
    ref = build_model(world, backend, None, shared=shared)
    got = build_model(world, backend, options, override, shared)
    same_init = same_state(ref, got)
    ref = parallelize(ref, dims, world, backend)
    got = parallelize(got, dims, world, backend)
    same_shards_init = same_shards(ref, got)
    if hooked == "moe subclass":  # a MoE whose own forward scales the output
        for model in (ref, got):
            moe = model.layers[str(LAYERS - 1)].moe
            base = type(moe)
            moe.__class__ = type("Scaled" + base.__name__, (base,), {
                "forward": lambda self, x, base=base: base.forward(self, x) * 1.5})
    elif hooked is not None:
        for model in (ref, got):
            part = model.layers[str(LAYERS - 1)].get_submodule(hooked)
            part.register_forward_hook(lambda module, args, out: out * 1.5)
    ref_trainer, got_trainer = Trainer(ref, dims), Trainer(got, dims)
    ref_losses, losses, begun = [], [], []
    original = node.begin_split

    def counted(x: Tensor, *args: Any, **kwargs: Any) -> Any:
        begun[-1].append((tuple(x.shape), kwargs["shared"][0] is not None))
        return original(x, *args, **kwargs)

    fused = node.fused_expert

    def counted_fused(x: Tensor, *args: Any, **kwargs: Any) -> Any:
        calls[-1].append((tuple(x.shape), kwargs.get("shared_up") is not None))
        return fused(x, *args, **kwargs)

    node.begin_split, node.fused_expert = counted, counted_fused
    calls: list[list[tuple]] = []
    for tokens, labels in batches(rank, steps):
        ref_losses.append(ref_trainer.step(tokens, labels))
        begun.append([])
        calls.append([])
        losses.append(got_trainer.step(tokens, labels))
    decided = _decide(ref, got, rank, steps, begun, calls) if until_decided else None
    node.begin_split, node.fused_expert = original, fused
    return {"same_init": same_init, "same_shards_init": same_shards_init, "begun": begun,
            "decided": decided,
            "fused_calls": calls,
            "blocks": [type(b).__name__ for b in got.layers.values()],
            "ref_losses": ref_losses, "losses": losses,
            "ref_keys": sorted(ref.state_dict()), "keys": sorted(got.state_dict()),
            "ref_sharding": sharding(ref), "sharding": sharding(got)}


def _decide(ref: torch.nn.Module, got: torch.nn.Module, rank: int, steps: int,
            begun: list[list[tuple]], calls: list[list[tuple]]) -> dict:
    """After the training steps of a ``"auto"`` batch-overlap model: its decision's state and
    its planner's ``batch_overlaps()``; then no-grad forwards on the next batch until it has
    decided (each: whether it split, and its loss against TorchTitan's), and one forward
    after (its loss, staged calls begun and in-layer calls made). ``begun`` and ``calls``: the
    lists the counted calls go to, left as they were."""
    from torchtitan.components.loss import CrossEntropyLoss

    from mc2.engine.decide.planner import planner_for

    first = got.layers["0"]
    decision = first.decision
    group = decision.group
    planner = planner_for(group)
    found: dict[str, Any] = {"after steps": {"chosen": decision.chosen,
                                             "planner": planner.batch_overlaps()},
                             "group": dist.get_process_group_ranks(group)}
    loss_fn = CrossEntropyLoss.Config().build()
    tokens, labels = batches(rank, steps + 1)[steps]
    valid = torch.tensor(labels.numel())

    def loss(model: torch.nn.Module) -> float:
        begun.append([])
        calls.append([])
        return float(loss_fn(model(tokens), labels, valid)[0])

    kept = len(begun)
    with torch.no_grad():
        found["want"] = loss(ref)
        forwards = []
        while decision.chosen is None and len(forwards) < 20:
            forwards.append((loss(got), bool(begun[-1])))
        found["forwards"] = forwards
        found["chosen"] = decision.chosen
        found["planner"] = planner.batch_overlaps()
        found["decided"] = (loss(got), begun[-1], calls[-1])
    del begun[kept:], calls[kept:]
    return found


def pipeline_parallelism(rank: int, world: int, override: str) -> dict:
    """TorchTitan's pipeline parallelism (``pipeline_llm``: the model split into 2 stages of 2
    blocks, each stage parallelized by ``parallelize_qwen3``, its 1F1B schedule) with the
    batch-overlap override, on 4 ranks: with EP = 2 (FSDP over 2 in each stage) the error
    every rank raises (then a barrier); with EP = 1, where TorchTitan does not parallelize the
    blocks, 2 AdamW steps of TorchTitan's model and the override's through the schedule: the
    last stage's losses, the staged calls begun, and the warnings said."""
    import warnings

    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.qwen3 import parallelize_qwen3

    import mc2.integrations.torchtitan as node

    parallel_dims_module.device_type = "cpu"
    backend, layers, dp = "partial_dtensor", 4, world // 2
    set_spmd_backend(backend)
    loss_fn = CrossEntropyLoss.Config().build()
    found: dict[str, Any] = {}
    for ep in (2, 1):
        dims = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=1, pp=2, ep=ep,
                            world_size=world, spmd_backend=backend)
        dims.build_mesh()
        parallelism = ParallelismConfig(
            data_parallel_shard_degree=dp, expert_parallel_degree=ep, pipeline_parallel_degree=2,
            pipeline_parallel_schedule="1F1B", pipeline_parallel_first_stage_less_layers=0,
            pipeline_parallel_last_stage_less_layers=0, spmd_backend=backend)

        def pipeline(options: dict | None, ep: int = ep, dims: Any = dims,
                     parallelism: Any = parallelism) -> tuple:
            model = build_model(world, backend, options, override, shape={"layers": layers},
                                ep=ep)
            return pipeline_llm(
                model, parallel_dims=dims, training=TrainingConfig(local_batch_size=BATCH),
                parallelism=parallelism, compile_config=CompileConfig(), ac_config=None,
                dump_folder="/tmp", device=torch.device("cpu"),
                model_config=qwen3_moe_config({"layers": layers}),
                parallelize_fn=parallelize_qwen3, loss_fn=loss_fn)

        options = {"batch_overlap": True, "min_tokens": 1}
        if ep > 1:
            try:
                pipeline(options)
                found[ep] = "built"
            except ValueError as exc:
                found[ep] = f"ValueError: {exc}"
            dist.barrier()
            continue
        result: dict[str, Any] = {}
        begun: list[tuple] = []
        original = node.begin_split

        def counted(x: Tensor, *args: Any, begun: list = begun, original: Any = original,
                    **kwargs: Any) -> Any:
            begun.append(tuple(x.shape))
            return original(x, *args, **kwargs)

        node.begin_split = counted
        for name, opts in (("ref", None), ("mc2", options)):
            schedule, parts, first, last = pipeline(opts)
            for part in parts:
                sum_reductions_for_gloo(part)
                part.train()
            optimizer = torch.optim.AdamW([p for part in parts for p in part.parameters()],
                                          lr=LR)
            losses = []
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                # a pipeline's stages read the same tokens: seeded by the data-parallel rank
                for tokens, labels in batches(rank % dp, 2):
                    optimizer.zero_grad()
                    valid = torch.tensor(labels.numel() * dp)
                    step_losses: list[Tensor] | None = [] if last else None
                    schedule.step(*((tokens,) if first else ()), target=labels if last else None,
                                  losses=step_losses, loss_kwargs={"global_valid_tokens": valid})
                    optimizer.step()
                    losses.append(float(torch.stack(step_losses).detach().sum()) if last else None)
            result[f"losses {name}"] = losses
            result[f"blocks {name}"] = [type(b).__name__ for part in parts
                                        for b in part.layers.values()]
            result[f"said {name}"] = [str(w.message) for w in said
                                      if "batch overlap" in str(w.message)]
        node.begin_split = original
        result["begun"] = begun
        found[ep] = result
    return found


def batch_overlap_under_checkpointing(rank: int, world: int, override: str) -> str:
    """The batch-overlap model under TorchTitan's full activation checkpointing: the error
    one training step raises (every rank must raise it, before any collective of the step's
    layers), then a barrier."""
    from torchtitan.distributed.activation_checkpoint import FullAC

    dims = parallel_dims(world, "partial_dtensor")
    model = build_model(world, "partial_dtensor", {"batch_overlap": True, "min_tokens": 1},
                        override)
    model = parallelize(model, dims, world, "partial_dtensor", FullAC.Config())
    tokens, labels = batches(rank, 1)[0]
    try:
        Trainer(model, dims).step(tokens, labels)
        found = "trained"
    except ValueError as exc:
        found = f"ValueError: {exc}"
    dist.barrier()
    return found
