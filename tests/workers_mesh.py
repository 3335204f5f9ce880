"""Rank functions for the mesh tests: EP x DP training and checkpoints that move between meshes."""

from __future__ import annotations

from typing import Any

import torch

CONFIG = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
              num_experts_per_tok=2, max_position_embeddings=64, experts_implementation="eager")
LR = 0.5


def unpatched_model(seed: int = 0):
    """The tiny Mixtral every test starts from (larger random experts, so routing matters)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**CONFIG))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or "gate" in name:
                p.normal_(0, 0.3)
    return model


def batches(steps: int, ranks: int = 4) -> torch.Tensor:
    """``[steps, ranks, 2, 12]`` token ids: one batch of two sequences per rank per step."""
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, CONFIG["vocab_size"], (steps, ranks, 2, 12), generator=g)


def reference_losses(data: torch.Tensor) -> list[list[float]]:
    """One process, the unpatched model, SGD on the mean of the ranks' losses."""
    model = unpatched_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    history = []
    for step_batches in data:
        losses = [model(ids, labels=ids).loss for ids in step_batches]
        opt.zero_grad()
        torch.stack(losses).mean().backward()
        opt.step()
        history.append([loss.item() for loss in losses])
    return history


def _mesh_model(ep_size: int):
    import mc2
    from mc2.integrations.transformers import enable_mc2

    mesh = mc2.expert_parallel_mesh(ep_size, num_experts=CONFIG["num_local_experts"])
    model = unpatched_model()
    enable_mc2(model, mesh=mesh, micro_batches=2)
    return model, mesh


def _train(model, mesh, opt, data: torch.Tensor, rank: int, sync=None) -> list[float]:
    """``sync``: a :class:`mc2.GradientSync` (overlapped), else ``average_gradients`` after."""
    import mc2

    losses = []
    for step_batches in data:
        ids = step_batches[rank]
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        if sync is None:
            mc2.average_gradients(model, mesh=mesh)
        else:
            sync.wait()
        opt.step()
        losses.append(loss.item())
    return losses


def train_on_mesh(rank: int, world: int, ep_size: int, data: torch.Tensor,
                  overlapped: bool = False) -> list[float]:
    """Train on a ``dp x ep`` mesh; this rank's loss at every step."""
    import mc2

    model, mesh = _mesh_model(ep_size)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sync = mc2.GradientSync(model, mesh=mesh, bucket_mb=0.01) if overlapped else None
    return _train(model, mesh, opt, data, rank, sync)


RESUMED_STEPS = 2  # the second step after a resume reads the restored momentum


def save_on_mesh(rank: int, world: int, ep_size: int, data: torch.Tensor, path: str
                 ) -> dict[str, Any]:
    """Train, save (with momentum state) two steps before the end, then finish the run."""
    import mc2.parallel.checkpoint

    model, mesh = _mesh_model(ep_size)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    done = len(data) - RESUMED_STEPS
    _train(model, mesh, opt, data[:done], rank)
    mc2.parallel.checkpoint.save(model, path, optimizer=opt, extra={"step": done})
    with torch.no_grad():
        logits = model(data[0, rank]).logits
    next_losses = _train(model, mesh, opt, data[done:], rank)
    return {"logits": logits, "next_losses": next_losses}


def load_on_mesh(rank: int, world: int, ep_size: int, data: torch.Tensor, path: str
                 ) -> dict[str, Any]:
    """Load the checkpoint on another mesh: logits on a probe, then the remaining steps."""
    import mc2.parallel.checkpoint

    model, mesh = _mesh_model(ep_size)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    extra = mc2.parallel.checkpoint.load(model, path, optimizer=opt)
    with torch.no_grad():
        logits = model(data[0, rank]).logits
    next_losses = _train(model, mesh, opt, data[extra["step"]:], rank)
    return {"logits": logits, "next_losses": next_losses, "extra": extra}


BAD_MESHES = ("unnamed", "ep-does-not-divide-experts", "helper-experts", "helper-world",
              "does-not-cover")


