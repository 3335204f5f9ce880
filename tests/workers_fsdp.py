"""Rank functions for the FSDP2 tests: ``mc2.fully_shard`` on dp 2 x ep 2, in one shared world."""

from __future__ import annotations

from typing import Any

import torch

from tests.workers_mesh import CONFIG, batches, unpatched_model

LR = 1e-2
STEPS = 3


def adamw_reference(data: torch.Tensor) -> dict[str, Any]:
    """One process, the unpatched model, AdamW on the mean of the ranks' losses; the losses,
    the gradient norms of every step (max, then 2-norm), and the final state."""
    model = unpatched_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for step_batches in data:
        step = [model(ids, labels=ids).loss for ids in step_batches]
        opt.zero_grad()
        torch.stack(step).mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9,
                                                    norm_type="inf").item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item())
        opt.step()
        losses.append([loss.item() for loss in step])
    return {"losses": losses, "norms": norms,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _bytes(tensors: Any) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size()
               for t in tensors)


def fsdp_world(rank: int, world: int, data: torch.Tensor, path: str,
               stack_states: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Everything FSDP2 in one 4-rank world (dp 2 x ep 2).

    1. An ``enable_mc2`` Mixtral under ``mc2.fully_shard``: AdamW steps, the global gradient
       norm from ``mc2.clip_grad_norm_``, the bytes each rank holds; then a checkpoint with the
       optimizer.
    2. The same model with bf16 parameters and fp32 reduction: one step.
    3. A stack of two ``MoELayer``s (with a shared expert) under ``mc2.fully_shard``: output and
       the router's gradient.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    import mc2
    import mc2.checkpoint
    from mc2.integrations.transformers import enable_mc2

    mesh = mc2.expert_parallel_mesh(2, num_experts=CONFIG["num_local_experts"])
    model = unpatched_model()
    enable_mc2(model, mesh=mesh, micro_batches=2)
    held = {"dense": 0, "experts": 0}
    mc2.fully_shard(model)
    experts = {id(p) for p in mc2.integrations.transformers.expert_parameters(model)}
    for p in model.parameters():
        held["experts" if id(p) in experts else "dense"] += _bytes([p])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms, _ = _adamw_steps(model, opt, data, rank)
    mc2.checkpoint.save(model, path, optimizer=opt, extra={"step": len(data)})
    all_dtensors = all(isinstance(p, DTensor) for p in model.parameters())

    mixed = unpatched_model()
    enable_mc2(mixed, mesh=mesh, micro_batches=2, dedup=True)  # and rows once per destination
    mc2.fully_shard(mixed, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                          reduce_dtype=torch.float32))
    mixed_loss = mixed(data[0, rank], labels=data[0, rank]).loss
    mixed_loss.backward()
    grads = [p.grad for p in mixed.parameters()]
    mixed_result = {"loss": mixed_loss.item(), "loss_dtype": mixed_loss.dtype,
                    "grad_dtypes": {g.dtype for g in grads},
                    "finite": all(bool(torch.isfinite(g.to_local()).all()) for g in grads)}

    manual = _manual_pattern(mesh, data[:2], rank)
    overlapped = _batch_overlap_steps(mesh, data[:2], rank)
    ep_only = _first_norm(mc2.expert_parallel_mesh(4), data[0, rank])

    torch.manual_seed(5)
    stack = torch.nn.Sequential(*(mc2.MoELayer(16, 24, 4, topk=2, shared_experts=1, mesh=mesh,
                                               dtype=torch.float64, micro_batches=2,
                                               dedup=True)  # rows once per destination
                                  for _ in range(2)))
    for layer, state in zip(stack, stack_states):
        mc2.load_full_state_dict(layer, state)
    mc2.fully_shard(stack)
    x = torch.randn(4 * 6, 16, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(11))
    mine = x[rank * 6:(rank + 1) * 6]
    out = stack(mine)
    # this rank's mean: FSDP2 averages the gradients over the 4 ranks, which makes them the
    # mean's over all ranks (a sum over x's rows here, as its comment once said, is a
    # quarter of the reference's: a fixed atol hid it, the gradients being ~1e-21)
    out.pow(2).mean().backward()
    return {"losses": losses, "norms": norms, "held": held, "all_dtensors": all_dtensors,
            "mixed": mixed_result, "manual_losses": manual, "ep_only_norm": ep_only,
            "overlapped": overlapped,
            "stack_out": out.detach(),
            "stack_gate_grad": stack[0].gate.weight.grad.full_tensor(),
            "stack_expert_grads": {  # this rank's experts, whole, and which they are
                f"{i}.{name}": (p.grad.full_tensor(),
                                list(layer.layout.experts_of_this_rank(layer.num_experts)))
                for i, layer in enumerate(stack) for name, p in layer.named_parameters()
                if name.startswith("experts.")}}


