"""Batch overlap (two micro-batches interleaved across decoder layers) changes nothing but the
schedule: a tiny Mixtral on 2 ranks, with and without it."""

from __future__ import annotations

import warnings

import pytest
import torch

import mc2
from mc2.integrations.batch_overlap import BatchOverlapStack, BatchOverlapWarning
from tests.workers_drift import SimulatedClock
from tests.workers_overlap import with_and_without


def _same(plain: dict, got: dict, rtol: float, atol: float) -> None:
    torch.testing.assert_close(got["logits"], plain["logits"], rtol=rtol, atol=atol)
    torch.testing.assert_close(got["loss"], plain["loss"], rtol=rtol, atol=atol)
    if plain["aux"] is not None:  # Hugging Face computes it in float32 whatever the model's
        # dtype; the two micro-batches' router logits are concatenated in another order
        torch.testing.assert_close(got["aux"], plain["aux"], rtol=max(rtol, 1e-6), atol=0)
    assert len(got["router_logits"]) == len(plain["router_logits"])  # one per layer, whole batch
    for mine, theirs in zip(got["router_logits"], plain["router_logits"]):
        torch.testing.assert_close(mine, theirs, rtol=rtol, atol=atol)
    assert got["grads"].keys() == plain["grads"].keys()
    for name, grad in plain["grads"].items():  # atol of each gradient's own scale: some are
        # ~1e-6 in float32, where a fixed 1e-6 passed a third of their size
        scale = float(grad.abs().max())
        torch.testing.assert_close(got["grads"][name], grad, rtol=rtol, atol=atol * scale,
                                   msg=name)


def _weight_grads_wait_for_the_other(order: list[tuple[str, int]], micro_batches: int) -> None:
    """The backward's first call leaves part of its weight gradients until the other
    micro-batch's experts have run (and issued their combine): they do not delay it."""
    first = order[0][1]
    second = next(label for name, label in order if name == "experts" and label != first)
    before = order[:order.index(("experts", second))]
    assert 0 < before.count(("experts", first)) and \
        before.count(("deferred", first)) < micro_batches, order


@pytest.mark.parametrize("dtype,hostile,options,stack,tol", [
    ("float64", False, {}, {}, 1e-12),
    # everything to experts 0 and 1
    ("float64", True, {}, {"checkpointing": True}, 1e-12),
    ("float32", False, {"wire_dtype": "bf16", "shared": None}, {"sync": True}, 1e-6),
    ("float64", False, {"hierarchy": "2d"}, {"world": 4, "nodes": 2}, 1e-12),
    ("float64", False, {}, {"kind": "Qwen2Moe"}, 1e-12),
    ("float64", True, {"dedup": True}, {}, 1e-12),
    # fixed slabs, no host read: raised AttributeError under batch overlap before capacity's
    # steps became the one pass body's
    ("float64", False, {"capacity": 256}, {}, 1e-12),
    ("float64", True, {"capacity": 256}, {"checkpointing": True}, 1e-12),
], ids=["float64", "one-expert+checkpointing", "float32+bf16-wire+gradient-sync",
        "2d-on-2-nodes", "qwen2-moe-gated-shared-expert", "one-expert+dedup", "capacity",
        "one-expert+capacity+checkpointing"])
def test_batch_overlap_equals_the_plain_model(dtype, hostile, options, stack, tol) -> None:
    options = {k: v for k, v in options.items() if k != "shared"}
    world = stack.get("world", 2)
    results = mc2.run_local(with_and_without, world, args=(dtype, hostile, options, stack),
                            timeout_s=120)
    for r in results:
        assert r["chosen"] is True
        # every micro-batch of every call traced
        assert r["overlapped"]["labels"] == [0, 1]
        assert -1 in r["plain"]["labels"]  # planning spans of plain calls carry no label
        _same(r["plain"], r["overlapped"], rtol=tol, atol=tol)
        _weight_grads_wait_for_the_other(r["overlapped"]["backward_order"], micro_batches=2)
        plain, split = r["prefill"]  # no grad, with a KV cache, then a decoding step on it
        for name in ("logits", "cache", "decode", "hidden"):
            torch.testing.assert_close(split[name], plain[name], rtol=tol, atol=tol, msg=name)