def bad_meshes(rank: int, world: int) -> dict[str, str]:
    """Build each bad mesh or layer in turn; the error text of each (every rank must get one)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    import mc2

    def attempt(what: str) -> None:
        if what == "unnamed":
            mc2.MoELayer(8, 8, 4, mesh=init_device_mesh("cpu", (2, 2)))
        elif what == "ep-does-not-divide-experts":
            mc2.MoELayer(8, 8, 6, mesh=mc2.expert_parallel_mesh(4))
        elif what == "helper-experts":
            mc2.expert_parallel_mesh(4, num_experts=6)
        elif what == "helper-world":
            mc2.expert_parallel_mesh(3)
        elif what == "does-not-cover":
            mc2.MoELayer(8, 8, 4, mesh=DeviceMesh("cpu", [[0, 1]], mesh_dim_names=("dp", "ep")))

    errors = {}
    for what in BAD_MESHES:
        try:
            attempt(what)
            errors[what] = "no error"
        except ValueError as exc:
            errors[what] = str(exc)
    return errors


def accumulate_with_no_sync(rank: int, world: int, data: torch.Tensor) -> dict[str, Any]:
    """Two backwards, the first inside ``no_sync``; then a reference with average_gradients on
    the sum; then a second backward without ``no_sync`` (must raise)."""
    import mc2

    model, mesh = _mesh_model(2)
    sync = mc2.GradientSync(model, mesh=mesh, bucket_mb=0.01)
    first, second = data[0, rank], data[1, rank]
    with sync.no_sync():
        model(first, labels=first).loss.backward()
    model(second, labels=second).loss.backward()
    sync.wait()
    overlapped = {n: p.grad.clone() for n, p in model.named_parameters()}
    sync.remove()
    model.zero_grad()
    model(first, labels=first).loss.backward()
    model(second, labels=second).loss.backward()
    mc2.average_gradients(model, mesh=mesh)
    after = {n: p.grad.clone() for n, p in model.named_parameters()}
    again = mc2.GradientSync(model, mesh=mesh, bucket_mb=0.01)
    model.zero_grad()
    model(first, labels=first).loss.backward()
    error = None
    try:
        model(second, labels=second).loss.backward()
    except RuntimeError as exc:
        error = str(exc)
    again.wait()  # the buckets that did go out still pair up on every rank
    return {"overlapped": overlapped, "after": after, "error": error}


def layer_sync_edges(rank: int, world: int) -> dict[str, Any]:
    """Three layouts :func:`mc2.average_gradients` and :func:`mc2.clip_grad_norm_` used to get
    wrong: ``MoELayer`` on the default group (the global norm against one computed from every
    rank's gradients), frozen experts on an EP size of 1 (their gradients after
    ``average_gradients``; whether ``GradientSync`` builds), and layers on EP groups of one
    rank without a mesh (what ``average_gradients`` raised)."""
    import torch.distributed as dist

    import mc2

    found: dict[str, Any] = {}
    torch.manual_seed(0)
    layer = mc2.MoELayer(8, 12, 4, topk=2, dtype=torch.float64)
    experts = {id(s.param) for s in mc2.parallel.expert_shards.expert_shards(layer)}
    for index, p in enumerate(layer.parameters()):  # replicated ones equal, as after a sync
        p.grad = torch.full_like(p, float(1 + index + (rank if id(p) in experts else 0)))
    squares = torch.zeros((), dtype=torch.float64)
    for p in layer.parameters():
        if id(p) in experts:
            squares += p.grad.pow(2).sum()
    dist.all_reduce(squares)  # every rank's experts once
    dense = sum(p.grad.pow(2).sum() for p in layer.parameters() if id(p) not in experts)
    found["norm"] = (float(mc2.clip_grad_norm_(layer, 1e9)), float((squares + dense).sqrt()))

    frozen = mc2.MoELayer(8, 12, 4, topk=2, dtype=torch.float64,
                          mesh=mc2.expert_parallel_mesh(1))
    for p in frozen.parameters():
        if id(p) in {id(s.param) for s in mc2.parallel.expert_shards.expert_shards(frozen)}:
            p.requires_grad_(False)
    out = frozen(torch.randn(6, 8, dtype=torch.float64))
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    mc2.average_gradients(frozen)
    found["frozen grads"] = [p.grad for p in frozen.parameters() if not p.requires_grad]
    try:
        mc2.GradientSync(frozen, mesh=mc2.expert_parallel_mesh(1), bucket_mb=0.01)
        found["frozen sync"] = "built"
    except Exception as exc:  # noqa: BLE001 - what it raised is the finding
        found["frozen sync"] = f"{type(exc).__name__}: {exc}"

    groups = [dist.new_group([r]) for r in range(world)]
    alone = mc2.MoELayer(8, 12, 4, topk=2, dtype=torch.float64, group=groups[rank])
    out = alone(torch.randn(6, 8, dtype=torch.float64))
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    try:
        mc2.average_gradients(alone)
        found["subgroup"] = "no error"
    except ValueError as exc:
        found["subgroup"] = str(exc)
    return found


def experts_by_layout(rank: int, world: int) -> dict[str, Any]:
    """``MoELayer`` built from one seed on an EP group of the world and on an EP size of 1
    (every rank all experts): every expert of the first, gathered, and the second's."""
    import torch.distributed as dist

    import mc2

    torch.manual_seed(3)
    spread = mc2.MoELayer(8, 12, 4, topk=2, dtype=torch.float64)
    torch.manual_seed(3)
    whole = mc2.MoELayer(8, 12, 4, topk=2, dtype=torch.float64, mesh=mc2.expert_parallel_mesh(1))
    gathered = [torch.empty_like(spread.w_gate_up) for _ in range(world)]
    dist.all_gather(gathered, spread.w_gate_up.detach().contiguous())
    return {"spread": torch.cat(gathered), "whole": whole.w_gate_up.detach().clone()}
