"""Hugging Face's ``Trainer`` with gradient accumulation: its own expert parallelism, mc2's, and
mc2's with each micro-batch's forward beside the previous one's backward.

The Mixtral-shaped model of ``benchmarks/hf_native.py`` (hidden 1024, ffn 2048, 8 experts top-2,
2 layers, vocab 4096, 8 heads) loaded on 2 local ranks with ``DistributedConfig(ep_size=2,
fsdp_size=2, ep_implementation=...)``, one ``Trainer`` per mode in the same world, the same
weights: ``--micro-batches`` micro-batches of ``--batch`` sequences of ``--seq`` tokens per
rank an optimizer step (AdamW). Modes:

- ``hf``: ``ep_implementation="all_to_all"`` (Hugging Face's own), ``Trainer`` as it is;
- ``mc2``: ``ep_implementation="mc2"``, ``Trainer`` as it is;
- ``paired``: ``ep_implementation="mc2"`` with
  :func:`mc2.integrations.transformers_schedule.pair_accumulation`.

Each round runs every mode's ``Trainer.train()`` for 2 optimizer steps, the modes interleaved
round by round; the second step of each (the first one warms) is timed by a callback from its
``on_step_begin`` to its ``on_step_end`` (the micro-batches, clipping, the optimizer step);
median over the rounds of the slower rank. Regimes: plain loopback and loopback shaped with
``tc tbf`` (root; always removed)::

    sudo .venv/bin/python benchmarks/hf_trainer_accumulation.py --regimes plain,200mbit \\
        --json docs/hf_trainer_accumulation.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_peers import in_regime  # noqa: E402
from hf_native import SHAPE, each_regime  # noqa: E402

import mc2  # noqa: E402

MODES = ("hf", "mc2", "paired")


def _rank(rank: int, world: int, path: str, modes: tuple[str, ...], micro_batches: int,
          batch: int, seq: int, rounds: int) -> dict[str, list[float]]:
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments
    from transformers.distributed import DistributedConfig

    import mc2.integrations.hf_expert_parallel  # noqa: F401  registers "mc2"
    from mc2.integrations.transformers_schedule import pair_accumulation

    os.environ.setdefault("LOCAL_RANK", str(rank))
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(7)  # the same samples for every mode (the sampler splits)
    samples = [{"input_ids": (ids := torch.randint(0, SHAPE["vocab_size"], (seq,),
                                                   generator=g)), "labels": ids}
               for _ in range(world * batch * micro_batches * 2)]

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.times.append(time.perf_counter() - self.start)

    trainers, clocks = {}, {}
    for mode in modes:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, distributed_config=DistributedConfig(
                ep_size=world, fsdp_size=world,
                ep_implementation="all_to_all" if mode == "hf" else "mc2"))
        args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch,
                                 gradient_accumulation_steps=micro_batches, max_steps=2,
                                 report_to=[], use_cpu=True, save_strategy="no",
                                 dataloader_num_workers=0, disable_tqdm=True,
                                 logging_strategy="no")
        clocks[mode] = StepTimes()
        trainers[mode] = Trainer(model=model, args=args, train_dataset=samples,
                                 callbacks=[clocks[mode]])
        if mode == "paired":
            pair_accumulation(trainers[mode])
    times: dict[str, list[float]] = {m: [] for m in modes}
    for n in range(rounds):
        for mode in (modes if n % 2 == 0 else modes[::-1]):
            torch.distributed.barrier()
            trainers[mode].train()
            times[mode].append(clocks[mode].times[-1])  # the second step: the first warms
    return times


def run(regime: str, args: argparse.Namespace, path: str) -> dict[str, Any]:
    modes = tuple(args.modes.split(","))
    call = lambda: mc2.run_local(  # noqa: E731
        _rank, 2, args=(path, modes, args.micro_batches, args.batch, args.seq, args.rounds),
        deadline_s=7200, timeout_s=3600)
    results = in_regime(regime, call)
    row: dict[str, Any] = {"regime": regime}
    for mode in modes:
        rounds = [max(r[mode][k] for r in results) for k in range(args.rounds)]
        row[mode] = {"median_s": statistics.median(rounds), "rounds_s": rounds}
        print(f"{regime:>8} {mode:>7}: {row[mode]['median_s']:.2f} s  "
              f"({', '.join(f'{t:.2f}' for t in rounds)})", flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--regimes", default="plain")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--batch", type=int, default=2, help="sequences per micro-batch and rank")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    saved = lambda rows: {"args": vars(args) | {"json": str(args.json)},  # noqa: E731
                          "results": rows}
    for _ in each_regime(args, run, saved):
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