def _stack(overlap: bool | str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [Block() for _ in range(2)]
    if overlap is False:
        return torch.nn.Sequential(*layers)
    return BatchOverlapStack(layers, batch_overlap=overlap, min_tokens=1)


class Block(torch.nn.Module):
    """A decoder-layer stand-in with a forward_staged (BatchOverlapStack's protocol)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = torch.nn.Linear(16, 16, dtype=torch.float64)
        self.moe = mc2.MoELayer(16, 24, 4, topk=2, shared_experts=1, dtype=torch.float64)
        self.moe.reset_parameters(std=0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + torch.tanh(self.mix(x))
        return h + self.moe(h)

    def forward_staged(self, x: torch.Tensor):
        h = x + torch.tanh(self.mix(x))
        out = yield self.moe.begin_staged(h)
        return h + out


def test_a_stack_of_your_own_layers_in_one_process() -> None:
    x = torch.randn(5, 6, 16, dtype=torch.float64, requires_grad=True)  # 5 sequences
    plain, staged = _stack(False), _stack(True)
    a, b = plain(x), staged(x)
    torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    a.pow(2).sum().backward()
    grad_plain = x.grad.clone()
    x.grad = None
    b.pow(2).sum().backward()
    # relative to each gradient's norm: the two micro-batches sum the same terms in another
    # order, and elements that cancel to near zero carry that rounding (~1e-16 of the terms)
    pairs = [("x", x.grad, grad_plain)] + [
        (name, q.grad, p.grad) for (name, p), q in zip(plain.named_parameters(),
                                                       staged.parameters())]
    for name, got, want in pairs:
        assert float((got - want).norm() / want.norm()) <= 1e-12, name


def test_it_turns_itself_off_and_says_so_once() -> None:
    import warnings

    from mc2.engine.decide import batch_split as bo
    from mc2.observation.once import forget

    forget()
    decision = bo.BatchOverlapDecision(True, min_tokens=64)
    with pytest.warns(bo.BatchOverlapWarning, match="fewer than 2 sequences"):
        assert not decision.wanted(1, 4096)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: no second warning
        assert not decision.wanted(1, 4096)
    with pytest.warns(bo.BatchOverlapWarning, match="fewer than min_tokens=64"):
        assert not decision.wanted(4, 32)
    with pytest.warns(bo.BatchOverlapWarning, match="already holds tokens"):
        assert not decision.wanted(4, 4096, "the KV cache already holds tokens")
    assert decision.wanted(4, 4096)
    with pytest.raises(ValueError, match="True, False or 'auto'"):
        bo.BatchOverlapDecision("sometimes")


@pytest.mark.filterwarnings("ignore:mc2 batch overlap is off:UserWarning")
def test_auto_keeps_the_faster_schedule() -> None:
    from mc2.engine.decide import batch_split as bo
    from mc2.engine.decide.planner import Planner

    cpu = torch.device("cpu")
    planner = Planner()
    decision = planner.batch_overlap("auto", min_tokens=1, trials=2)
    picks = []
    for _ in range(4):
        on = decision.wanted(4, 4096)
        picks.append(on)
        decision.measured(on, 1.0 if on else 2.0)
    assert sorted(picks) == [False, False, True, True]  # both sides measured, alternating
    assert decision.chosen is True
    # on the planner, beside its K decisions: one auto-tuner
    assert planner.batch_overlaps() == [{
        "mode": "auto", "chosen": True, "times": {"on": [1.0, 1.0], "off": [2.0, 2.0]},
        "forward_only": {"chosen": None, "times": {"on": [], "off": []}}}]
    timed = bo.BatchOverlapDecision("auto", min_tokens=1, trials=1)
    sides, warm = [], []
    while timed.chosen is None:  # through timed_forward: one untimed step at each switch
        sides.append(timed.wanted(4, 4096))
        warm.append(timed.warming)
        bo.timed_forward(timed, sides[-1], lambda: torch.zeros(1), cpu)
    assert sides == [True, True, False, False] and warm == [True, False, True, False]
    slower = bo.BatchOverlapDecision("auto", min_tokens=1, trials=1)
    with pytest.warns(bo.BatchOverlapWarning, match="measured slower"):
        for _ in range(2):
            on = slower.wanted(4, 4096)
            slower.measured(on, 2.0 if on else 1.0)
    assert slower.chosen is False and not slower.wanted(4, 4096)


# a host clock whose time passes only when told: the decision's measurements then depend on
# what the test sets, never on how loaded the machine is (the sleeps this test used failed
# once in a fresh clone's run under load)
_CLOCK = SimulatedClock()


class _SlowBackward(torch.autograd.Function):
    """The identity, whose backward takes ``seconds`` of :data:`_CLOCK`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:  # type: ignore[override]
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        _CLOCK.advance(ctx.seconds)
        return grad, None


class _Lopsided(Block):
    """Batch overlap's forward slower (0.03 s of :data:`_CLOCK`), the plain backward much
    slower (0.15 s): only a measure of forward and backward together finds batch overlap
    faster."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowBackward.apply(super().forward(x), 0.15)

    def forward_staged(self, x: torch.Tensor):
        _CLOCK.advance(0.03)
        return (yield from super().forward_staged(x))


def test_auto_times_the_backward_through_the_layers_too(monkeypatch) -> None:
    import mc2.engine.decide.batch_split as batch_split
    from mc2.engine.decide.batch_split import BatchOverlapDecision as Decision

    monkeypatch.setattr(batch_split, "clock_for", lambda device: _CLOCK)
    torch.manual_seed(0)
    stack = BatchOverlapStack([_Lopsided()], min_tokens=1)
    x = torch.randn(4, 6, 16, dtype=torch.float64, requires_grad=True)
    for warm_up in (True, False):  # first calls of either path, outside the measure
        stack.decision = Decision(warm_up, min_tokens=1)
        stack(x).sum().backward()
    stack.decision = Decision("auto", min_tokens=1, trials=1)
    for _ in range(4):  # one step each way, each after an untimed one
        stack(x).sum().backward()
    assert stack.decision.chosen is True, stack.decision.times
    assert min(stack.decision.times[False]) >= 0.15  # the plain backward was in the measure
    assert not x._backward_hooks  # the trials' timing hooks went with their backwards
    with torch.no_grad(), pytest.warns(BatchOverlapWarning, match="measured slower"):
        for _ in range(4):  # no backward follows: forwards alone decide for forwards alone
            stack(x)
        assert stack.decision.chosen is False
    # and never for a training step: that one stays what forward and backward measured
    assert stack.decision.chosen is True
    assert stack.decision.report()["forward_only"]["chosen"] is False


def test_a_capacity_mode_step_reads_nothing_from_the_device_batch_overlap_included() -> None:
    """Capacity mode runs with no host read; batch overlap's decision, agreed at every
    forward, agrees in host memory (on a Gloo group), so a step with it reads nothing either
    (it read its agreed flag back from the device at every forward)."""
    from tests.workers_overlap import capacity_step_reads

    for found in mc2.run_local(capacity_step_reads, 2, timeout_s=120):
        for name in ("in-layer", "batch overlap", "auto"):
            assert found[name]["reads"] == 0, (name, found[name]["where"])
        assert found["batch overlap"]["chosen"] is True
        assert found["auto"]["chosen"] in (True, False)


class _CapacityBlock(torch.nn.Module):
    """A residual MoE layer in capacity mode that drops what does not fit."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.moe = mc2.MoELayer(16, 24, 4, topk=2, dtype=torch.float64, micro_batches=1,
                                capacity=capacity, overflow="drop")
        self.moe.reset_parameters(std=0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(x)

    def forward_staged(self, x: torch.Tensor):
        out = yield self.moe.begin_staged(x)
        return x + out


def capacity_stack(rank: int, world: int, capacity: int) -> dict:
    """The plain stack and batch overlap's (``True``), each dropping what does not fit:
    outputs and rows dropped."""
    from mc2.engine.decide.capacity import dropped_rows

    x = torch.randn(4, 4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    found = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        layers = [_CapacityBlock(capacity) for _ in range(2)]
        stack = torch.nn.Sequential(*layers) if overlap is False else \
            BatchOverlapStack(layers, batch_overlap=True, min_tokens=1)
        before = int(dropped_rows())
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "runs unsplit", said once
            found[overlap] = stack(x)
        found[overlap, "dropped"] = int(dropped_rows()) - before
    return found


def test_capacity_mode_that_drops_runs_the_layers_unsplit() -> None:
    """Which rows fit a capacity call's slabs depends on each call's tokens: split, 0 rows
    dropped where unsplit dropped 12 and 10, outputs up to 11.9 apart, and ``"auto"`` chose
    between them by timing (found by a review). Where the tokens exceed a call's capacity
    the forward runs unsplit, said once: outputs bitwise, the same rows dropped."""
    for r in mc2.run_local(capacity_stack, 2, args=(10,), timeout_s=120):
        assert r[False, "dropped"] > 0 and r[True, "dropped"] == r[False, "dropped"], r
        assert torch.equal(r[True], r[False])


def test_the_capacity_scan_reads_only_mc2s_own_attributes() -> None:
    """A module of the user's whose ``config`` property raises is not mc2's to read (the scan
    took any ``config`` and failed every forward there); an MoELayer in capacity mode under
    more tokens than its capacity is found, under fewer it is not."""
    from mc2.integrations.layer_loop import capacity_problem

    class Lazy(torch.nn.Module):
        @property
        def config(self) -> None:
            raise RuntimeError("not ready")

    layer = torch.nn.Sequential(Lazy(), mc2.MoELayer(8, 12, 2, topk=1, capacity=4))
    assert capacity_problem([Lazy()], 64) is None
    assert "capacity=4" in capacity_problem([layer], 8) and capacity_problem([layer], 4) is None


def modes_differ(rank: int, world: int) -> dict:
    """Batch overlap ``True`` on rank 0, ``"auto"`` on rank 1: the error each rank raises,
    then a plain forward of the same layers (the group must still work)."""
    torch.manual_seed(0)
    layers = [_CapacityBlock(64) for _ in range(2)]
    stack = BatchOverlapStack(layers, batch_overlap=True if rank == 0 else "auto", min_tokens=1)
    x = torch.randn(4, 4, 16, dtype=torch.float64)
    error = None
    try:
        stack(x)
    except ValueError as exc:
        error = str(exc)
    return {"error": error, "after": tuple(torch.nn.Sequential(*layers)(x).shape)}


def test_ranks_with_different_modes_raise_on_every_rank() -> None:
    """``True`` on one rank and ``"auto"`` on another agreed whether to split, then split
    different forwards (the ``"auto"`` rank's plain trial against a split: the collectives
    of different calls met). The mode rides in the agreement every forward makes: a
    ``ValueError`` on every rank, naming both."""
    for rank, r in enumerate(mc2.run_local(modes_differ, 2, timeout_s=20, deadline_s=60)):
        assert r["error"] is not None and "disagree on its mode" in r["error"], (rank, r)
        assert "True" in r["error"] and "'auto'" in r["error"], r["error"]
        assert r["after"] == (4, 4, 16)