def _first_norm(mesh: Any, ids: torch.Tensor) -> float:
    """The gradient norm of the first step on a mesh with no DP (every expert on one rank)."""
    import mc2
    from mc2.integrations.transformers import enable_mc2

    model = unpatched_model()
    enable_mc2(model, mesh=mesh, micro_batches=2)
    mc2.fully_shard(model)
    model(ids, labels=ids).loss.backward()
    return mc2.clip_grad_norm_(model, 1e9, norm_type=2.0).item()


def _adamw_steps(model: Any, opt: Any, data: torch.Tensor, rank: int
                 ) -> tuple[list[float], list[float], list[bool]]:
    """One AdamW step per batch of ``data``: the losses, the infinity and 2-norms of the
    gradients (``mc2.clip_grad_norm_``, two per step) and, per step, whether every parameter
    was a shard again between the forward and the backward."""
    from torch.distributed.tensor import DTensor

    import mc2

    losses, norms, freed = [], [], []
    for step_batches in data:
        loss = model(step_batches[rank], labels=step_batches[rank]).loss
        freed.append(all(isinstance(p, DTensor) for p in model.parameters()))
        opt.zero_grad()
        loss.backward()
        norms.append(mc2.clip_grad_norm_(model, 1e9, norm_type=float("inf")).item())
        norms.append(mc2.clip_grad_norm_(model, 1e9).item())
        opt.step()
        losses.append(loss.item())
    return losses, norms, freed


def _batch_overlap_steps(mesh: Any, data: torch.Tensor, rank: int) -> dict[str, Any]:
    """The model of :func:`fsdp_world` with batch overlap under ``mc2.fully_shard``: AdamW
    losses and gradient norms of two steps, whether every parameter is a shard again between
    forward and backward (the layers were freed after their forward), and a no-grad forward."""
    from torch.distributed.tensor import DTensor

    import mc2
    from mc2.integrations.transformers import enable_mc2

    model = unpatched_model()
    enable_mc2(model, mesh=mesh, micro_batches=2, batch_overlap=True, min_tokens=1)
    mc2.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms, freed = _adamw_steps(model, opt, data, rank)
    chosen = model.model.layers.decision.chosen
    with torch.no_grad():
        logits = model(data[0, rank]).logits
        sharded = all(isinstance(p, DTensor) for p in model.parameters())
        model.model.layers.decision.chosen = False  # the same parameters, layer by layer
        plain = model(data[0, rank]).logits
    return {"losses": losses, "norms": norms, "freed": freed, "logits": (logits, plain),
            "chosen": chosen, "sharded_after_no_grad": sharded}


