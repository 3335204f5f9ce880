"""Rank functions for ``mc2.forward_backward``: the paired schedule against the sequential
loop, gradients and the schedule it really ran."""

from __future__ import annotations

from typing import Any

import torch

import mc2
from tests.workers_schedule import ScheduleRecorder

MICRO_BATCHES = 4


def _stack(seed: int = 0) -> torch.nn.Module:
    from mc2.integrations.batch_overlap import BatchOverlapStack
    from tests.test_batch_overlap import Block

    torch.manual_seed(seed)
    return BatchOverlapStack([Block() for _ in range(3)], batch_overlap=True, min_tokens=1)


def _micro_batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(2, 6, 16, dtype=torch.float64, generator=g)
            for _ in range(MICRO_BATCHES)]


def _stack_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def _forward_transfers_under_backward(exchanges: list, spans: list) -> int:
    """How many of the forward's exchanges were in flight (issued, not yet waited for) across
    a whole compute span of a backward: the pairing at work (the sequential loop has none)."""
    backward = [s for s in spans if s.phase == "backward" and s.kind == "compute"]
    return sum(1 for e in exchanges if e.phase == "forward" and any(
        e.issued <= s.start and s.end <= e.waited for s in backward))


def _later_dispatches_under_backward(exchanges: list, spans: list) -> int:
    """:func:`_forward_transfers_under_backward` for the forward's dispatches past a call's
    first (micro-batch ``i > 0`` of its split): waited for inside a pass step, so in flight
    across a backward's compute only where the pass hands over at that wait too."""
    later = [e for e in exchanges if e.name == "dispatch" and e.micro_batch > 0]
    return _forward_transfers_under_backward(later, spans)


def _sequential(model: torch.nn.Module, batches: list, loss_fn: Any) -> list[torch.Tensor]:
    """The gradient-accumulation loop ``forward_backward`` must equal; its losses."""
    losses = []
    for batch in batches:
        loss = loss_fn(model, batch)
        loss.backward()
        losses.append(loss.detach())
    return losses


def _recorded(model: torch.nn.Module, batches: list, loss_fn: Any,
              overlap: bool | str, later: list | None = None) -> tuple[list[torch.Tensor], int]:
    """``forward_backward``'s losses, and how many of its forward's exchanges travelled across
    a backward's compute (appended to ``later``: how many of them were later dispatches,
    :func:`_later_dispatches_under_backward`)."""
    recorder = ScheduleRecorder()
    with recorder.installed(), mc2.profile() as prof:
        losses = mc2.forward_backward(model, batches, loss_fn, overlap=overlap)
    if later is not None:
        later.append(_later_dispatches_under_backward(recorder.exchanges(), prof.spans))
    return losses, _forward_transfers_under_backward(recorder.exchanges(), prof.spans)


def stack_paired(rank: int, world: int) -> dict[str, Any]:
    """The same 3-layer stack of MoE layers (float64) through the sequential loop and through
    ``forward_backward(overlap=True)`` (and ``False``), each recorded: losses, gradients, the
    forward exchanges in flight across a backward's compute."""
    found: dict[str, Any] = {}
    batches = _micro_batches(rank)
    model = _stack()
    loop = _sequential(model, batches, _stack_loss)
    found["loop"] = {"losses": loop, "grads": [p.grad.clone() for p in model.parameters()]}
    for overlap in (False, True):
        model = _stack()
        losses, under = _recorded(model, batches, _stack_loss, overlap)
        found[overlap] = {"losses": losses, "grads": [p.grad.clone() for p in model.parameters()],
                          "under_backward": under}
    return found


