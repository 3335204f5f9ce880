"""``mc2 train``: train a small Mixtral-style model end to end with expert parallelism.

The model is Hugging Face's ``MixtralForCausalLM`` built from a local config (no hub access),
switched to MC2 with :func:`mc2.integrations.transformers.enable_mc2` on a ``("dp", "ep")`` mesh
(:func:`mc2.expert_parallel_mesh`): the experts are split over EP groups of ``ep_size`` ranks
and replicated over DP; the rest of the model is replicated everywhere (gradients averaged by
:func:`mc2.average_gradients`). The corpus is this machine's own Python standard library
sources, read as bytes (vocabulary 256), so nothing is downloaded.

Runs on a local Gloo world (:func:`run_training`), or as it is under ``torchrun``
(:func:`run_launched`; ``torchrun --nproc-per-node 2 -m mc2.tools.train --ep-size 2``). Checkpoints
are :mod:`mc2.parallel.checkpoint` folders, one per saved step, so a run resumes on any EP size.

``--compare`` trains the same model twice from the same seed, serial (``overlap=False``) and
MC2, and reports how far the two loss curves ever are apart.
"""

from __future__ import annotations

import os
import statistics
import sys
import sysconfig
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mc2.engine.decide.config import MC2Config
from mc2.tools.launch import preload, run_local, use_device


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
    # how each fused call runs: MC2Config's fields (JSON-safe values, kept in checkpoints)
    micro_batches: int | str = 2
    overlap: bool = True
    hierarchy: str = "flat"
    wire_block: int = 128
    gemm: str = "auto"
    timeout: float | None = None
    check_finite: bool = False
    dedup: bool = False
    capacity: int | None = None
    overflow: str = "raise"
    ep_size: int | None = None  # ranks per EP group; None: all ranks in one
    wire_dtype: Any = "none"  # format routed rows travel in (mc2.engine.transport.wire names)
    grad_sync: str = "overlap"  # "overlap": GradientSync during backward; "after": afterwards
    fsdp: bool = False  # mc2.fully_shard: everything sharded, FSDP2 reduces the gradients
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    progress: bool = True
    device: str = "cpu"  # "cuda": each rank trains on its local device

    def mc2_config(self) -> MC2Config:
        """How each of the model's fused calls runs (its MC2Config fields, as kept)."""
        return MC2Config.from_dict({f.name: getattr(self, f.name) for f in fields(MC2Config)})


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


def _checkpoints(cfg: TrainConfig) -> list[Path]:
    """Published checkpoint folders, oldest first, by step number (by name, step 1000000 came
    before 999999). A save writes ``step-N.partial`` and renames it only when every rank's
    shard and DCP's ``.metadata`` are on disk (``mc2.checkpoint.save``)."""
    assert cfg.checkpoint_dir is not None
    root = Path(cfg.checkpoint_dir)
    return sorted((p for p in root.glob("step-*")
                   if p.name[5:].isdigit() and (p / ".metadata").is_file()),
                  key=lambda p: int(p.name[5:]))


def _save(model: Any, opt: Any, cfg: TrainConfig, step: int, history: dict[str, list]) -> None:
    """Write, then publish by rename (``mc2.checkpoint.save``); the last good checkpoint stays
    until the new one is, and all but the last two published go.

    A kill at any moment leaves either the previous published checkpoints alone or the new one
    complete: ``--resume`` never sees half a checkpoint.
    """
    import shutil

    from mc2.parallel import checkpoint

    assert cfg.checkpoint_dir is not None
    final = Path(cfg.checkpoint_dir) / f"step-{step:06d}"  # replaced if a resume went back
    checkpoint.save(model, final, optimizer=opt,
                    extra={"step": step, **history, "config": asdict(cfg)})
    if dist.get_rank() == 0:
        for old in _checkpoints(cfg)[:-2]:  # keep the last two
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def _setup(rank: int, world: int, cfg: TrainConfig) -> tuple[Any, ...]:
    """This rank's device, mesh, MC2 model, optimizer and gradient sync."""
    from mc2.integrations.transformers import enable_mc2
    from mc2.parallel.gradient_buckets import GradientSync
    from mc2.parallel.mesh import expert_parallel_mesh

    device = torch.device(use_device(cfg.device, int(os.environ.get("LOCAL_RANK", rank))))
    mesh = expert_parallel_mesh(cfg.ep_size or world, device.type, num_experts=cfg.experts)
    model = _model(cfg).to(device)
    enable_mc2(model, mesh=mesh, config=cfg.mc2_config())
    model.train()
    if cfg.fsdp:
        from mc2.parallel.fsdp import fully_shard

        fully_shard(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    # small buckets: this model's gradients are a few MB, and a bucket starts only when full
    sync = GradientSync(model, mesh=mesh, bucket_mb=1.0) \
        if cfg.grad_sync == "overlap" and not cfg.fsdp else None
    return device, mesh, model, opt, sync


def _progress(rank: int, cfg: TrainConfig, start_step: int) -> Any:
    if rank != 0 or not cfg.progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=cfg.steps, initial=start_step, desc="mc2 train", file=sys.stderr)


