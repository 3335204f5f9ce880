#!/usr/bin/env python
"""Memory and step time of the PyTorch training stack around mc2: replicated vs FSDP2, and
activation checkpointing off / full / selective.

A Mixtral-shaped model scaled to this machine (hidden 1024, ffn 2048, 8 experts, top-2,
2 decoder layers, 8 heads, byte vocabulary), ``enable_mc2`` on 4 ranks as dp 2 x ep 2, plain
processes, AdamW. Each configuration runs in a world of its own (the peak RSS of a process is
the peak of its life), the configurations interleaved over ``--rounds``; a configuration's step
time is the median over its measured steps and rounds. Rows:

- ``replicated``: every non-expert parameter on every rank, ``mc2.GradientSync`` overlapped;
- ``fsdp``: ``mc2.fully_shard`` (experts over ``dp``, the rest over the world);
- ``+ ac full``: ``torch.utils.checkpoint`` (non-reentrant) around each decoder layer;
- ``+ ac selective``: the same with ``mc2.checkpoint_policy()`` (the fused call's rows kept,
  its recompute makes no All-to-All).

Every configuration trains on the same batches from the same weights, so their losses must
agree (reported as the largest difference from the first row). ``state MB`` is what a rank
holds in parameters, gradients and AdamW moments (exact). The training peak RSS is measured
from the end of the setup (Linux ``VmHWM`` reset through ``clear_refs`` after returning freed
memory): every rank builds the full model before ``enable_mc2`` keeps its experts, and that
build's peak (reported apart) would otherwise hide the difference. It adds the process itself
(Python, torch, transformers: about 330 MiB), activations, buffers and FSDP's gathered
parameters to the state.

    .venv/bin/python benchmarks/stack.py --steps 4 --rounds 2 --out docs/stack.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

import mc2

CONFIGS = ("replicated", "replicated+selective", "fsdp", "fsdp+full", "fsdp+selective")
SHAPE = dict(vocab_size=256, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=8, num_local_experts=8,
             num_experts_per_tok=2, max_position_embeddings=1024, tie_word_embeddings=False)


def _model() -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(**SHAPE))


def _checkpointing(model: Any, kind: str) -> None:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if kind == "off":
        return
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if kind == "selective":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts,
                                       mc2.checkpoint_policy())
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def rank_run(rank: int, world: int, config: str, steps: int, seq: int, micro_batches: int
             ) -> dict[str, Any]:
    """One configuration on this rank: step times, losses, peak RSS."""
    from mc2.device.clock import clock_for
    from mc2.integrations.transformers import enable_mc2

    sharding, _, ac = config.partition("+")
    mesh = mc2.expert_parallel_mesh(2, num_experts=SHAPE["num_local_experts"])
    model = _model()
    enable_mc2(model, mesh=mesh, micro_batches=micro_batches)
    model.train()
    _checkpointing(model, ac or "off")
    sync = None
    if sharding == "fsdp":
        mc2.fully_shard(model)
    else:
        sync = mc2.GradientSync(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    setup_peak_mb = _reset_peak()  # the build's peak: every rank makes the full model first
    g = torch.Generator().manual_seed(1)
    batches = torch.randint(0, SHAPE["vocab_size"], (steps + 1, world, 1, seq), generator=g)
    clock = clock_for(torch.device("cpu"))
    times, losses = [], []
    for step in range(steps + 1):  # the first is a warm-up
        ids = batches[step, rank]
        torch.distributed.barrier()
        start = clock.stamp()
        loss = model(ids, labels=ids, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if sync is not None:
            sync.wait()
        opt.step()
        elapsed = clock.elapsed(start, clock.stamp())
        if step:
            times.append(elapsed)
        losses.append(loss.item())
    return {"times": times, "losses": losses, "peak_rss_mb": _peak_mb(),
            "setup_peak_rss_mb": setup_peak_mb, "state_mb": _state_bytes(model, opt) / 2**20}


def _peak_mb() -> float:
    """This process's peak RSS since the last reset (Linux ``VmHWM``), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak() -> float:
    """Return freed memory to the system and restart the peak RSS from now (Linux
    ``clear_refs``); the peak so far, MiB. Training's peak is then measured alone."""
    import ctypes
    import gc

    before = _peak_mb()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return before


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _state_bytes(model: Any, opt: Any) -> int:
    """Bytes this rank holds in parameters, gradients and optimizer state (exact)."""
    tensors = [p for p in model.parameters()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for state in opt.state.values() for v in state.values()
                if isinstance(v, torch.Tensor)]
    return sum(_local(t).numel() * t.element_size() for t in tensors)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="measured steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--seq", type=int, default=512, help="tokens per rank per step")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    configs = args.configs.split(",")
    results: dict[str, list[list[dict[str, Any]]]] = {c: [] for c in configs}
    for round_ in range(args.rounds):
        for config in configs:
            print(f"== round {round_ + 1}/{args.rounds}: {config}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            ranks = mc2.run_local(rank_run, 4, args=(config, args.steps, args.seq,
                                                     args.micro_batches), timeout_s=1800)
            results[config].append(ranks)
            print(f"   {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    first = results[configs[0]][0]
    rows = []
    for config in configs:
        runs = results[config]
        times = [t for ranks in runs for t in ranks[0]["times"]]
        step = statistics.median(max(r["times"][i] for r in ranks)
                                 for ranks in runs for i in range(len(ranks[0]["times"])))
        peak = max(r["peak_rss_mb"] for ranks in runs for r in ranks)
        setup = max(r["setup_peak_rss_mb"] for ranks in runs for r in ranks)
        diff = max(abs(a - b) for ranks in runs for r, f in zip(ranks, first)
                   for a, b in zip(r["losses"], f["losses"]))
        state = max(r["state_mb"] for ranks in runs for r in ranks)
        rows.append({"config": config, "step_s": step, "peak_rss_mb_per_rank": peak,
                     "setup_peak_rss_mb_per_rank": setup,
                     "state_mb_per_rank": state,
                     "loss_diff": diff, "tokens_per_s_per_rank": args.seq / step,
                     "times_rank0": times})
    base = rows[0]
    print(f"\n{'configuration':<24}{'step s':>9}{'vs first':>10}{'tok/s/rank':>12}"
          f"{'state MB/rank':>15}{'train peak RSS MB':>19}{'loss diff':>12}")
    for r in rows:
        print(f"{r['config']:<24}{r['step_s']:>9.2f}{r['step_s'] / base['step_s']:>10.2f}"
              f"{r['tokens_per_s_per_rank']:>12.0f}{r['state_mb_per_rank']:>15.0f}"
              f"{r['peak_rss_mb_per_rank']:>19.0f}{r['loss_diff']:>12.2e}")
    if args.out:
        args.out.write_text(json.dumps({"shape": SHAPE, "args": vars(args) | {"out": str(args.out)},
                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