class _Residual(torch.nn.Sequential):
    """Layers each added to the stream they read, as a transformer's are: without it, each
    small-weighted SwiGLU layer shrinks its input ~1e-7-fold, the losses end near 1e-49,
    and any absolute tolerance (``pytest.approx``'s 1e-12) would pass whatever they were."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        for layer in self:
            x = x + layer(x)
        return x


def _in_layer_stack(seed: int = 0, dtype: torch.dtype = torch.float64,
                    **config: Any) -> torch.nn.Module:
    """Three ``mc2.MoELayer``s one after the other (residual: :class:`_Residual`): each
    calls mc2 inside its forward, no layer loop of mc2's (the paired schedule pairs their
    eager calls)."""
    torch.manual_seed(seed)
    return _Residual(*(mc2.MoELayer(16, 24, 4, topk=2, dtype=dtype, **config)
                       for _ in range(3)))


def in_layer_paired(rank: int, world: int) -> dict[str, Any]:
    """:func:`stack_paired` for a stack that calls mc2 inside its layers (no layer loop)."""
    batches = _micro_batches(rank)
    model = _in_layer_stack()
    _sequential(model, batches, _stack_loss)
    found: dict[str, Any] = {"loop": [p.grad.clone() for p in model.parameters()]}
    for overlap in (False, True):
        model = _in_layer_stack()
        later: list[int] = []
        _, under = _recorded(model, batches, _stack_loss, overlap, later)
        found[overlap] = {"grads": [p.grad.clone() for p in model.parameters()],
                          "under_backward": under, "later_under_backward": later[0]}
    return found


def paired_on_one_rank(rank: int, world: int) -> str | None:
    """Rank 0 runs the pairing (a framework's paired loop, :func:`run_pairs`, with no count
    agreed first), rank 1 the sequential loop, the calls' K fixed (so nothing else in the
    calls differs): what each raised."""
    from mc2.engine.autograd.pairing import run_pairs

    model, batches = _in_layer_stack(micro_batches=2), _micro_batches(rank)
    try:
        if rank == 0:
            run_pairs(len(batches), lambda i: _stack_loss(model, batches[i]),
                      lambda loss: loss.backward())
        else:
            _sequential(model, batches, _stack_loss)
    except ValueError as exc:
        return str(exc)
    return None


def failing_paired_forward(rank: int, world: int) -> None:
    """Rank 1's ``loss_fn`` raises in its second micro-batch, a paired forward; the exception
    ends the rank's process, as a training script's would."""
    calls = [0]

    def loss_fn(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if rank == 1 and calls[0] == 2:
            raise KeyError("loss_fn failed on purpose")
        return _stack_loss(model, x)

    mc2.forward_backward(_in_layer_stack(), _micro_batches(rank), loss_fn, overlap=True)


def capacity_paired(rank: int, world: int) -> dict[str, Any]:
    """The in-layer stack in capacity mode with drops (12 tokens a micro-batch, 4 rows a
    destination, ``overflow="drop"``, ``micro_batches="auto"``): the sequential loop and
    ``forward_backward(overlap=True)``, losses, gradients and the rows each dropped."""
    from mc2.engine.decide.capacity import dropped_rows

    batches = _micro_batches(rank)
    found: dict[str, Any] = {}
    for overlap in (None, True):
        model = _in_layer_stack(capacity=4, overflow="drop")
        before = int(dropped_rows())
        losses = _sequential(model, batches, _stack_loss) if overlap is None else \
            mc2.forward_backward(model, batches, _stack_loss, overlap=True)
        found[overlap] = {"losses": losses, "grads": [p.grad.clone() for p in model.parameters()],
                          "dropped": int(dropped_rows()) - before}
    return found


def hf_paired(rank: int, world: int, dtype_name: str, hostile: bool,
              batch_overlap: bool = True) -> dict[str, Any]:
    """A 2-layer Mixtral under ``enable_mc2``: the sequential loop on the in-layer model
    against ``forward_backward(overlap=True)`` on the batch-overlap model (``batch_overlap``;
    else on the in-layer model, whose eager calls pair), same weights and micro-batches (with
    padding masks, a router auxiliary loss); losses and gradients."""
    from tests.workers_mesh import CONFIG
    from tests.workers_overlap import _model

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(rank)
    batches = []
    for _ in range(MICRO_BATCHES):
        ids = torch.randint(0, CONFIG["vocab_size"], (4, 12), generator=g)
        mask = torch.ones_like(ids)
        mask[-1, :3] = 0
        batches.append((ids, mask))

    def loss_fn(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        ids, mask = batch
        return model(ids, labels=ids, attention_mask=mask).loss

    ref = _model(dtype, hostile)
    want = _sequential(ref, batches, loss_fn)
    got_model = _model(dtype, hostile, batch_overlap=True, min_tokens=1) if batch_overlap \
        else _model(dtype, hostile)
    got = mc2.forward_backward(got_model, batches, loss_fn, overlap=True)
    return {"want": want, "got": got,
            "grads": {n: (p.grad, q.grad) for (n, p), q in
                      zip(ref.named_parameters(), got_model.parameters())}}


class _EarlyExit(torch.nn.Module):
    """The in-layer stack, run to a depth each micro-batch names: a forward with fewer mc2
    calls than the backward it is paired with ends inside that backward (where FSDP2 takes
    it for a recompute and registers no backward hook for it)."""

    def __init__(self, dtype: torch.dtype = torch.float64, **config: Any) -> None:
        super().__init__()
        self.layers = _in_layer_stack(0, dtype, **config)

    def forward(self, x: torch.Tensor, depth: int) -> torch.Tensor:
        for layer in self.layers[:depth]:
            x = x + layer(x)
        return x


class _TiedEarlyExit(_EarlyExit):
    """:class:`_EarlyExit` between an input projection and an output projection that share
    one weight, as a language model ties its embedding and its output head: FSDP2 shards
    such a pair as one unit of two modules (``fully_shard([embed, head])``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embed = torch.nn.Linear(16, 16, bias=False, dtype=torch.float64)
        self.head = torch.nn.Linear(16, 16, bias=False, dtype=torch.float64)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor, depth: int) -> torch.Tensor:
        return self.head(super().forward(self.embed(x), depth))


def _depth_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, int]) -> torch.Tensor:
    return model(*batch).pow(2).mean()