def _train_step(model: Any, opt: Any, sync: Any, mesh: Any, ids: torch.Tensor, clock: Any,
                fsdp: bool = False) -> tuple[torch.Tensor, float, float]:
    """Forward, backward, gradient sync, optimizer step: ``(loss, step s, sync s)`` timed on
    the device's clock. Under FSDP2 the backward reduced the gradients already."""
    from mc2.parallel.grad_sync import average_gradients

    t0 = clock.stamp()
    loss = model(ids, labels=ids).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    t_sync = clock.stamp()
    if sync is not None:
        sync.wait()  # what is left of a sync that ran during the backward
    elif not fsdp:
        average_gradients(model, mesh=mesh)
    t_synced = clock.stamp()
    opt.step()
    return loss, clock.elapsed(t0, clock.stamp()), clock.elapsed(t_sync, t_synced)


def train_rank(rank: int, world: int, cfg: TrainConfig) -> dict[str, Any]:
    """One rank's training loop; the global loss, tokens/s and gradient-sync time of each step."""
    from mc2.device.clock import clock_for
    from mc2.parallel import checkpoint

    device, mesh, model, opt, sync = _setup(rank, world, cfg)
    start_step = 0
    history: dict[str, list] = {"losses": [], "tokens_per_s_per_rank": [], "sync_s": []}
    if cfg.resume and cfg.checkpoint_dir and _checkpoints(cfg):
        extra = checkpoint.load(model, _checkpoints(cfg)[-1], optimizer=opt)
        start_step = extra["step"]
        history = {k: extra[k] for k in history}
    corpus = load_corpus(cfg.corpus_bytes)
    clock = clock_for(device)  # device events on an accelerator
    bar = _progress(rank, cfg, start_step)
    for step in range(start_step, cfg.steps):
        ids = _batch(corpus, step, rank, world, cfg).to(device)
        dist.barrier()
        loss, elapsed, sync_s = _train_step(model, opt, sync, mesh, ids, clock,
                                            cfg.fsdp)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        history["losses"].append(global_loss.item() / world)
        history["tokens_per_s_per_rank"].append(ids.numel() / elapsed)
        history["sync_s"].append(sync_s)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{history['losses'][-1]:.4f}",
                            tok_s_rank=f"{history['tokens_per_s_per_rank'][-1]:,.0f}")
        if cfg.checkpoint_dir and cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            _save(model, opt, cfg, step + 1, history)
    if bar is not None:
        bar.close()
    return history


def run_training(cfg: TrainConfig, world_size: int = 2, threads: int = 1) -> dict[str, Any]:
    """Train on a local Gloo world of ``world_size`` processes; rank 0's history."""
    _check_ep_size(cfg, world_size)
    # once, not in every rank (transformers is lazy: the model's module is what costs)
    preload("transformers.models.mixtral.modeling_mixtral", "mc2.integrations.transformers",
            "torch.distributed.checkpoint")
    return run_local(train_rank, world_size, args=(cfg,), threads=threads, timeout_s=600,
                     deadline_s=24 * 3600, device=cfg.device)[0]


def launched() -> bool:
    """Whether this process is one rank of a ``torchrun`` job (its environment says so)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run_launched(cfg: TrainConfig, backend: str | None = "gloo") -> dict[str, Any] | None:
    """Train as this rank of a ``torchrun`` job; rank 0 gets the history, the others ``None``."""
    world = int(os.environ["WORLD_SIZE"])
    _check_ep_size(cfg, world)
    own = not dist.is_initialized()
    if own:
        use_device(cfg.device, int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    try:
        result = train_rank(dist.get_rank(), world, cfg)
        return result if dist.get_rank() == 0 else None
    finally:
        if own:
            dist.destroy_process_group()


def _check_ep_size(cfg: TrainConfig, world: int) -> None:
    cfg.mc2_config()  # a ValueError naming the bad option, before any rank starts
    if cfg.grad_sync not in ("overlap", "after"):
        raise ValueError(f"grad_sync must be 'overlap' or 'after', got {cfg.grad_sync!r}")
    ep = cfg.ep_size or world
    if ep < 1 or world % ep:
        raise ValueError(f"--ep-size {ep} must divide the world size {world}")
    if cfg.experts % ep:
        raise ValueError(f"--ep-size {ep} must divide the {cfg.experts} experts")


def plot_losses(curves: dict[str, list[float]], path: str | Path,
                title: str = "tiny Mixtral on Python's standard library") -> Path:
    from mc2.observation.plot import pyplot, saved

    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    for label, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=label, lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return saved(fig, path)


def summarize(curves: dict[str, dict[str, Any]]) -> str:
    lines = []
    for label, result in curves.items():
        losses, rates = result["losses"], result["tokens_per_s_per_rank"]
        sync = result.get("sync_s", [0.0])  # medians leave the first (warm-up) step out
        lines.append(f"{label}: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} "
                     f"steps; median {statistics.median_high(rates[1:] or rates):,.0f} "
                     f"tokens/s per rank, gradient sync "
                     f"{1e3 * statistics.median_high(sync[1:] or sync):.1f} ms")
    if len(curves) == 2:
        a, b = (c["losses"] for c in curves.values())
        n = min(len(a), len(b), 50)
        diff = max(abs(x - y) for x, y in zip(a[:n], b[:n]))
        rel = max(abs(x - y) / abs(y) for x, y in zip(a[:n], b[:n]))
        lines.append(f"largest loss difference over the first {n} steps: {diff:.2e} "
                     f"(relative {rel:.2e})")
    return "\n".join(lines)

