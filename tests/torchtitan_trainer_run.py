"""TorchTitan's own ``Trainer``, built and trained several times one after another in one
``torchrun`` world (``--runs``): as TorchTitan builds it; with mc2's routed experts named in
``override.imports``, as its command line would name them; with the paired gradient
accumulation too; and paired with mc2's selective-checkpointing policy. Activation
checkpointing is TorchTitan's default, selective, unless ``--activation-checkpoint`` says.
Writes each run's per-step global losses and gradient norms, and what the paired run did (or
what a trainer refused), to ``--out``, a file per rank. Run by
tests/test_torchtitan_trainer.py::

    python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        tests/torchtitan_trainer_run.py --out result --param-dtype float32

Everything below is TorchTitan's: ``Trainer.__init__`` (its distributed init, which turns
autograd's device threads off, its meshes, ``update_from_config``, the overrides, the
meta-device build, ``parallelize_qwen3``, ``init_weights``, its optimizer and load-balancing
hook, its checkpoint manager) and ``Trainer.train`` (``train_step``'s gradient accumulation,
``clip_grad_norm_``, the optimizer and scheduler steps, its loss metrics). What is the test's,
each through the extension point TorchTitan gives it:

- **The device.** TorchTitan falls back to ``"cuda"`` without an accelerator. Before it is
  imported, torch's ``_get_available_device_type`` says ``"cpu"``, and the device module
  TorchTitan takes for it is ``torch.cpu`` with the memory statistics its metrics read
  answered with zeros (:class:`_CpuAsDevice`). The process group is Gloo (TorchTitan's own
  choice for the CPU).
- **torch 2.13**: TorchTitan 0.3.0 calls ``torch.distributed.set_timeout`` after the first
  step, which torch 2.13 has as ``distributed_c10d._set_pg_timeout``.
- **The model spec**: TorchTitan's Qwen3 MoE
(:func:`tests.workers_torchtitan_model.qwen3_moe_config`,
  its inner attention SDPA, as that module says why) with TorchTitan's ``parallelize_qwen3``,
  then FSDP's reductions as plain sums (Gloo has no ``PREMUL_SUM``; the same sums).
- **The data**: a data loader and a tokenizer of the test's (TorchTitan's read datasets or
  tokenizer files from disk): the bigram tokens of ``workers_torchtitan_model.batches``.
- **The metrics**: TorchTitan's processor, which also keeps the losses it logs.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import types
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch._utils


class _CpuAsDevice(types.ModuleType):
    """``torch.cpu`` as TorchTitan's device module, with the memory statistics its metrics
    read (none are kept for the CPU: zeros), the device properties it logs, and the device
    index its barrier passes (``torch.cpu.current_device()`` is a string)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:  # an index, as barrier(device_ids=...) takes it
        return 0

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        return types.SimpleNamespace(total_memory=1)

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None


torch._utils._get_available_device_type = lambda: "cpu"
_device_module = torch._utils._get_device_module
torch._utils._get_device_module = lambda kind: (  # type: ignore[assignment]
    _CpuAsDevice("cpu") if kind == "cpu" else _device_module(kind))

if not hasattr(torch.distributed, "set_timeout"):  # torch 2.13's name for it is private
    torch.distributed.set_timeout = torch.distributed.distributed_c10d._set_pg_timeout

import torch.testing._internal.distributed.fake_pg  # noqa: E402,F401  size-1 mesh axes
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402

from tests import workers_torchtitan_model as m  # noqa: E402

STEPS, MICRO_BATCHES = 3, 3
ROUTED = "mc2.integrations.torchtitan.mc2_routed_experts"
PAIRED = "mc2.integrations.torchtitan_schedule.mc2_paired_accumulation"
MC2_POLICY = "mc2.integrations.torchtitan.mc2_selective_ac"


class Tokens(BaseDataLoader):
    """This rank's bigram micro-batches without end (those of
    ``workers_torchtitan_model.batches`` at its shape), each as TorchTitan's loaders yield
    one."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        vocab: int = m.VOCAB

    def __init__(self, config: Config, *, dp_rank: int, local_batch_size: int, seq_len: int,
                 **_: Any) -> None:
        self.vocab, self.shape = config.vocab, (local_batch_size, seq_len)
        self.generator = torch.Generator().manual_seed(1000 + dp_rank)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            tokens = torch.randint(0, self.vocab, self.shape, generator=self.generator)
            yield {"input": tokens}, (tokens * 7 + 3) % self.vocab

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None


class Vocabulary(BaseTokenizer):
    """The token ids as they are (the data is token ids already)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config, **_: Any) -> None:
        super().__init__()

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise NotImplementedError("the test's data is token ids")

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError("the test's data is token ids")

    def get_vocab_size(self) -> int:
        return m.VOCAB


