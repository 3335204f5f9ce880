"""The article's step decomposition, measured on a small Mixtral-like block.

The block is what one MoE transformer layer does in training: token embedding, attention with
residual and RMSNorm, the router gate (linear -> softmax -> top-k, renormalised), the fused MoE
(dispatch, experts, combine) and the residual. One forward + backward is split into the
article's five parts:

1. embedding + router gate
2. dispatch All-to-All
3. expert FFN
4. combine All-to-All
5. attention + residual + norm (everything else, the loss included)

Forward parts are timed directly. Backward parts are timed with markers: identity autograd
functions placed on the tensors between parts, which note the time at which their gradient
arrives. Dispatch and combine come from the fused op's timeline (synchronous collectives and
waits, i.e. the *exposed* communication); the expert part is the rest of the fused op's time.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from mc2.device.clock import clock_for
from mc2.engine.autograd.ops import fused_expert
from mc2.observation import metrics
from mc2.observation.timeline import Timeline
from mc2.tools.launch import run_local

PARTS = ("embedding + gate", "dispatch", "experts", "combine", "attention + residual + norm")


class _Marker(torch.autograd.Function):
    """Identity that records when the gradient of its output arrives."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, marks: dict, name: str) -> Tensor:  # type: ignore[override]
        ctx.marks, ctx.name = marks, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        ctx.marks[ctx.name] = clock_for(grad.device).stamp()
        return grad, None, None


class TinyMixtralBlock(nn.Module):
    """Embedding + one Mixtral-style layer; this rank holds ``experts // world`` experts."""

    def __init__(self, vocab: int, hidden: int, ffn: int, heads: int, experts: int, topk: int,
                 world: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        local = experts // world
        self.topk, self.heads = topk, heads
        self.embed = nn.Embedding(vocab, hidden)
        self.norm1, self.norm2 = nn.RMSNorm(hidden, eps=1e-6), nn.RMSNorm(hidden, eps=1e-6)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.w_up = nn.Parameter(torch.randn(local, hidden, ffn, generator=g) * hidden ** -0.5)
        self.w_gate = nn.Parameter(torch.randn(local, hidden, ffn, generator=g) * hidden ** -0.5)
        self.w_down = nn.Parameter(torch.randn(local, ffn, hidden, generator=g) * ffn ** -0.5)

    def attention(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return x + self.proj(o.transpose(1, 2).reshape(b, s, h))

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        probs = self.gate(x).softmax(-1)
        weights, ids = probs.topk(self.topk, dim=-1)
        return ids, weights / weights.sum(-1, keepdim=True)


@dataclass(frozen=True)
class BreakdownConfig:
    batch: int = 16
    seq: int = 128
    hidden: int = 512
    ffn: int = 1024
    heads: int = 8
    experts: int = 8
    topk: int = 2
    vocab: int = 4096
    micro_batches: int | str = 4
    repeats: int = 5
    warmup: int = 1


def _one_step(model: TinyMixtralBlock, tokens: Tensor, *, overlap: bool, k: int | str
              ) -> dict[str, float]:
    marks: dict[str, Any] = {}  # stamps of the clock of the tokens' device
    clock = clock_for(tokens.device)
    since = clock.elapsed
    tl = Timeline()
    model.zero_grad(set_to_none=True)
    t0 = clock.stamp()
    x = _Marker.apply(model.embed(tokens), marks, "embed_out")
    t1 = clock.stamp()
    h = model.attention(x)
    n2 = model.norm2(h)
    t2 = clock.stamp()
    ids, rw = model.route(_Marker.apply(n2, marks, "gate_in"))
    t3 = clock.stamp()
    moe = fused_expert(_Marker.apply(n2, marks, "moe_in"), model.w_up, model.w_gate, model.w_down,
                       ids, rw, micro_batches=k if overlap else 1, overlap=overlap, timeline=tl)
    t4 = clock.stamp()
    loss = (h + _Marker.apply(moe, marks, "moe_out")).pow(2).mean()
    loss.backward()
    t6 = clock.stamp()

    def exposed(name: str) -> float:  # forward and backward
        return sum(s.duration for s in tl.spans if s.phase in ("forward", "backward")
                   and s.kind in ("comm", "wait")
                   and (s.name == name or (name == "dispatch" and s.name in ("handshake", "counts"))))

    fwd_moe, bwd_moe = since(t3, t4), since(marks["moe_out"], marks["moe_in"])
    dispatch, combine = exposed("dispatch"), exposed("combine")
    gate_bwd = max(since(marks["moe_in"], marks["gate_in"]), 0.0)
    embed_bwd = since(marks["embed_out"], t6)
    parts = {
        "embedding + gate": since(t0, t1) + since(t2, t3) + gate_bwd + embed_bwd,
        "dispatch": dispatch,
        "combine": combine,
        "experts": fwd_moe + bwd_moe - dispatch - combine,
    }
    total = since(t0, t6)
    parts["attention + residual + norm"] = total - sum(parts.values())
    parts["step"] = total
    return parts


def breakdown_rank(rank: int, world: int, cfg: BreakdownConfig) -> dict[str, dict[str, float]]:
    model = TinyMixtralBlock(cfg.vocab, cfg.hidden, cfg.ffn, cfg.heads, cfg.experts, cfg.topk,
                             world, seed=rank)
    g = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g)
    runs = {"serial": (False, 1), f"mc2 K={cfg.micro_batches}": (True, cfg.micro_batches)}
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    for rep in range(cfg.warmup + cfg.repeats):
        for name, (overlap, k) in runs.items():
            dist.barrier()
            parts = _one_step(model, tokens, overlap=overlap, k=k)
            if rep >= cfg.warmup:
                samples[name].append(parts)
        if rank == 0:
            print(f"  [breakdown] repeat {rep + 1}/{cfg.warmup + cfg.repeats}", file=sys.stderr,
                  flush=True)
    return {name: {part: metrics.median(s[part] for s in rows) for part in (*PARTS, "step")}
            for name, rows in samples.items()}


def run_breakdown(cfg: BreakdownConfig, world_size: int = 2, threads: int = 1
                  ) -> dict[str, dict[str, float]]:
    """Rank 0's median parts (seconds) for the serial and the MC2 step."""
    return run_local(breakdown_rank, world_size, args=(cfg,), threads=threads, timeout_s=300,
                     deadline_s=3600)[0]


def format_breakdown(result: dict[str, dict[str, float]], cfg: BreakdownConfig) -> str:
    names = list(result)
    lines = [f"training step of a Mixtral-like block: batch {cfg.batch} x seq {cfg.seq}, hidden "
             f"{cfg.hidden}, ffn {cfg.ffn}, {cfg.experts} experts, top-{cfg.topk}; forward + "
             "backward, rank 0, median",
             f"{'part':<28}" + "".join(f"{n:>22}" for n in names)]
    for part in PARTS:
        cells = "".join(f"{result[n][part] * 1e3:11.1f} ms {result[n][part] / result[n]['step'] * 100:5.1f}%"
                        for n in names)
        lines.append(f"{part:<28}{cells}")
    lines.append(f"{'step':<28}" + "".join(f"{result[n]['step'] * 1e3:11.1f} ms {'':6}"
                                            for n in names))
    return "\n".join(lines)