def _manual_pattern(mesh: Any, data: torch.Tensor, rank: int) -> list[float]:
    """The split of ``mc2.fully_shard`` written by hand, as ``docs/training_stack.md`` shows:
    AdamW losses of two steps."""
    from torch.distributed.fsdp import fully_shard

    from mc2.integrations.transformers import enable_mc2

    model = unpatched_model()
    enable_mc2(model, mesh=mesh, micro_batches=2)
    world = mesh._flatten("dp_ep")
    for layer in model.model.layers:
        experts = fully_shard(layer.mlp.experts, mesh=mesh["dp"])
        experts.set_gradient_divide_factor(float(mesh.size()))
        if mesh["dp"].size() > 1:
            experts.set_force_sum_reduction_for_comms(True)
        fully_shard(layer, mesh=world)
    fully_shard(model, mesh=world)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step_batches in data:
        loss = model(step_batches[rank], labels=step_batches[rank]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def stack_states(seed: int = 5) -> list[dict[str, torch.Tensor]]:
    """The full (all experts) states of the two layers of the stack, made in one process."""
    import mc2

    torch.manual_seed(seed)
    return [mc2.MoELayer(16, 24, 4, topk=2, shared_experts=1, dtype=torch.float64).state_dict()
            for _ in range(2)]


def stack_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The stack of :func:`fsdp_world` in one process: output, router gradient, and every
    routed expert parameter's gradient (all experts) by name."""
    import mc2

    states = stack_states()
    stack = torch.nn.Sequential(*(mc2.MoELayer(16, 24, 4, topk=2, shared_experts=1,
                                               dtype=torch.float64) for _ in range(2)))
    for layer, state in zip(stack, states):
        layer.load_state_dict(state)
    out = stack(x)
    out.pow(2).mean().backward()
    return out.detach(), stack[0].gate.weight.grad, {
        f"{i}.{name}": p.grad for i, layer in enumerate(stack)
        for name, p in layer.named_parameters() if name.startswith("experts.")}


def fsdp_data() -> torch.Tensor:
    return batches(STEPS)


DEEP_LAYERS = 4  # enough for "at most two layers at a time" to mean something


def _deep_model(dtype: torch.dtype = torch.float64):
    """The tiny Mixtral of the other tests with :data:`DEEP_LAYERS` decoder layers."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(**dict(CONFIG, num_hidden_layers=DEEP_LAYERS))
    model = transformers.MixtralForCausalLM(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or "gate" in name:
                p.normal_(0, 0.3)
    return model


class HeldLayers:
    """How many decoder layers hold gathered parameters (unsharded, or an all-gather in
    flight, whose output buffer is already allocated), sampled after every gather FSDP2
    issues or finishes and as every layer's post-backward (its reduce-scatter and reshard)
    begins. ``phase`` is set by the caller around the forward and the backward."""

    def __init__(self, layers: Any) -> None:
        from mc2.parallel.layer_gather import fsdp_units

        self.groups = [[g for unit in fsdp_units(layer)
                        for g in unit._get_fsdp_state()._fsdp_param_groups]
                       for layer in layers]
        self.phase = "forward"
        self.peak = {"forward": 0, "backward": 0}
        self.events: list[tuple[str, int, int]] = []  # backward: (what, layer, layers held)
        for index, groups in enumerate(self.groups):
            for group in groups:
                for name in ("unshard", "wait_for_unshard", "post_backward"):
                    self._wrap(group, name, index)

    def held(self) -> int:
        return sum(any(g.is_unsharded or g._all_gather_result is not None for g in groups)
                   for groups in self.groups)

    def _wrap(self, group: Any, name: str, index: int) -> None:
        method = getattr(group, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if name == "post_backward":
                self._sample("reduce", index)
            out = method(*args, **kwargs)
            if name != "post_backward":
                self._sample("gather" if name == "wait_for_unshard" else "issue", index)
            return out

        setattr(group, name, wrapped)  # the instance's, shadowing FSDPParamGroup's

    def _sample(self, what: str, index: int) -> None:
        held = self.held()
        self.peak[self.phase] = max(self.peak[self.phase], held)
        if self.phase == "backward":
            self.events.append((what, index, held))


def layers_held_world(rank: int, world: int, ids: torch.Tensor) -> dict[str, Any]:
    """A :data:`DEEP_LAYERS`-layer Mixtral (float64) under ``mc2.fully_shard`` on 2 ranks
    (ep 2: the dense layers sharded over both ranks), one forward and backward with and
    without batch overlap: the layers held at once in each pass, the backward's gathers and
    post-backwards in order, and every sharded gradient."""
    from torch.distributed.tensor import DTensor

    import mc2
    from mc2.integrations.transformers import enable_mc2

    mesh = mc2.expert_parallel_mesh(2, num_experts=CONFIG["num_local_experts"])
    out: dict[str, Any] = {}
    for overlapped in (False, True):
        model = _deep_model()
        enable_mc2(model, mesh=mesh, micro_batches=2, batch_overlap=overlapped, min_tokens=1)
        mc2.fully_shard(model)
        held = HeldLayers(model.model.layers)
        loss = model(ids[rank], labels=ids[rank]).loss
        held.phase = "backward"
        loss.backward()
        out["overlapped" if overlapped else "plain"] = {
            "loss": loss.item(), "peak": held.peak, "events": held.events,
            "held_after": held.held(),
            "sharded_after": all(isinstance(p, DTensor) and isinstance(p.grad, DTensor)
                                 for p in model.parameters()),
            "grads": {n: p.grad.to_local().clone() for n, p in model.named_parameters()},
            "chosen": getattr(model.model.layers, "decision", None) is not None
            and model.model.layers.decision.chosen}
    return out
