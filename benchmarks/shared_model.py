#!/usr/bin/env python
"""A shared-expert model's step against the same model without its shared experts.

A Qwen2-MoE-shaped Hugging Face model scaled to this machine (hidden 1024, expert ffn 2048,
8 experts, top-2, a gated shared expert of ffn ``--shared-ffn``, 8 attention heads, 2 decoder
layers, sequences of 256, ``--tokens`` per rank), 2 ranks, ``enable_mc2`` (MC2 inside each
layer, ``micro_batches="auto"``), forward + backward, one world per regime, modes interleaved
round by round (each mode's block of ``--steps`` after one untimed step):

- ``shared``: the model as it is: each block's shared expert runs inside mc2's call, half of
  its forward under the first dispatch and half under the last combine, its backward under
  the first gradient dispatch;
- ``routed``: the same model with its shared experts taken out of the blocks;
- ``alone``: the shared experts' forward and backward by themselves (every layer's MLP and
  gate on this rank's tokens, no call).

Hidden share ``1 - (shared - routed) / alone``: 1, the shared experts cost the step nothing; 0,
they add all their own time. Medians of the slowest rank per step::

    .venv/bin/python benchmarks/shared_model.py --regimes 200mbit,plain \\
        --json docs/shared_model.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from layer_rounds import until_auto_locked  # noqa: E402
from shared_fill_drain import MODES, main_with  # noqa: E402
SEQ = 256


def _model(shared_ffn: int) -> Any:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from mc2.integrations.transformers import enable_mc2

    torch.manual_seed(0)
    config = Qwen2MoeConfig(
        vocab_size=256, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=2048,
        shared_expert_intermediate_size=shared_ffn, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=8, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=1024, tie_word_embeddings=False)
    model = Qwen2MoeForCausalLM(config)
    enable_mc2(model, micro_batches="auto")
    return model


def rank_steps(rank: int, world: int, tokens: int, shared_ffn: int, steps: int, rounds: int
               ) -> dict[str, list[float]]:
    """Each mode's step seconds on this rank."""
    from mc2.integrations.transformers import MC2SparseMoeBlock

    model = _model(shared_ffn)
    model.train()
    blocks = [b for b in model.modules() if isinstance(b, MC2SparseMoeBlock)]
    shared = [(b.shared_expert, b.shared_expert_gate) for b in blocks]
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 256, (tokens // SEQ, SEQ), generator=g)
    x = torch.randn(tokens, 1024, generator=g).requires_grad_(True)

    def set_mode(mode: str) -> None:
        for b, (mlp, gate) in zip(blocks, shared):
            b.shared_expert, b.shared_expert_gate = (None, None) if mode == "routed" else (mlp,
                                                                                          gate)

    def step(mode: str) -> None:
        model.zero_grad(set_to_none=True)
        if mode == "alone":
            out = sum(torch.sigmoid(gate(x)) * mlp(x) for mlp, gate in shared)
            out.sum().backward()
            return
        model(ids, labels=ids, use_cache=False).loss.backward()

    times: dict[str, list[float]] = {m: [] for m in MODES}
    for mode in MODES:  # warm up; the layers' "auto" settles its K per shape
        set_mode(mode)
        step(mode)
        if mode != "alone":
            until_auto_locked(lambda m=mode: step(m))
    for _ in range(rounds):
        for mode in MODES:
            set_mode(mode)
            step(mode)
            for _ in range(steps):
                torch.distributed.barrier()
                start = time.perf_counter()
                step(mode)
                times[mode].append(time.perf_counter() - start)
    return times


def main() -> int:
    return main_with(__doc__, rank_steps, regimes="200mbit,plain", rounds=3, option="steps",
                     default=2, help="steps per mode and round")


if __name__ == "__main__":
    sys.exit(main())
