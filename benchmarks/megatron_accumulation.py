#!/usr/bin/env python
"""Megatron-Core's gradient accumulation, Megatron's own expert parallelism against mc2's, the
way a ``pretrain_gpt.py`` script runs it: one call of ``get_forward_backward_func()`` per step.

The model of ``benchmarks/accumulation.py`` in Megatron's terms: a ``GPTModel`` of
``--layers`` layers (hidden 1024, ffn 2048, 8 experts top-2, 8 heads, SwiGLU, float32, dropless,
no aux loss, Megatron's local spec), 2 ranks (expert-parallel size 2), ``--micro-batches``
micro-batches of ``--batch`` sequences of ``--seq`` tokens per rank, no optimizer step.
Megatron-Core 0.16.1 with the tests' CPU shims (``tests/megatron_cpu.py``). The modes,
interleaved step by step in one world per regime, median of the slowest rank's steps:

- ``megatron``: Megatron's ``MoELayer`` (alltoall dispatcher) through Megatron's
  ``forward_backward_no_pipelining`` (its sequential loop; its combined 1F1B needs CUDA);
- ``mc2``: the model built from the GPT specs under ``import mc2.integrations.megatron_patch``,
  the same function (MC2 inside each layer, ``"auto"``);
- ``paired``: the same model through ``megatron_schedule.forward_backward_paired``: mc2's
  paired schedule (micro-batch n+1's forward beside n's backward) on every step;
- ``flag``: the same model and Megatron's function with Megatron's own
  ``overlap_moe_expert_parallel_comm=True``: under the patch, the paired schedule where its
  first steps (the warm-up) measured it faster than the sequential loop, else that loop.

The bound, as in ``accumulation.py``: ``max(T_comp, T_comm)``, ``T_comp`` Megatron's step on
plain loopback (its exchanges are synchronous), ``T_comm`` its shaped step minus that::

    sudo .venv/bin/python benchmarks/megatron_accumulation.py --regimes plain,200mbit \\
        --json docs/megatron_accumulation.json
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import mc2  # noqa: E402
from accumulation import _decided, measure_regimes, step_parser  # noqa: E402
from megatron_model import gpt_config  # noqa: E402
from model_overlap import SHAPE  # noqa: E402

MODES = ("megatron", "mc2", "paired", "flag")


def _models(rank: int, world: int, layers: int, seq: int) -> tuple[Any, dict[str, Any]]:
    """``(config, {"megatron": Megatron's model, "mc2": the patched specs' model})``, the same
    weights (the routed experts seeded by rank)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    import mc2.integrations.megatron_patch as megatron_patch
    from megatron.core.models.gpt import gpt_layer_specs

    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    config = gpt_config(world, layers=layers, heads=SHAPE["num_attention_heads"],
                        hidden=SHAPE["hidden_size"], ffn=SHAPE["intermediate_size"],
                        experts=SHAPE["num_local_experts"], topk=SHAPE["num_experts_per_tok"])

    def build() -> Any:
        torch.manual_seed(0)  # dense weights alike on every rank and in both models
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=SHAPE["num_local_experts"], moe_grouped_gemm=False)
        return GPTModel(config=config, transformer_layer_spec=spec,
                        vocab_size=SHAPE["vocab_size"], max_sequence_length=seq)

    megatron_patch.unpatch()
    models = {"megatron": build()}
    megatron_patch.patch(mc2.MC2Config())
    models["mc2"] = build()
    with torch.no_grad():  # this rank's experts, seeded by rank
        g = torch.Generator().manual_seed(100 + rank)
        for name, p in models["megatron"].named_parameters():
            if ".mlp.experts." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    models["mc2"].load_state_dict(models["megatron"].state_dict())
    return config, models


def rank_steps(rank: int, world: int, micro_batches: int, batch: int, seq: int, steps: int,
               rounds: int, modes: tuple[str, ...], layers: int) -> dict[str, Any]:
    from tests import megatron_cpu

    megatron_cpu.install()
    megatron_cpu.cpu_schedules()
    from megatron.core.pipeline_parallel import schedules

    from mc2.device.clock import clock_for
    from mc2.integrations.megatron_schedule import forward_backward_paired
    from layer_rounds import until_auto_locked

    config, models = _models(rank, world, layers, seq)
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, SHAPE["vocab_size"], (batch, seq), generator=g)
               for _ in range(micro_batches)]
    position = torch.arange(seq).expand(batch, seq)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), 1)

    def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        ids = next(data_iterator)
        output = model(ids, position, mask, labels=ids)
        return output, lambda out: (out.float().mean(), {"lm loss": out.detach().mean()})

    def step(mode: str, count: int = micro_batches) -> None:
        config.overlap_moe_expert_parallel_comm = mode == "flag"  # read per call
        function = forward_backward_paired if mode == "paired" else \
            schedules.get_forward_backward_func()
        function(forward_step_func=forward_step, data_iterator=iter(batches[:count]),
                 model=[models["megatron" if mode == "megatron" else "mc2"]],
                 num_microbatches=count, seq_length=seq, micro_batch_size=batch)

    clock = clock_for(torch.device("cpu"))
    times: dict[str, list[float]] = {m: [] for m in modes}
    found: dict[str, Any] = {}
    for mode in modes:  # warm up every mode (and let the in-layer "auto" settle its K)
        step(mode)
        until_auto_locked(lambda m=mode: step(m, 1) if m in ("megatron", "mc2") else step(m))
        if mode == "flag":  # the flag's "auto" decides on whole steps
            found["flag_chose_pairing"] = _decided(models["mc2"], lambda: step("flag"))
    for _ in range(rounds):
        for mode in modes:
            step(mode)  # untimed at every switch
            for _ in range(steps):
                for model in models.values():
                    model.zero_grad(set_to_none=True)
                torch.distributed.barrier()
                start = clock.stamp()
                step(mode)
                times[mode].append(clock.elapsed(start, clock.stamp()))
    return {"times": times, **found}


def main() -> int:
    parser = step_parser(__doc__, "plain,200mbit", MODES)
    args = parser.parse_args()
    measure_regimes(rank_steps, args, tuple(args.modes.split(",")), serial="megatron")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
