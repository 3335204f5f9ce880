#!/usr/bin/env python
"""TorchTitan's gradient accumulation, its own expert parallelism against mc2's, the way its
``train_step`` runs it: the step's global token count, then ``fwd_bwd_fn`` once per
micro-batch (a stand-in for the trainer, ``tests/workers_torchtitan_model.AccumulatingTrainer``:
the trainer itself needs ``torchdata`` and an accelerator).

The model of ``benchmarks/accumulation.py`` in TorchTitan's terms: its Qwen3 MoE (``--layers``
layers, dim 1024, expert hidden 2048, 8 experts top-2, 8 heads), parallelized by its own
``parallelize_qwen3`` on 2 ranks (FSDP over the 2 with bfloat16 parameters, EP = 2),
``--micro-batches`` micro-batches of ``--batch`` sequences of ``--seq`` tokens per rank, no
optimizer step. The modes, interleaved step by step in one world per regime, median of the
slowest rank's steps:

- ``torchtitan``: TorchTitan's model (its all-to-all dispatcher) through its loop;
- ``mc2``: the same weights with ``mc2_routed_experts`` (in-layer, ``"auto"``), its loop;
- ``held``: that model, its loop, with FSDP2's units held gathered and reducing once, in the
  last backward, as the paired loop holds them (what the holding alone buys);
- ``paired``: that model with ``pair_accumulation``: each micro-batch's forward beside the
  previous one's backward.

FSDP's all-gathers and reduce-scatters cross the same link as the All-to-Alls, and TorchTitan's
loop reduce-scatters after every micro-batch; ``held`` and ``paired`` once a step. The bound,
as in ``accumulation.py``: ``max(T_comp, T_comm)``, ``T_comp`` TorchTitan's step on plain
loopback, ``T_comm`` its shaped step minus that::

    sudo .venv/bin/python benchmarks/torchtitan_accumulation.py --regimes plain,200mbit \\
        --json docs/torchtitan_accumulation.json
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from accumulation import (  # noqa: E402
    measure_memory, measure_regimes, peak_above_built, step_parser)
from model_overlap import SHAPE  # noqa: E402

MODES = ("torchtitan", "mc2", "held", "paired")


def _trainers(rank: int, world: int, modes: tuple[str, ...], micro_batches: int, batch: int,
              seq: int, layers: int) -> tuple[dict[str, Any], list[Any]]:
    """Each mode's trainer (its model built, parallelized, its ``fwd_bwd_fn`` set), and this
    rank's micro-batches."""
    from mc2.integrations.torchtitan_schedule import pair_accumulation
    from mc2.parallel.paired_fsdp import PairedSharding
    from tests import workers_torchtitan_model as w

    dims = w.parallel_dims(world, "partial_dtensor")
    heads = SHAPE["num_attention_heads"]
    shape = dict(dim=SHAPE["hidden_size"], layers=layers, heads=heads, kv_heads=heads,
                 head_dim=SHAPE["hidden_size"] // heads, experts=8, top_k=2,
                 moe_hidden=SHAPE["intermediate_size"], seq=seq, vocab=256)
    trainers = {}
    for mode in modes:
        options = None if mode == "torchtitan" else {"micro_batches": "auto"}
        model = w.parallelize(w.build_model(world, "partial_dtensor", options, w.MC2,
                                            shape=shape), dims, world, "partial_dtensor")
        trainers[mode] = w.AccumulatingTrainer(model, dims, micro_batches)
    if "paired" in trainers:
        pair_accumulation(trainers["paired"])
    if "held" in trainers:
        trainers["held"].fwd_bwd_fn = _held(trainers["held"], PairedSharding)
    g = torch.Generator().manual_seed(1000 + rank)
    data = []
    for _ in range(micro_batches):
        tokens = torch.randint(0, 256, (batch, seq), generator=g)
        data.append((tokens, (tokens * 7 + 3) % 256))
    return trainers, data


def rank_memory(rank: int, world: int, mode: str, micro_batches: int, batch: int, seq: int,
                layers: int) -> dict[str, float]:
    """This process's peak resident memory over three steps of ``mode`` alone (a world of its
    own: the peak is a high-water mark), less what it held once the model was built."""
    trainers, data = _trainers(rank, world, (mode,), micro_batches, batch, seq, layers)
    return peak_above_built(lambda: trainers[mode].accumulate(data))


def rank_steps(rank: int, world: int, micro_batches: int, batch: int, seq: int, steps: int,
               rounds: int, modes: tuple[str, ...], layers: int) -> dict[str, Any]:
    trainers, data = _trainers(rank, world, modes, micro_batches, batch, seq, layers)
    return _interleaved(lambda mode: trainers[mode].accumulate(data), modes, steps, rounds)


