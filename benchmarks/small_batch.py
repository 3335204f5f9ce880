"""Small batches: per-call time of one MoE layer's experts, mc2 against Hugging Face's expert
parallelism, on the same experts.

One Mixtral-shaped experts module (hidden 1024, ffn 2048, 8 experts, top-2, float32; Hugging
Face's ``MixtralExperts``, whose packed weights mc2 runs directly) sharded over 2 or 4 local
Gloo ranks; at each size (tokens per rank) and pass (a no-grad forward; a forward and backward)
every implementation runs once per round, interleaved, the median round counting:

- ``mc2``: :func:`mc2.fused_expert_packed` as today (K = 1: handshake, dispatch, combine; a
  call whose ids fit the handshake, every size here up to 16 tokens of top-2, counts its
  routes from it, with no counts exchange, :data:`mc2.engine.decide.validation.FOLD_IDS`);
- ``mc2 counts exchange``: the same call with that fold off (handshake, counts, dispatch,
  combine), as every call ran before;
- ``mc2 capacity``: the same call with ``MC2Config(capacity=N)``, ``N`` the most rows any rank
  sends any rank in this batch (the tightest capacity that drops nothing, agreed before
  timing): no host read, one dispatch and one combine (:mod:`mc2.engine.decide.capacity`);
- ``hf all_to_all``: ``transformers``' ``AllToAllEP`` (each rank its own tokens);
- ``hf all_reduce``: ``transformers``' ``AllReduceEP`` on the same tokens: the group's
  ``world * tokens`` tokens (every rank's, with their routing) as one batch that every rank
  holds (its layout), every rank running its experts on all of it, one all-reduce. No-grad
  only: it is Hugging Face's inference path (``"auto"`` takes it without gradients), and with
  gradients a rank whose experts get no token of a small batch skips the backward's
  all-reduce that its peers wait in.

::

    .venv/bin/python benchmarks/small_batch.py --json docs/small_batch.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

import mc2

HIDDEN, FFN, EXPERTS, TOPK = 1024, 2048, 8, 2
IMPLS = ("mc2", "mc2 counts exchange", "mc2 capacity", "hf all_to_all", "hf all_reduce")


def _experts(world: int, rank: int, hidden: int, ffn: int) -> Any:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    local = EXPERTS // world
    experts = MixtralExperts(MixtralConfig(hidden_size=hidden, intermediate_size=ffn,
                                           num_local_experts=local))
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) * 0.02)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) * 0.02)
    return experts


def _capacity(ids: torch.Tensor, world: int) -> int:
    """The tightest lossless capacity for this batch: the most rows any rank sends any rank
    (a token once per rank), agreed by the group before anything is timed."""
    hit = torch.zeros(ids.shape[0], world, dtype=torch.bool)
    hit.scatter_(1, ids // (EXPERTS // world), True)
    most = hit.sum(0).max().reshape(1)
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    return max(int(most), 1)


def _gathered(t: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's ``t`` in rank order: all_reduce's shared batch is the group's tokens, with
    the same routing, so every rank's experts get the same rows in every implementation."""
    parts = [torch.empty_like(t) for _ in range(world)]
    torch.distributed.all_gather(parts, t)
    return torch.cat(parts)


def _unfolded(fn: Callable[[torch.Tensor], torch.Tensor]
              ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn`` with the handshake's fold off: its counts exchanged, as before the fold."""
    from mc2.engine.decide import call_plan

    def run(h: torch.Tensor) -> torch.Tensor:
        original, call_plan.may_fold = call_plan.may_fold, lambda *args: False
        try:
            return fn(h)
        finally:
            call_plan.may_fold = original
    return run


def _calls(experts: Any, ids: torch.Tensor, ids_shared: torch.Tensor, capacity: int, a2a: Any,
           reduce: Any) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    w = torch.full(tuple(ids.shape), 0.5)
    gu, down = experts.gate_up_proj, experts.down_proj
    return {
        "mc2": lambda h: mc2.fused_expert_packed(h, gu, down, ids, w, micro_batches=1),
        "mc2 counts exchange": _unfolded(
            lambda h: mc2.fused_expert_packed(h, gu, down, ids, w, micro_batches=1)),
        "mc2 capacity": lambda h: mc2.fused_expert_packed(h, gu, down, ids, w, micro_batches=1,
                                                           capacity=capacity),
        "hf all_to_all": lambda h: a2a(h, ids, w),
        "hf all_reduce": lambda h: reduce(h, ids_shared, torch.full(tuple(ids_shared.shape), 0.5)),
    }


def _rank(rank: int, world: int, sizes: list[int], rounds: int, hidden: int = HIDDEN,
          ffn: int = FFN) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import AllReduceEP, AllToAllEP

    torch.set_num_threads(1)
    experts = _experts(world, rank, hidden, ffn)
    own = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ep", "tp"))
    shared = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    a2a = AllToAllEP(experts, own["ep"], own["tp"])
    reduce = AllReduceEP(experts, shared["ep"], shared["ep"])
    results: dict[str, Any] = {}
    for tokens in sizes:
        g = torch.Generator().manual_seed(100 * tokens + rank)
        x = torch.randn(tokens, hidden, generator=g)
        ids = torch.rand(tokens, EXPERTS, generator=g).topk(TOPK, -1).indices
        xs, ids_s = _gathered(x, world), _gathered(ids, world)  # the shared batch
        calls = _calls(experts, ids, ids_s, _capacity(ids, world), a2a, reduce)
        inputs = {name: xs if name == "hf all_reduce" else x for name in IMPLS}
        for grad in (False, True):
            impls = [n for n in IMPLS if not (grad and n == "hf all_reduce")]
            times: dict[str, list[float]] = {name: [] for name in impls}
            for r in range(rounds + 1):  # the first round is a warm-up
                order = impls if r % 2 == 0 else impls[::-1]
                for name in order:
                    h = inputs[name].clone().requires_grad_(grad)
                    torch.distributed.barrier()
                    start = time.perf_counter()
                    with torch.set_grad_enabled(grad):
                        out = calls[name](h)
                        if grad:
                            out.sum().backward()
                    elapsed = torch.tensor([time.perf_counter() - start])
                    torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
                    if r:
                        times[name].append(float(elapsed))
            results[f"{tokens} {'fwd+bwd' if grad else 'no-grad'}"] = {
                name: statistics.median(t) for name, t in times.items()}
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--sizes", default="1,4,16,64,256", help="tokens per rank")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--ffn", type=int, default=FFN, help="a small shape (--hidden 64 --ffn 128) "
                   "leaves the collectives' latency, which the fold saves, to show")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    out: dict[str, Any] = {}
    for world in (int(w) for w in args.worlds.split(",")):
        print(f"== {world} ranks", file=sys.stderr, flush=True)
        res = mc2.run_local(_rank, world, args=(sizes, args.rounds, args.hidden, args.ffn),
                            timeout_s=600,
                            deadline_s=3600)[0]
        out[str(world)] = res
        print(f"{world} ranks        " + "".join(f"{n:>22}" for n in IMPLS)
              + "   mc2 / counts exchange   mc2 / hf all_to_all")
        for key, row in res.items():
            print(f"{key:<16}" + "".join(f"{row[n] * 1e3:19.2f} ms" if n in row else
                                         f"{'-':>22}" for n in IMPLS)
                  + f"   {row['mc2'] / row['mc2 counts exchange']:21.3f}"
                  + f"   {row['mc2'] / row['hf all_to_all']:19.3f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
