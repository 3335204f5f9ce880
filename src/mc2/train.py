"""``mc2 train``: train a small Mixtral-style model end to end with expert parallelism.

The model is Hugging Face's ``MixtralForCausalLM`` built from a local config (no hub access),
switched to MC2 with :func:`mc2.integrations.transformers.enable_mc2`. Each rank of a local Gloo
world holds the non-expert parameters (trained data-parallel: gradients averaged) and its share
of the experts. The corpus is this machine's own Python standard library sources, read as bytes
(vocabulary 256), so nothing is downloaded.

``--compare`` trains the same model twice from the same seed, serial (``overlap=False``) and
MC2, and reports how far the two loss curves ever are apart.
"""

from __future__ import annotations

import json
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .launch import run_local


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 50
    batch: int = 8  # sequences per rank per step
    seq: int = 128
    hidden: int = 128
    ffn: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    experts: int = 8
    topk: int = 2
    lr: float = 3e-3
    seed: int = 0
    corpus_bytes: int = 4_000_000
    micro_batches: int | str = 2
    overlap: bool = True
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    progress: bool = True


def load_corpus(limit: int) -> torch.Tensor:
    """Bytes of the standard library's ``.py`` files, in a fixed order, as ``uint8``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    if total < 10_000:
        raise RuntimeError(f"found only {total} bytes of Python sources under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8)


def _batch(corpus: torch.Tensor, step: int, rank: int, world: int, cfg: TrainConfig
           ) -> torch.Tensor:
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * world + rank)
    starts = torch.randint(0, corpus.numel() - cfg.seq - 1, (cfg.batch,), generator=g)
    return torch.stack([corpus[s:s + cfg.seq] for s in starts.tolist()]).long()


def _model(cfg: TrainConfig):
    try:
        from transformers import MixtralConfig, MixtralForCausalLM
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("mc2 train needs transformers: pip install 'mc2[train]'") from exc
    torch.manual_seed(cfg.seed)
    config = MixtralConfig(vocab_size=256, hidden_size=cfg.hidden, intermediate_size=cfg.ffn,
                           num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                           num_key_value_heads=cfg.kv_heads, num_local_experts=cfg.experts,
                           num_experts_per_tok=cfg.topk, max_position_embeddings=cfg.seq,
                           tie_word_embeddings=False)
    return MixtralForCausalLM(config)


def _checkpoint(cfg: TrainConfig, rank: int) -> Path:
    assert cfg.checkpoint_dir is not None
    return Path(cfg.checkpoint_dir) / f"rank{rank}.pt"


def train_rank(rank: int, world: int, cfg: TrainConfig) -> dict[str, Any]:
    """One rank's training loop; returns the global loss and tokens/s of every step."""
    from .integrations.transformers import average_gradients, enable_mc2

    model = _model(cfg)
    enable_mc2(model, micro_batches=cfg.micro_batches, overlap=cfg.overlap)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    start_step, losses, rates = 0, [], []
    if cfg.resume and cfg.checkpoint_dir and _checkpoint(cfg, rank).exists():
        saved = torch.load(_checkpoint(cfg, rank), weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        start_step, losses, rates = saved["step"], saved["losses"], saved["rates"]
    corpus = load_corpus(cfg.corpus_bytes)
    bar = None
    if rank == 0 and cfg.progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=start_step, desc="mc2 train", file=sys.stderr)
        except ImportError:  # pragma: no cover
            bar = None
    for step in range(start_step, cfg.steps):
        ids = _batch(corpus, step, rank, world, cfg)
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        average_gradients(model)
        opt.step()
        elapsed = time.perf_counter() - t0
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
        rates.append(ids.numel() / elapsed)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s_rank=f"{rates[-1]:,.0f}")
        if cfg.checkpoint_dir and cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            Path(cfg.checkpoint_dir).mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "step": step + 1, "losses": losses, "rates": rates,
                        "config": asdict(cfg)}, _checkpoint(cfg, rank))
    if bar is not None:
        bar.close()
    return {"losses": losses, "tokens_per_s_per_rank": rates}


def run_training(cfg: TrainConfig, world_size: int = 2, threads: int = 1) -> dict[str, Any]:
    return run_local(train_rank, world_size, args=(cfg,), threads=threads, timeout_s=600,
                     deadline_s=24 * 3600)[0]


def plot_losses(curves: dict[str, list[float]], path: str | Path) -> Path:
    from .plot import pyplot

    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    for label, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=label, lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title("tiny Mixtral on Python's standard library, expert-parallel over 2 Gloo ranks")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def summarize(curves: dict[str, dict[str, Any]]) -> str:
    lines = []
    for label, result in curves.items():
        losses, rates = result["losses"], result["tokens_per_s_per_rank"]
        med = sorted(rates[1:] or rates)[len(rates[1:] or rates) // 2]
        lines.append(f"{label}: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} "
                     f"steps; median {med:,.0f} tokens/s per rank")
    if len(curves) == 2:
        a, b = (c["losses"] for c in curves.values())
        n = min(len(a), len(b), 50)
        diff = max(abs(x - y) for x, y in zip(a[:n], b[:n]))
        rel = max(abs(x - y) / abs(y) for x, y in zip(a[:n], b[:n]))
        lines.append(f"largest loss difference over the first {n} steps: {diff:.2e} "
                     f"(relative {rel:.2e})")
    return "\n".join(lines)


def write_json(path: str | Path, curves: dict[str, Any], cfg: TrainConfig) -> None:
    Path(path).write_text(json.dumps({"config": asdict(cfg), "runs": curves}, indent=2))