def _interleaved(step: Any, modes: tuple[str, ...], steps: int, rounds: int
                 ) -> dict[str, Any]:
    """``step(mode)`` (one step; its global loss) of every mode, warmed up twice (and
    ``"auto"`` settled: 4 calls a step), then ``rounds`` rounds of ``steps`` timed steps per
    mode, one untimed at every switch: each mode's times and last loss."""
    import torch.distributed as dist

    from mc2.device.clock import clock_for

    clock = clock_for(torch.device("cpu"))
    times: dict[str, list[float]] = {m: [] for m in modes}
    losses = {}
    for mode in modes:
        for _ in range(2):
            step(mode)
    for _ in range(rounds):
        for mode in modes:
            step(mode)
            for _ in range(steps):
                dist.barrier()
                start = clock.stamp()
                losses[mode] = step(mode)
                times[mode].append(clock.elapsed(start, clock.stamp()))
    return {"times": times, "losses": losses}


TRAINER_MODES = ("torchtitan", "mc2", "paired")


def rank_trainer_steps(rank: int, world: int, micro_batches: int, batch: int, seq: int,
                       steps: int, rounds: int, modes: tuple[str, ...], layers: int
                       ) -> dict[str, Any]:
    """``--trainer``: :func:`rank_steps` with TorchTitan's own ``Trainer`` per mode (built as
    tests/torchtitan_trainer_run.py builds it, with its CPU shims; bfloat16 parameters, its
    default selective activation checkpointing), each step its ``train_step`` (the
    micro-batches' ``fwd_bwd_fn``, gradient clipping, the AdamW step): ``torchtitan`` as
    TorchTitan builds it, ``mc2`` with ``mc2_routed_experts`` and ``mc2_selective_ac``,
    ``paired`` with ``mc2_paired_accumulation`` too (paired at the checkpoint manager's
    ``load``, as ``train()`` begins); ``mc2-titan-policy`` and ``paired-titan-policy``
    without ``mc2_selective_ac`` (TorchTitan's policy recomputes mc2's call, exchanges
    included)."""
    # TorchTitan's own distributed init turns autograd's device threads off; the world here
    # exists already (mc2.run_local's), so it skips that init: turned off as it would be
    torch.autograd.set_multithreading_enabled(False)
    from tests import torchtitan_trainer_run as run  # its CPU shims, before TorchTitan
    from torchtitan.trainer import Trainer

    heads = SHAPE["num_attention_heads"]
    shape = dict(dim=SHAPE["hidden_size"], layers=layers, heads=heads, kv_heads=heads,
                 head_dim=SHAPE["hidden_size"] // heads, experts=8, top_k=2,
                 moe_hidden=SHAPE["intermediate_size"], seq=seq, vocab=256)
    # mc2's with its selective-checkpointing policy, which saves its call (TorchTitan's own
    # does not: its recompute would run the call's exchanges again)
    overrides = {"torchtitan": [], "mc2": [run.ROUTED, run.MC2_POLICY],
                 "paired": [run.ROUTED, run.MC2_POLICY, run.PAIRED],
                 "mc2-titan-policy": [run.ROUTED],
                 "paired-titan-policy": [run.ROUTED, run.PAIRED]}
    trainers, data = {}, {}
    for mode in modes:
        trainer = Trainer(run.config(overrides[mode], "bfloat16", "selective", shape=shape,
                                     batch=batch, micro_batches=micro_batches, steps=10**6))
        trainer.checkpointer.load(step=-1)  # as train() begins
        trainers[mode], data[mode] = trainer, trainer.batch_generator(trainer.dataloader)

    def step(mode: str) -> float:
        trainer = trainers[mode]
        trainer.step += 1
        trainer.train_step(data[mode])
        return trainer.metrics_processor.kept[-1][0]

    return _interleaved(step, modes, steps, rounds)


def _held(trainer: Any, sharding_class: Any) -> Any:
    """``trainer``'s own ``fwd_bwd_fn`` with FSDP2's units held gathered from the step's first
    forward to its last backward (each backward still right after its forward)."""
    sharding = sharding_class(trainer.model)
    scope: list[Any] = []

    def fwd_bwd(inputs: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                extra: dict) -> torch.Tensor:
        if not scope:
            scope.append(sharding.held())
            scope[0].__enter__()
        last = len(scope) == trainer.gradient_accumulation_steps
        if last:
            scope[0].__exit__(None, None, None)
        with trainer.train_context():
            loss, _ = trainer.loss_fn(trainer.model(inputs, **extra), labels, valid)
            sharding.finished(loss).backward()
        if last:
            scope.clear()
        else:
            scope.append(None)
        return loss

    return fwd_bwd


def main() -> int:
    parser = step_parser(__doc__, "plain,200mbit", MODES, memory=True)
    parser.add_argument("--trainer", action="store_true",
                        help="TorchTitan's own Trainer and train_step per mode (modes "
                             + ",".join(TRAINER_MODES) + "), not the stand-in loop")
    args = parser.parse_args()
    if args.memory:
        measure_memory(rank_memory, args)
        return 0
    if args.trainer:
        if args.modes == ",".join(MODES):
            args.modes = ",".join(TRAINER_MODES)
        measure_regimes(rank_trainer_steps, args, tuple(args.modes.split(",")),
                        serial="torchtitan")
        return 0
    measure_regimes(rank_steps, args, tuple(args.modes.split(",")), serial="torchtitan")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