def fsdp2_paired(rank: int, world: int, units: str) -> dict[str, Any]:
    """:func:`in_layer_paired` for the stack sharded by FSDP2 over the world: ``units``
    ``"layers"`` (each layer a unit, the stack the root), ``"root"`` (one unit), ``"tied"``
    (each layer a unit, and a tied input projection and output head one unit of the two
    modules, :class:`_TiedEarlyExit`) or ``"mixed"`` (``"layers"`` in float32 under FSDP2's
    bf16 parameters and float32 reduction; two splits per call, as the paired calls of
    ``micro_batches="auto"`` take, so that both schedules split alike). The last
    micro-batch runs one layer where the others run three, so its forward ends inside the
    backward before it: under ``"root"`` it registers no FSDP2 hook at all. Each rank's
    local shard of every gradient after the sequential loop and after
    ``forward_backward(overlap=True)``; whether FSDP2 left every unit sharded after the
    step, as its own loop does."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    mixed = units == "mixed"
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mixed else \
        MixedPrecisionPolicy()
    batches = [(x.float() if mixed else x, 1 if i == MICRO_BATCHES - 1 else 3)
               for i, x in enumerate(_micro_batches(rank))]
    found: dict[str, Any] = {}
    gathers = [0]
    original = _fsdp_param_group.foreach_all_gather

    def counted(*args: Any, **kwargs: Any) -> Any:
        gathers[0] += 1
        return original(*args, **kwargs)

    _fsdp_param_group.foreach_all_gather = counted
    try:
        for overlap in (None, True):
            model = _TiedEarlyExit() if units == "tied" else \
                _EarlyExit(torch.float32, micro_batches=2) if mixed else _EarlyExit()
            for layer in model.layers if units != "root" else ():
                fully_shard(layer, mp_policy=policy)
            if units == "tied":
                fully_shard([model.embed, model.head])
            fully_shard(model, mp_policy=policy)
            gathers[0] = 0
            if overlap is None:
                losses = _sequential(model, batches, _depth_loss)
                under = 0
            else:
                losses, under = _recorded(model, batches, _depth_loss, overlap)
            found[overlap] = {  # a parameter left gathered holds its gradient whole
                "grads": [getattr(p.grad, "to_local", p.grad.detach)().clone()
                          for p in model.parameters()],
                "losses": losses, "under_backward": under, "gathers": gathers[0],
                "groups": len({id(g) for m in model.modules() if hasattr(m, "_get_fsdp_state")
                               for g in m._get_fsdp_state()._fsdp_param_groups}),
                "sharded": all(type(p).__name__ == "DTensor" for p in model.parameters())}
    finally:
        _fsdp_param_group.foreach_all_gather = original
    return found


def fsdp2_failed_step(rank: int, world: int, where: str = "forward") -> dict[str, Any]:
    """An FSDP2-sharded stack (each layer a unit) whose paired step fails in the third
    micro-batch's forward (``where="forward"``: after the first backward accumulated its
    gradients unsharded) or at the end of the last backward (``"last backward"``, which runs
    outside the step's held units); then ``zero_grad`` and a whole paired step, against the
    sequential loop on a twin model. Each rank's local gradient shards, and whether every
    unit was left sharded after the failure and after the step."""
    from torch.distributed.fsdp import fully_shard

    batches = [(x, 3) for x in _micro_batches(rank)]

    def sharded() -> torch.nn.Module:
        model = _EarlyExit()
        for layer in model.layers:
            fully_shard(layer)
        return fully_shard(model)

    def failing(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if batch is batches[2] and where == "forward":
            raise RuntimeError("the forward failed on purpose")
        if batch is batches[-1] and where == "last backward":
            x = _FailingBackward.apply(batch[0].clone().requires_grad_(True))
            return _depth_loss(model, (x, batch[1]))
        return _depth_loss(model, batch)

    def left_sharded(model: torch.nn.Module) -> bool:
        return all(type(p).__name__ == "DTensor" for p in model.parameters())

    model = sharded()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # holds the sharded parameters
    try:
        mc2.forward_backward(model, batches, failing, overlap=True)
        raised = None
    except RuntimeError as exc:
        raised = str(exc)
    after_failure = left_sharded(model)
    optimizer.zero_grad(set_to_none=True)  # as a training loop clears them: the shards'
    mc2.forward_backward(model, batches, _depth_loss, overlap=True)
    twin = sharded()
    _sequential(twin, batches, _depth_loss)
    return {"raised": raised, "after_failure": after_failure, "after_step": left_sharded(model),
            "got": [p.grad.to_local().clone() for p in model.parameters()],
            "want": [p.grad.to_local().clone() for p in twin.parameters()]}


class _FailingBackward(torch.autograd.Function):
    """The identity, whose backward raises: at the model's input, it raises at the very end
    of a backward, after every mc2 call of it gave way to the paired forward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise RuntimeError("the backward failed on purpose")


def failed_step(rank: int, world: int) -> dict[str, Any]:
    """A paired step whose first backward raises while the second micro-batch's forward is
    suspended in the partner thread: what ``forward_backward`` raised, the threads alive
    before and after, and then a whole paired step on the same model, against the
    sequential loop (the given-up forward must not leave the model or the group broken)."""
    import threading

    batches = _micro_batches(rank)
    leaf = [x.clone().requires_grad_(True) for x in batches]

    def failing(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x is leaf[0]:
            x = _FailingBackward.apply(x)
        return _stack_loss(model, x)

    model = _in_layer_stack()
    mc2.forward_backward(model, batches[:2], _stack_loss, overlap=True)  # partner made
    threads = threading.active_count()
    try:
        mc2.forward_backward(model, leaf, failing, overlap=True)
        raised = None
    except RuntimeError as exc:
        raised = str(exc)
    model.zero_grad(set_to_none=True)
    mc2.forward_backward(model, batches, _stack_loss, overlap=True)
    threads_after = threading.active_count()  # a forward left suspended keeps its thread
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    _sequential(model, batches, _stack_loss)
    return {"raised": raised, "threads": (threads, threads_after), "got": got,
            "want": [p.grad.clone() for p in model.parameters()]}


class _SelectivelyCheckpointed(torch.nn.Module):
    """``inner`` under selective activation checkpointing: its mc2 call runs as the operator
    (eagerly). ``policy``: mc2's (the call's output saved, its recompute runs no exchange),
    else one that recomputes everything (the call runs again in the backward, exchanges
    included, as under TorchTitan's own policy, whose save list does not name it)."""

    def __init__(self, inner: torch.nn.Module, policy: bool = True) -> None:
        super().__init__()
        self.inner, self.policy = inner, policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from functools import partial

        from torch.utils.checkpoint import (
            CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts)

        policy = mc2.checkpoint_policy() if self.policy else \
            (lambda ctx, func, *args, **kwargs: CheckpointPolicy.PREFER_RECOMPUTE)
        context = partial(create_selective_checkpoint_contexts, policy)
        return checkpoint(self.inner, x, use_reentrant=False, context_fn=context)


def selective_paired(rank: int, world: int) -> dict[str, Any]:
    """The in-layer stack, each layer under selective checkpointing (with mc2's policy, and
    with one that recomputes everything), through the sequential loop and paired: losses,
    gradients, and the forward exchanges in flight across a backward's compute."""
    batches = _micro_batches(rank)
    found: dict[str, Any] = {}
    for policy in (True, False):
        model = _Residual(*(_SelectivelyCheckpointed(layer, policy)
                            for layer in _in_layer_stack()))
        want = _sequential(model, batches, _stack_loss)
        want_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        losses, under = _recorded(model, batches, _stack_loss, True)
        found[policy] = {"want": [float(x) for x in want], "losses": [float(x) for x in losses],
                         "under_backward": under, "want_grads": want_grads,
                         "grads": [p.grad.clone() for p in model.parameters()]}
    return found


def refusals(rank: int, world: int) -> dict[str, str | None]:
    """What ``forward_backward`` raises for a model that makes no mc2 call and for a loss
    that is no scalar (overlap=True), and where the ranks differ in their number of
    micro-batches or in overlap, on each rank."""
    found: dict[str, str | None] = {}
    plain = torch.nn.Sequential(torch.nn.Linear(16, 16, dtype=torch.float64))
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    from torch.distributed._composable import replicate

    ddp = torch.nn.parallel.DistributedDataParallel(_in_layer_stack())
    replicated = replicate(_in_layer_stack())
    compiled = torch.compile(_in_layer_stack(), backend="aot_eager")
    for name, model, loss_fn in (
            ("no mc2 call", plain, lambda m, b: m(b).pow(2).mean()),
            ("DDP", ddp, lambda m, b: m(b).pow(2).mean()),
            ("replicate", replicated, lambda m, b: m(b).pow(2).mean()),
            ("compiled", compiled, lambda m, b: m(b).pow(2).mean()),
            ("not a scalar", _stack(), lambda m, b: m(b))):
        try:
            mc2.forward_backward(model, [x, x], loss_fn, overlap=True)
            found[name] = None
        except ValueError as exc:
            found[name] = str(exc)
    # ranks that differ: in the number of micro-batches (an epoch's last step, shorter on
    # one rank), paired and sequential; in overlap
    for name, count, overlap in (("counts paired", 3 - rank, True),
                                 ("counts sequential", 3 - rank, False),
                                 ("overlap", 2, (True, False)[rank])):
        try:
            mc2.forward_backward(_in_layer_stack(), _micro_batches(rank)[:count],
                                 _stack_loss, overlap=overlap)
            found[name] = None
        except ValueError as exc:
            found[name] = str(exc)
    return found


def auto_decides(rank: int, world: int, calls: int) -> dict[str, Any]:
    """``overlap="auto"`` over ``calls`` calls of the stack: whether each call paired (from the
    forward exchanges in flight across a backward), the decision, and whether every call's
    gradients equal the sequential loop's."""
    batches = _micro_batches(rank)
    reference = _stack()
    for x in batches:
        _stack_loss(reference, x).backward()
    want = [p.grad.clone() for p in reference.parameters()]
    model = _stack()
    paired, equal = [], True
    for _ in range(calls):
        model.zero_grad(set_to_none=True)
        recorder = ScheduleRecorder()
        with recorder.installed(), mc2.profile() as prof:
            mc2.forward_backward(model, batches, _stack_loss, overlap="auto")
        paired.append(_forward_transfers_under_backward(recorder.exchanges(), prof.spans) > 0)
        equal = equal and all(
            float((p.grad - w).norm()) <= 1e-10 * float(w.norm())
            for p, w in zip(model.parameters(), want))
    from mc2.forward_backward import kept_decision

    decision = kept_decision(model, "auto")
    return {"paired": paired, "chosen": decision.chosen, "equal": equal,
            "times": decision.report()["times"]}


def hf_hidden_states_paired(rank: int, world: int) -> dict[str, Any]:
    """A batch-overlap Mixtral whose forward asks for every layer's hidden states (recorded by
    hooks on the decoder layers, which a split forward would run in parts): under the
    pairing its layers run whole, so it pairs; its losses and gradients against the
    sequential loop on the same model."""
    from tests.workers_mesh import CONFIG
    from tests.workers_overlap import _model

    model = _model(torch.float64, False, batch_overlap=True, min_tokens=1)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, CONFIG["vocab_size"], (4, 12), generator=g) for _ in range(3)]

    def loss_fn(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        out = m(ids, labels=ids, output_hidden_states=True)
        return out.loss + 1e-3 * out.hidden_states[1].pow(2).mean()

    want = _sequential(model, batches, loss_fn)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    got, under = _recorded(model, batches, loss_fn, True)
    return {"want": want, "got": got, "under_backward": under,
            "equal": all(float((p.grad - w).norm()) <= 1e-10 * float(w.norm())
                         for p, w in zip(model.parameters(), grads))}


def hf_ep_paired(rank: int, world: int, path: str, layout: str) -> dict[str, Any]:
    """A Mixtral loaded with Hugging Face's own expert parallelism and
    ``ep_implementation="mc2"`` (``layout`` as :func:`tests.workers_hf_ep._distributed_config`):
    the sequential loop against ``forward_backward(overlap=True)`` on a second copy, 3
    micro-batches; losses, each parameter's local gradient, whether pairing happened (the
    forward's exchanges in flight across a backward's compute), and the FSDP2 units found."""
    import os

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import mc2.integrations.hf_expert_parallel  # noqa: F401 - registers "mc2"
    from tests.workers_hf_ep import _distributed_config

    os.environ.setdefault("LOCAL_RANK", str(rank))
    g = torch.Generator().manual_seed(7 + (rank if layout == "dp" else 0))
    batches = [torch.randint(3, 64, (2, 8), generator=g) for _ in range(3)]

    def load() -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32,
            distributed_config=_distributed_config(layout, world, "mc2"))
        return model.eval()  # no dropout, no routing noise

    def loss_fn(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model(ids, labels=ids).loss

    def local(t: Any) -> Any:
        return None if t is None else (t.to_local() if isinstance(t, DTensor) else t).clone()

    ref = load()
    want = _sequential(ref, batches, loss_fn)
    model = load()
    refused = None
    try:
        mc2.forward_backward(model, batches[:1], loss_fn, overlap=True)
        model.zero_grad(set_to_none=True)
    except ValueError as exc:  # FSDP2: before anything ran
        refused = str(exc)
    got, under = _recorded(model, batches, loss_fn, True if refused is None else "auto")
    return {"want": want, "got": got, "refused": refused,
            "grads": {n: (local(p.grad), local(q.grad)) for (n, p), q in
                      zip(ref.named_parameters(), model.parameters())},
            "under_backward": under,
            "fsdp_units": sum(isinstance(m, FSDPModule) for m in model.modules())}


def _doubling_modes() -> tuple[Any, Any]:
    """A ``TorchFunctionMode`` and a ``TorchDispatchMode`` that each double every
    ``mean`` (the loss's last step, which no backward calls) and count those means by
    thread: what a mode does to a forward, a paired forward must do too."""
    import collections
    import threading

    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Doubling:
        target: Any = None

        def __init__(self) -> None:
            super().__init__()
            self.means: collections.Counter = collections.Counter()

        def doubled(self, func: Any, args: Any, kwargs: Any) -> Any:
            out = func(*args, **(kwargs or {}))
            if func is type(self).target:  # a class attribute: not bound to self
                self.means[threading.current_thread().name] += 1
                out = out * 2
            return out

    class DoublingFunctions(Doubling, TorchFunctionMode):
        target = torch.Tensor.mean

        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            return self.doubled(func, args, kwargs)

    class DoublingDispatch(Doubling, TorchDispatchMode):
        target = torch.ops.aten.mean.default

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            return self.doubled(func, args, kwargs)

    return DoublingFunctions, DoublingDispatch


def modes_carried(rank: int, world: int, kind: str) -> dict[str, Any]:
    """The in-layer stack's sequential loop and paired step, each under one mode of
    ``kind`` (``"function"`` or ``"dispatch"``: :func:`_doubling_modes`): the means each
    thread ran under it, the losses, and the gradients."""
    import threading

    batches = _micro_batches(rank)
    make = dict(zip(("function", "dispatch"), _doubling_modes()))[kind]
    found: dict[str, Any] = {}
    for overlap in (None, True):
        model = _in_layer_stack()
        with make() as mode:
            if overlap is None:
                losses = _sequential(model, batches, _stack_loss)
            else:
                losses = mc2.forward_backward(model, batches, _stack_loss, overlap=True)
        found[overlap] = {"partner": mode.means["mc2-paired-forward"],
                          "caller": mode.means[threading.current_thread().name],
                          "losses": [float(x) for x in losses],
                          "grads": [p.grad.clone() for p in model.parameters()]}
    model = _in_layer_stack()
    found["plain_losses"] = [float(x) for x in _sequential(model, batches, _stack_loss)]
    return found


def host_syncs_paired(rank: int, world: int) -> dict[str, Any]:
    """The host synchronisations (:class:`~mc2.observation.host_syncs.HostSyncCounter`, a
    ``TorchFunctionMode`` the pairing carries into the paired forwards) of the in-layer
    stack's sequential loop and paired step, each the second of its kind (the first ones
    warm the planner): counts by operation and where."""
    import collections

    from mc2.observation.host_syncs import HostSyncCounter

    batches = _micro_batches(rank)
    found: dict[str, Any] = {}
    for overlap in (None, True, None, True):
        model = _in_layer_stack()
        with HostSyncCounter() as counter:
            if overlap is None:
                _sequential(model, batches, _stack_loss)
            else:
                mc2.forward_backward(model, batches, _stack_loss, overlap=True)
        found[overlap] = {"reads": counter.reads, "uploads": counter.uploads,
                          "where": collections.Counter(counter.where)}
    return found


def modes_left_behind(rank: int, world: int) -> dict[str, Any]:
    """A paired step whose second forward (in the partner thread) enters a mode it never
    exits and sets the default device; then a second paired step that records, in each
    forward, the mode stack's depth and the thread (the partner thread is kept between
    steps: nothing of the first step's forward may reach the second's)."""
    import threading

    from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

    class PassThrough(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    batches = _micro_batches(rank)
    model = _in_layer_stack()

    def untidy(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x is batches[1]:
            PassThrough().__enter__()  # never exited
            torch.set_default_device("cpu")
        return _stack_loss(model, x)

    depths: list[tuple[str, int]] = []

    def recorded(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        depths.append((threading.current_thread().name, len(_get_current_function_mode_stack())))
        return _stack_loss(model, x)

    mc2.forward_backward(model, batches, untidy, overlap=True)
    mc2.forward_backward(model, batches, recorded, overlap=True)
    return {"depths": depths}


def _refusal(step: Any) -> str | None:
    """What ``step()`` raised as a ``ValueError`` (its message), or ``None``."""
    try:
        step()
    except ValueError as exc:
        return str(exc)
    return None


def autograd_in_the_forward(rank: int, world: int) -> dict[str, Any]:
    """A loss that runs ``torch.autograd.grad`` itself, on a machine emulated as one whose
    autograd runs CPU backwards in a device thread (where a paired forward running autograd
    would hang the step): what ``overlap=True`` raises, and with ``"auto"`` over three steps,
    the threads the forwards ran in, the warnings, and each step's gradients against the
    sequential loop's."""
    import threading
    import warnings

    import mc2.engine.autograd.pairing as pairing_module
    from mc2.observation.once import forget

    # as where an accelerator is present: every entry into the engine counts, the CPU's too
    # (a graph rooted on a host tensor reaches the device's nodes)
    pairing_module.watched = lambda: True
    forget()
    batches = _micro_batches(rank)
    threads: list[str] = []

    def chunked(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        threads.append(threading.current_thread().name)
        scale = torch.ones(2, dtype=x.dtype, requires_grad=True)
        (g,) = torch.autograd.grad((scale * 3).sum(), scale)  # autograd inside the forward
        return _stack_loss(model, x) * g[0] / 3

    refused = _refusal(lambda: mc2.forward_backward(_in_layer_stack(), batches, chunked,
                                                    overlap=True))
    steps = []
    model = _in_layer_stack()  # one model: "auto"'s decision, and why it ran unpaired, stay
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            threads.clear()
            losses = mc2.forward_backward(model, batches, chunked, overlap="auto")
            got = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            want_losses = _sequential(model, batches, chunked)
            steps.append({"threads": list(threads), "losses": [float(x) for x in losses],
                          "want_losses": [float(x) for x in want_losses], "got": got,
                          "want": [p.grad.clone() for p in model.parameters()]})
    kept_unpairable = "_mc2_unpairable" in model.__dict__
    # a forward that runs autograd only in a later micro-batch: the first is clean, so the
    # step pairs, and the paired forward's call is refused where the backward beside it runs
    # in a thread of its own (emulated), instead of waiting for that thread forever
    pairing_module._backward_elsewhere = lambda partner, caller: True

    def later(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return chunked(model, x) if x is batches[2] else _stack_loss(model, x)

    model = _in_layer_stack()
    refused_later = _refusal(lambda: mc2.forward_backward(model, batches, later, overlap=True))
    model.zero_grad(set_to_none=True)
    mc2.forward_backward(model, batches, _stack_loss, overlap=True)  # the next step pairs
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    _sequential(model, batches, _stack_loss)
    after = (got, [p.grad.clone() for p in model.parameters()])

    # the same later forward's autograd with the device threads turned off where it runs
    # (as AOTAutograd does while it traces a compiled region's backward): the engine runs in
    # that thread, nothing waits for the stopped one, and the step pairs
    def threads_off(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x is not batches[2]:
            return _stack_loss(model, x)
        with torch.autograd.set_multithreading_enabled(False):
            return chunked(model, x)

    model.zero_grad(set_to_none=True)
    threads.clear()
    refused_off = _refusal(lambda: mc2.forward_backward(model, batches, threads_off,
                                                        overlap=True))
    ran_in = list(threads)
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    _sequential(model, batches, threads_off)
    return {"refused": refused, "steps": steps, "refused_later": refused_later,
            "kept_unpairable": kept_unpairable, "after": after,
            "threads_off": {"refused": refused_off, "threads": ran_in,
                            "grads": (got, [p.grad.clone() for p in model.parameters()])},
            "warnings": [str(w.message) for w in caught]}


def autograd_threads_carried(rank: int, world: int) -> dict[str, Any]:
    """A step whose caller turned autograd's device threads off (as TorchTitan's trainer
    does; a thread-local switch), with a loss that records, by thread, what each forward
    sees of it: the sequential loop's and the paired step's records, and their gradients."""
    import threading

    batches = _micro_batches(rank)
    found: dict[str, Any] = {}
    for overlap in (None, True):
        model = _in_layer_stack()
        seen: list[tuple[str, bool]] = []

        def recording(model: torch.nn.Module, x: torch.Tensor,
                      seen: list = seen) -> torch.Tensor:
            seen.append((threading.current_thread().name,
                         torch.autograd.is_multithreading_enabled()))
            return _stack_loss(model, x)

        with torch.autograd.set_multithreading_enabled(False):
            if overlap is None:
                _sequential(model, batches, recording)
            else:
                mc2.forward_backward(model, batches, recording, overlap=True)
        found[overlap] = {"seen": seen, "grads": [p.grad.clone() for p in model.parameters()]}
    return found


def autograd_in_the_forward_without_autograd_threads(rank: int, world: int) -> dict[str, Any]:
    """:func:`autograd_in_the_forward`'s loss (``torch.autograd.grad`` in every forward),
    emulated as where an accelerator is present, but with autograd's device threads turned
    off by the caller (``set_multithreading_enabled(False)``, as TorchTitan's trainer does):
    the backward then runs in the caller's thread, so ``overlap=True`` pairs the step. The
    threads the forwards ran in, the losses and gradients against the sequential loop's."""
    import threading

    import mc2.engine.autograd.autograd_watch as watch_module

    watch_module.accelerator_present = lambda: True  # as where an accelerator is present
    batches = _micro_batches(rank)
    threads: list[str] = []

    def chunked(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        threads.append(threading.current_thread().name)
        scale = torch.ones(2, dtype=x.dtype, requires_grad=True)
        (g,) = torch.autograd.grad((scale * 3).sum(), scale)
        return _stack_loss(model, x) * g[0] / 3

    model = _in_layer_stack()
    with torch.autograd.set_multithreading_enabled(False):
        watched = watch_module.watched()
        losses = mc2.forward_backward(model, batches, chunked, overlap=True)
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    want = _sequential(model, batches, chunked)
    return {"watched": watched, "watched_with_threads": watch_module.watched(),
            "threads": threads, "losses": [float(x) for x in losses],
            "want_losses": [float(x) for x in want], "got": got,
            "want": [p.grad.clone() for p in model.parameters()]}


def torchtitan_step_left_unfinished(rank: int, world: int, retried: bool) -> dict[str, Any]:
    """``PairedFwdBwd`` (TorchTitan's paired ``fwd_bwd_fn``) on a trainer as TorchTitan's
    ``train_step`` uses it, 3 micro-batches a step, each step's calls handed one
    ``global_valid_tokens`` tensor made for it: step 1 stops after 2 of them (its loop raised
    between two calls, and the caller went on), then the next step runs whole: step 2, or
    (``retried``) step 1 again under the same count, as ``train()`` after a checkpoint load
    restores it. That step's gradients against the sequential loop's over its own
    micro-batches."""
    import contextlib
    from types import SimpleNamespace

    from mc2.integrations.torchtitan_schedule import PairedFwdBwd

    batches = _micro_batches(rank)
    model = _in_layer_stack()
    trainer = SimpleNamespace(
        model_parts=[model], fwd_bwd_fn=None, gradient_accumulation_steps=3, step=1,
        train_context=contextlib.nullcontext, model=model,
        loss_fn=lambda pred, labels, valid: (pred.pow(2).mean(), None))
    paired = PairedFwdBwd(trainer)
    tokens = torch.tensor(0)  # train_step's global_valid_tokens, one per step
    for x in batches[:2]:  # step 1, left after two micro-batches
        paired(x, None, tokens, {})
    model.zero_grad(set_to_none=True)  # TorchTitan's next step clears the gradients
    trainer.step = 1 if retried else 2
    step_two, tokens = [batches[3], batches[2], batches[1]], torch.tensor(0)
    for x in step_two:
        paired(x, None, tokens, {})
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    _sequential(model, step_two, _stack_loss)
    return {"got": got, "want": [p.grad.clone() for p in model.parameters()],
            "taken": paired.loop.taken}


def hooks_carried(rank: int, world: int) -> dict[str, Any]:
    """The in-layer stack's sequential loop and paired step, each under one saved-tensor hook
    (as activation offload installs one) that counts what it packs, by thread: how many
    tensors each packed, how many of the paired step's the partner thread packed, and
    whether the gradients agree."""
    import collections
    import threading

    batches = _micro_batches(rank)
    packed: collections.Counter = collections.Counter()

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed[threading.current_thread().name] += 1
        return t

    found: dict[str, Any] = {}
    for overlap in (None, True):
        model = _in_layer_stack()
        packed.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if overlap is None:
                _sequential(model, batches, _stack_loss)
            else:
                mc2.forward_backward(model, batches, _stack_loss, overlap=True)
        found[overlap] = {"packed": sum(packed.values()),
                          "partner": packed["mc2-paired-forward"],
                          "caller": packed[threading.current_thread().name],
                          "grads": [p.grad.clone() for p in model.parameters()]}
    return found


def dropout_paired(rank: int, world: int) -> dict[str, Any]:
    """The in-layer stack with dropout before and after each MoE layer (p = 0.3, training),
    each layer plain, under a reentrant checkpoint and under a non-reentrant one (whose
    recomputes set the generator to the forward's state and back): per kind, the sequential
    loop's and the paired step's losses and gradients from one seed, and whether the step
    paired (its forwards in the partner thread)."""
    import threading

    from torch.utils.checkpoint import checkpoint

    class Block(torch.nn.Module):
        def __init__(self, moe: torch.nn.Module, kind: str) -> None:
            super().__init__()
            self.moe, self.kind = moe, kind

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            def body(x: torch.Tensor) -> torch.Tensor:
                y = self.moe(torch.nn.functional.dropout(x, 0.3, True))
                return torch.nn.functional.dropout(y, 0.3, True)
            if self.kind == "plain":
                return x + body(x)
            return x + checkpoint(body, x, use_reentrant=self.kind == "reentrant")

    batches = _micro_batches(rank)
    threads: list[str] = []

    def loss_fn(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        threads.append(threading.current_thread().name)
        return model(x.clone().requires_grad_()).pow(2).mean()

    found: dict[str, Any] = {}
    for kind in ("plain", "reentrant", "non-reentrant"):
        runs = {}
        for overlap in (None, True):
            model = torch.nn.Sequential(*(Block(m, kind) for m in _in_layer_stack()))
            threads.clear()
            torch.manual_seed(1234)
            losses = _sequential(model, batches, loss_fn) if overlap is None else \
                mc2.forward_backward(model, batches, loss_fn, overlap=True)
            runs[overlap] = ([float(x) for x in losses], [p.grad.clone() for p in model.parameters()],
                             threads.count("mc2-paired-forward"))
        found[kind] = runs
    return found


def step_on_a_subgroup(rank: int, world: int) -> dict[str, Any]:
    """Two EP groups of 2 in a world of 4: a step agreed on the world, then one on group A's
    ranks alone (B's ranks wait at a barrier of the world): the second step's decision must
    agree on group A, not on the world the first step's kept."""
    import torch.distributed as dist

    from mc2.forward_backward import kept_decision

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    torch.manual_seed(0)
    model = mc2.MoELayer(16, 24, 4, topk=2, group=mine, dtype=torch.float64)
    model.reset_parameters(std=0.3)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(2, 6, 16, dtype=torch.float64, generator=g) for _ in range(2)]
    loss = lambda m, x: m(x).pow(2).mean()  # noqa: E731
    mc2.forward_backward(model, batches, loss, overlap=True)
    if rank < 2:
        mc2.forward_backward(model, batches, loss, overlap=True, group=mine)
    dist.barrier()
    mine_kept = kept_decision(model, True, mine)
    return {"world": kept_decision(model, True) is not None,
            "group": mine_kept is not None and mine_kept.group is mine}
