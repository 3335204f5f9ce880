"""A whole Megatron-Core ``GPTModel`` (MoE in every layer): Megatron's own expert parallelism
against mc2 inside each layer and mc2's batch overlap across layers, the same weights.

2 local Gloo ranks (expert-parallel size 2), megatron-core 0.16.1 with the tests' CPU shims
(``tests/megatron_cpu.py``). The model is the one of ``benchmarks/model_overlap.py`` in
Megatron's terms: hidden 1024, ffn 2048, 8 experts top-2, 8 heads, 2 layers, sequences of 512
(``--tokens`` per rank: ``tokens / 512`` sequences), float32, SwiGLU, dropless, no aux loss
(batch overlap refuses a batch-wide one), Megatron's local spec. One step is ``loss =
model(ids, positions, mask, labels).mean(); loss.backward()`` (no optimizer, no DDP: the
dense gradients' all-reduce would be the same in every implementation). Implementations
(``--impls``):

- ``megatron``: Megatron's ``MoELayer``, alltoall dispatcher;
- ``mc2``: ``use_mc2(spec)``, mc2 inside each layer (``"auto"``);
- ``batch``: ``use_mc2(spec, batch_overlap=True)``: the two halves of the batch through the
  layers stage by stage;
- ``batch_auto``: ``batch_overlap="auto"`` (decided in its warm-up steps).

Measured in interleaved rounds (:mod:`layer_rounds`), the slowest rank's step, median::

    .venv/bin/python benchmarks/megatron_model.py --regimes plain,200mbit --json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import mc2  # noqa: E402
from mc2.engine.decide.planner import planner_for  # noqa: E402
from layer_rounds import layer_benchmark, model_rounds  # noqa: E402

SEQ, LAYERS, HEADS, VOCAB = 512, 2, 8, 256


def _spec(impl: str, spec: Any) -> Any:
    from mc2.integrations.megatron import use_mc2

    if impl == "megatron":
        return spec
    overlap = {"mc2": False, "batch": True, "batch_auto": "auto"}.get(impl)
    if overlap is None:
        raise ValueError(f"impls: unknown implementation {impl!r}")
    return use_mc2(spec, config=mc2.MC2Config(), batch_overlap=overlap)


def gpt_config(world: int, *, layers: int, heads: int, hidden: int, ffn: int, experts: int,
               topk: int, **_: Any) -> Any:
    """The benchmarks' Megatron ``TransformerConfig``: SwiGLU experts, float32, dropless, no
    aux loss, no dropout, expert-parallel over the ``world`` (``_``: other shape entries,
    tokens)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn, num_moe_experts=experts,
        moe_router_topk=topk, moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=world, use_cpu_initialization=True, add_bias_linear=False,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        bias_activation_fusion=False, moe_router_load_balancing_type="none",
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0)


def _rank(rank: int, world: int, impls: list[str], shape: dict[str, int], steps: int,
          rounds: int) -> dict[str, Any]:
    from tests import megatron_cpu

    megatron_cpu.install()
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    config = gpt_config(world, layers=LAYERS, heads=HEADS, **shape)
    spec = get_gpt_layer_local_spec(num_experts=shape["experts"], moe_grouped_gemm=False)
    models = {}
    for impl in impls:
        torch.manual_seed(0)  # dense weights alike on every rank and in every model
        models[impl] = GPTModel(config=config, transformer_layer_spec=_spec(impl, spec),
                                vocab_size=VOCAB, max_sequence_length=SEQ)
        if impl != impls[0]:
            models[impl].load_state_dict(models[impls[0]].state_dict())
    with torch.no_grad():  # this rank's experts, seeded by rank
        g = torch.Generator().manual_seed(100 + rank)
        for name, p in models[impls[0]].named_parameters():
            if ".mlp.experts." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        for impl in impls[1:]:
            models[impl].load_state_dict(models[impls[0]].state_dict())
    batch = max(2, shape["tokens"] // SEQ)
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    position = torch.arange(SEQ).expand(batch, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)

    def loss(model: torch.nn.Module) -> torch.Tensor:
        return model(ids, position, mask, labels=ids).mean()

    timed = model_rounds(models, loss, rounds=rounds, repeats=steps)
    timed["batch_overlap"] = planner_for(
        parallel_state.get_expert_model_parallel_group()).batch_overlaps()
    return timed


def main() -> None:
    layer_benchmark(_rank, doc=__doc__, baseline="megatron", tokens=2048, hidden=1024,
                    ffn=2048, describe=f"GPTModel {LAYERS} layers, seq {SEQ}, float32, 2 ranks",
                    error_key="loss_err", error_name="|loss err|", impls="megatron,mc2,batch")


if __name__ == "__main__":
    main()
