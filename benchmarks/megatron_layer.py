"""Megatron-Core's own ``MoELayer`` (alltoall dispatcher, ``SequentialMLP``) against the same
layer through mc2 (:class:`mc2.integrations.megatron.MC2MoELayer`), the same weights.

2 local Gloo ranks, one thread each, megatron-core 0.16.1 with the tests' CPU shims
(``tests/megatron_cpu.py``). One step is the peer benchmarks' work: ``y =
layer(x); y.backward(dy)``, ``x`` and every parameter requiring grad, float32, SwiGLU experts,
dropless, no aux loss; gradients set to None between steps, outside the timed region; a
barrier before every step; a step's time is the slowest rank's. Each round runs every
implementation in turn (one untimed step, then ``--steps`` timed ones); an implementation's
figure is the median over rounds of its per-round median. mc2 variants: ``mc2`` (``"auto"``:
its exploration calls run in untimed steps before the first round), ``mc2_k<N>`` (K fixed),
``mc2_dedup`` (rows once per destination, ``"auto"``).

Regimes (``--regimes``): ``plain`` (loopback as it is) and ``<N>mbit`` (loopback shaped with
``tc tbf ... latency 400ms``, root; every process on the machine shares ``lo``, so only on a
machine of your own)::

    .venv/bin/python benchmarks/megatron_layer.py --tokens 1024 --hidden 512 --ffn 1024
    .venv/bin/python benchmarks/megatron_layer.py            # the peers' shape, 4096 tok/rank
    sudo .venv/bin/python benchmarks/megatron_layer.py --regimes plain,500mbit,200mbit
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
from layer_rounds import interleaved_rounds, layer_benchmark, slowest_rank_seconds  # noqa: E402


def _config(variant: str) -> mc2.MC2Config:
    if variant == "mc2":
        return mc2.MC2Config()
    if variant == "mc2_dedup":
        return mc2.MC2Config(dedup=True)
    if variant.startswith("mc2_k"):
        return mc2.MC2Config(micro_batches=int(variant.removeprefix("mc2_k")))
    raise ValueError(f"impls: unknown implementation {variant!r}")


def _rank(rank: int, world: int, impls: list[str], shape: dict[str, int], steps: int,
          rounds: int) -> dict[str, Any]:
    from tests import megatron_cpu

    megatron_cpu.install()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mc2.integrations.megatron import use_mc2

    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    config = TransformerConfig(
        num_layers=1, hidden_size=shape["hidden"], num_attention_heads=8,
        ffn_hidden_size=shape["ffn"], moe_ffn_hidden_size=shape["ffn"],
        num_moe_experts=shape["experts"], moe_router_topk=shape["topk"],
        moe_token_dispatcher_type="alltoall", expert_model_parallel_size=world,
        use_cpu_initialization=True, add_bias_linear=False, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, bias_activation_fusion=False,
        moe_router_load_balancing_type="none", params_dtype=torch.float32)
    spec = get_moe_module_spec(use_te=False, num_experts=shape["experts"], moe_grouped_gemm=False)
    torch.manual_seed(0)  # the router alike on every rank
    reference = build_module(spec, config=config)
    with torch.no_grad():  # this rank's experts, seeded by rank
        g = torch.Generator().manual_seed(100 + rank)
        for name, p in reference.named_parameters():
            if name.startswith("experts."):
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    layers = {"megatron": reference}
    for impl in impls:
        if impl != "megatron":
            layers[impl] = build_module(use_mc2(spec, config=_config(impl)), config=config)
            layers[impl].load_state_dict(reference.state_dict())
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(shape["tokens"], 1, shape["hidden"], generator=g)
    dy = torch.randn(shape["tokens"], 1, shape["hidden"], generator=g)

    def step(layer: torch.nn.Module) -> float:
        for p in layer.parameters():
            p.grad = None
        xi = x.clone().requires_grad_(True)
        return slowest_rank_seconds(lambda: layer(xi)[0].backward(dy))

    # outputs agree (one no-grad forward each), and "auto"'s exploration before timing
    with torch.no_grad():
        want = reference(x)[0]
        errors = {impl: float((layers[impl](x)[0] - want).abs().max())
                  for impl in layers if impl != "megatron"}
    timed = interleaved_rounds({impl: (lambda layer=layer: step(layer))
                                for impl, layer in layers.items()},
                               rounds=rounds, repeats=steps, warmup=8,
                               warm=[impl for impl in layers if impl != "megatron"])
    return {**timed, "max_abs_err": errors}


def main() -> None:
    layer_benchmark(_rank, doc=__doc__, baseline="megatron", tokens=4096, hidden=1024,
                    ffn=2048, describe="float32, 2 ranks", error_key="max_abs_err",
                    error_name="max|err|")

if __name__ == "__main__":
    main()