class KeptMetrics(MetricsProcessor):
    """TorchTitan's metrics processor that keeps what it logs."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kept: list[tuple[float, float]] = []

    def log(self, step: int, global_avg_loss: float, global_max_loss: float,
            grad_norm: float, extra_metrics: dict[str, Any] | None = None) -> None:
        self.kept.append((global_avg_loss, grad_norm))
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)


def parallelize_for_gloo(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    """TorchTitan's ``parallelize_qwen3``, FSDP's reductions then sent as plain sums."""
    from torchtitan.models.qwen3 import parallelize_qwen3

    model = parallelize_qwen3(model, **kwargs)
    m.sum_reductions_for_gloo(model)
    return model


def config(overrides: list[str], param_dtype: str, checkpointing: str, *,
           shape: dict[str, int] | None = None, batch: int = m.BATCH,
           micro_batches: int = MICRO_BATCHES, steps: int = STEPS) -> Any:
    """The trainer's config: the model of ``workers_torchtitan_model.qwen3_moe_config(shape)``,
    ``micro_batches`` of ``batch`` sequences (of its ``seq``) per rank and step."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.optimizer.optimizer import register_moe_load_balancing_hook
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.config import DebugConfig, OverrideConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.trainer import Trainer

    world = int(os.environ["WORLD_SIZE"])
    model = m.qwen3_moe_config(shape)
    seq = (shape or {}).get("seq", m.SEQ)
    spec = ModelSpec(name="qwen3", flavor="mc2-test", model=model,
                     parallelize_fn=parallelize_for_gloo, pipelining_fn=None,
                     post_optimizer_build_fn=register_moe_load_balancing_hook,
                     state_dict_adapter=None)
    return Trainer.Config(
        model_spec=spec,
        loss=CrossEntropyLoss.Config(),
        tokenizer=Vocabulary.Config(),
        dataloader=Tokens.Config(vocab=model.vocab_size),
        metrics=KeptMetrics.Config(log_freq=1),
        optimizer=default_adamw(lr=m.LR),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=1),
        training=TrainingConfig(local_batch_size=batch, seq_len=seq, steps=steps,
                                global_batch_size=batch * world * micro_batches,
                                disable_cuda_graphs=True, mixed_precision_param=param_dtype),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1,
                                      expert_parallel_degree=m.EP,
                                      spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(),
        activation_checkpoint={"full": FullAC.Config(), "selective": SelectiveAC.Config(),
                               "none": None}[checkpointing],
        override=OverrideConfig(imports=overrides),
        debug=DebugConfig(seed=0),
        dump_folder="/tmp/mc2-torchtitan-trainer")


def train(overrides: list[str], checkpointing: str, param_dtype: str) -> dict[str, Any]:
    """One trainer's run (a ``ValueError`` it raised, a refusal, and the step it reached,
    instead, where it raised one)."""
    from torchtitan.trainer import Trainer

    trainer = Trainer(config(overrides, param_dtype, checkpointing))
    own = trainer.fwd_bwd_fn
    from mc2.engine.autograd.recompute import selective_region

    # where each MoE forward ran (the paired ones: the partner's), and whether inside a
    # selective-checkpointing region (where mc2's calls run as the operator)
    threads: list[tuple[str, bool]] = []
    for layer in trainer.model_parts[0].layers.values():
        layer.moe.register_forward_pre_hook(
            lambda *_: threads.append((threading.current_thread().name, selective_region())))
    try:
        trainer.train()
    except ValueError as exc:
        return {"refused": str(exc), "step": trainer.step}
    kept = trainer.metrics_processor.kept
    return {"losses": [loss for loss, _ in kept], "grad_norms": [g for _, g in kept],
            "accumulation": trainer.gradient_accumulation_steps,
            "fwd_bwd_fn": type(trainer.fwd_bwd_fn).__name__ if trainer.fwd_bwd_fn is not own
            else "TorchTitan's own",
            "multithreading": torch.autograd.is_multithreading_enabled(),
            "paired_forwards": [name for name, _ in threads].count("mc2-paired-forward"),
            "in_selective_regions": sum(selective for _, selective in threads),
            "nodes": sorted({type(layer.moe.routed_experts).__name__
                             for layer in trainer.model_parts[0].layers.values()})}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="a JSON file per rank: OUT.rank<N>")
    parser.add_argument("--param-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--activation-checkpoint", default="selective",
                        choices=("full", "selective", "none"))
    parser.add_argument("--runs", default="own,in_layer,paired,paired_mc2_policy",
                        help="trainers, one after another: TorchTitan's own, with mc2's "
                             "experts, paired too, and paired with mc2's selective "
                             "checkpointing policy (which saves mc2's call)")
    args = parser.parse_args()
    runs = {"own": ([], args.activation_checkpoint),
            "in_layer": ([ROUTED], args.activation_checkpoint),
            "paired": ([ROUTED, PAIRED], args.activation_checkpoint),
            "paired_mc2_policy": ([ROUTED, MC2_POLICY, PAIRED], "selective")}
    result = {run: train(*runs[run], args.param_dtype) for run in args.runs.split(",")}
    with open(f"{args.out}.rank{torch.distributed.get_rank()}", "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
