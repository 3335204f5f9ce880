"""Functions run inside each rank of a local world (module level, so spawn can import them)."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

import mc2
from tests.problems import Problem


def run_cases(rank: int, world: int, cases: list[tuple[Problem, dict[str, Any]]]) -> list[dict]:
    """Forward + backward of each (problem, fused_expert options); returns outputs and grads."""
    results = []
    for problem, options in cases:
        options = dict(options)
        packed = options.pop("layout", "split") == "packed"
        x = problem.xs[rank].clone().requires_grad_(True)
        rw = problem.rws[rank].clone().requires_grad_(True)
        if packed:
            up, gate, down = problem.local_weights(rank)
            ffn = up.shape[-1]
            gate_up = torch.cat([gate.transpose(1, 2), up.transpose(1, 2)], 1).requires_grad_(True)
            down_t = down.transpose(1, 2).contiguous().requires_grad_(True)
            out = mc2.fused_expert_packed(x, gate_up, down_t, problem.ids[rank], rw, **options)
            out.backward(problem.grad_outs[rank])
            g = gate_up.grad
            grads = [g[:, ffn:].transpose(1, 2), g[:, :ffn].transpose(1, 2),
                     down_t.grad.transpose(1, 2)]
        else:
            weights = [w.clone().requires_grad_(True) for w in problem.local_weights(rank)]
            out = mc2.fused_expert(x, *weights, problem.ids[rank], rw, **options)
            out.backward(problem.grad_outs[rank])
            grads = [w.grad for w in weights]
        results.append({"out": out.detach(), "x": x.grad, "rw": rw.grad, "w": grads})
    return results


def bad_input_then_good(rank: int, world: int, culprit: int, bad: str) -> dict:
    """Only ``culprit`` passes a bad argument; every rank must raise, then the group still works."""
    from tests.problems import make_problem

    p = make_problem(world, "uniform")
    x, ids, rw = p.xs[rank], p.ids[rank], p.rws[rank]
    w_up, w_gate, w_down = p.local_weights(rank)
    # "..._capacity": every rank in capacity mode, the culprit's input bad as named
    kwargs: dict[str, Any] = {"capacity": 48} if bad.endswith("_capacity") else {}
    if rank == culprit:
        if bad == "expert_out_of_range":
            ids = ids.clone()
            ids[0, 0] = p.w_up.shape[0]
        elif bad == "negative_expert":
            ids = ids.clone()
            ids[-1, -1] = -2  # -1 is no expert (a dropped slot); below it is bad
        elif bad == "hidden_mismatch":
            x = torch.randn(x.shape[0], x.shape[1] + 1, dtype=x.dtype)
        elif bad == "weight_dtype":
            w_up = w_up.float()
        elif bad == "ids_dtype":
            ids = ids.float()
        elif bad == "ids_shape":
            ids = ids[:-1]
        elif bad == "num_experts":
            kwargs["num_experts"] = p.w_up.shape[0] + 1
        elif bad == "local_experts_differ":
            w_up, w_gate, w_down = w_up[:1], w_gate[:1], w_down[:1]
            ids = ids % world  # valid ids for one expert per rank: only the counts disagree
        elif bad == "micro_batches_differ":
            kwargs["micro_batches"] = 3
        elif bad == "micro_batches_zero":
            kwargs["micro_batches"] = 0
        elif bad == "wire_dtype_differ":
            kwargs["wire_dtype"] = torch.bfloat16
        elif bad == "wire_dtype_unsupported":
            kwargs["wire_dtype"] = torch.int32
        elif bad == "wire_block":
            kwargs.update(wire_dtype="int8", wire_block=5)  # hidden is 16
        elif bad == "gemm_unknown":
            kwargs["gemm"] = "fastest"
        elif bad in ("topk_zero", "topk_zero_capacity"):
            ids, rw = ids[:, :0], rw[:, :0]
        elif bad == "ids_device":
            ids = ids.to("meta")
        elif bad == "weights_device":
            rw = rw.to("meta")
        else:
            raise AssertionError(bad)
    start = time.monotonic()
    error = None
    try:
        mc2.fused_expert(x, w_up, w_gate, w_down, ids, rw, **kwargs)
    except ValueError as exc:
        error = str(exc)
    elapsed = time.monotonic() - start
    # the group must still be usable afterwards
    good_w = p.local_weights(rank)
    out = mc2.fused_expert(p.xs[rank], *good_w, p.ids[rank], p.rws[rank], micro_batches=2)
    dist.barrier()
    return {"error": error, "elapsed": elapsed, "good_rows": out.shape[0]}


def timeline_spans(rank: int, world: int, micro_batches: int, tokens: int = 13) -> list[tuple]:
    """One overlapped forward+backward with a Timeline; returns the spans as tuples."""
    from tests.problems import make_problem

    p = make_problem(world, "uniform", tokens=tokens)
    tl = mc2.Timeline()
    x = p.xs[rank].clone().requires_grad_(True)
    out = mc2.fused_expert(x, *p.local_weights(rank), p.ids[rank], p.rws[rank],
                           micro_batches=micro_batches, timeline=tl)
    out.backward(p.grad_outs[rank])
    return [(s.kind, s.name, s.phase, s.micro_batch, s.start, s.end) for s in tl.spans]


def gradient_mode_differs(rank: int, world: int) -> str | None:
    """Rank 1 runs without gradients while rank 0 needs them: a backward would hang, so raise."""
    from tests.problems import make_problem

    p = make_problem(world, "uniform")
    x = p.xs[rank].clone().requires_grad_(True)
    try:
        with torch.set_grad_enabled(rank == 0):
            mc2.fused_expert(x, *p.local_weights(rank), p.ids[rank], p.rws[rank])
    except ValueError as exc:
        return str(exc)
    return None


def peer_leaves_early(rank: int, world: int) -> None:
    """Rank 1 quits without taking part; rank 0's collective must fail, not freeze."""
    from tests.problems import make_problem

    if rank == 1:
        return None
    p = make_problem(world, "uniform")
    mc2.fused_expert(p.xs[rank], *p.local_weights(rank), p.ids[rank], p.rws[rank])
    return None


def raise_on_rank(rank: int, world: int, culprit: int) -> int:
    if rank == culprit:
        raise RuntimeError(f"planted failure on rank {rank}")
    return rank


def profiled_step(rank: int, world: int, micro_batches: int, overlap: bool) -> list:
    """One forward+backward inside ``mc2.profile()`` with a marked step; all ranks' spans."""
    from tests.problems import make_problem

    p = make_problem(world, "uniform")
    x = p.xs[rank].clone().requires_grad_(True)
    with mc2.profile() as prof:
        with prof.step():
            out = mc2.fused_expert(x, *p.local_weights(rank), p.ids[rank], p.rws[rank],
                                   micro_batches=micro_batches, overlap=overlap)
            out.backward(p.grad_outs[rank])
    # outside the block nothing is recorded any more
    mc2.fused_expert(p.xs[rank], *p.local_weights(rank), p.ids[rank], p.rws[rank])
    return prof.gather()


def auto_choice(rank: int, world: int, tokens: list[int], hidden: int, ffn: int) -> dict:
    """``micro_batches="auto"`` with different local token counts: the K each rank used."""
    g = torch.Generator().manual_seed(rank)
    local = 2
    x = torch.randn(tokens[rank], hidden, generator=g)
    ids = torch.randint(0, world * local, (tokens[rank], 2), generator=g)
    ws = [torch.randn(local, hidden, ffn, generator=g) * 0.05,
          torch.randn(local, hidden, ffn, generator=g) * 0.05,
          torch.randn(local, ffn, hidden, generator=g) * 0.05]
    planner = mc2.Planner()
    tl = mc2.Timeline()
    out = mc2.fused_expert(x.requires_grad_(True), *ws, ids, micro_batches="auto",
                           planner=planner, timeline=tl)
    out.sum().backward()
    used = 1 + max((s.micro_batch for s in tl.spans), default=0)
    weights = mc2.engine.compute.experts.ExpertWeights.split_of(*ws)
    cal = planner.calibration(weights, None)  # measured (together) or the call's own
    work = planner.workload(max(tokens), 2, weights, None)
    return {"used": used, "calibration": cal,
            "predicted": {k: mc2.engine.decide.planner.predict(cal, work, k).step_s
                          for k in (1, 2, 4, 8, 16)}}


class CalibratedPlanner(mc2.Planner):
    """A planner whose calibrations are given, not measured: a test of what the planner
    decides from its cost model stays deterministic on a loaded machine, where a measured
    calibration can land on either side of the model's margin."""

    def __init__(self, calibration: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.given = calibration

    def _measure(self, *args: Any, **kwargs: Any) -> Any:
        return self.given


def auto_decode(rank: int, world: int, tokens: int, calls: int, hidden: int, ffn: int,
                decided: bool = True, calibration: Any = None) -> dict:
    """``"auto"`` over ``calls`` no-grad calls, then ``calls`` forward + backward calls, of a
    decode-sized batch: the K each call ran and its trial marks (from the timeline), the
    planner's decision (``decided``: it made one; else ``None`` where it made none), and
    whether every output equals a fixed K = 1 call's. ``calibration``: given to the planner
    instead of measured (:class:`CalibratedPlanner`)."""
    g = torch.Generator().manual_seed(rank)
    local = 2
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.randint(0, world * local, (tokens, 2), generator=g)
    ws = [torch.randn(local, hidden, ffn, generator=g) * 0.05,
          torch.randn(local, hidden, ffn, generator=g) * 0.05,
          torch.randn(local, ffn, hidden, generator=g) * 0.05]
    planner = mc2.Planner() if calibration is None else CalibratedPlanner(calibration)
    used, marks, equal = [], [], True
    expected = mc2.fused_expert(x, *ws, ids, micro_batches=1)
    for n in range(2 * calls):
        out, tl = _timed_auto_call(x, ws, ids, planner, trained=n >= calls)
        used.append(1 + max((s.micro_batch for s in tl.spans), default=0))
        marks.append([s.name for s in tl.spans if s.name.startswith("auto")])
        equal = equal and torch.equal(out.detach(), expected)
    decisions = list(planner.decisions().values())
    decision = decisions[0] if decided else (decisions or None)
    return {"used": used, "marks": marks, "decision": decision, "equal": equal,
            "margin": planner.model_error(None).margin()}


def run_with_shared(rank: int, world: int, problem: Problem, shared: list, k: int,
                    wire_dtype: Any = None) -> dict:
    """fused_expert with shared experts (same weights on every rank) on rank's tokens."""
    x = problem.xs[rank].clone().requires_grad_(True)
    ws = [w.clone().requires_grad_(True) for w in problem.local_weights(rank)]
    ss = [t.clone().requires_grad_(True) for t in shared]
    out = mc2.fused_expert(x, *ws, problem.ids[rank], problem.rws[rank], micro_batches=k,
                           shared_up=ss[0], shared_gate=ss[1], shared_down=ss[2],
                           wire_dtype=wire_dtype, wire_block=8)
    out.backward(problem.grad_outs[rank])
    return {"out": out.detach(), "x": x.grad, "shared": [t.grad for t in ss]}


def layer_roundtrip(rank: int, world: int, source: dict | str, x: torch.Tensor, shared: int,
                    save_to: str | None = None, on_mesh: bool = False) -> dict:
    """Load a MoELayer at this EP size (an unsharded state in memory, or a checkpoint folder),
    run it on this rank's tokens, and save it again if asked. ``on_mesh``: the layer takes a
    ``("dp", "ep")`` mesh with ``ep`` = the world instead of the default group."""
    import mc2.parallel.checkpoint

    mesh = mc2.expert_parallel_mesh(world) if on_mesh else None
    layer = mc2.MoELayer(16, 24, 8, topk=2, shared_experts=shared, dtype=torch.float64,
                         micro_batches=2, mesh=mesh)
    if isinstance(source, dict):
        mc2.load_full_state_dict(layer, source)
    else:
        mc2.parallel.checkpoint.load(layer, source)
    if save_to is not None:
        mc2.parallel.checkpoint.save(layer, save_to)
    mine = x.chunk(world)[rank]
    out, losses = layer(mine, return_losses=True)
    (out.pow(2).sum() + losses.load_balancing + losses.z_loss).backward()
    return {"out": out.detach(), "local_keys": sorted(layer.state_dict()),
            "local_experts": layer.expert_index.tolist(),
            "w_gate_up": layer.w_gate_up.detach().clone(),
            "w_gate_up_grad": layer.w_gate_up.grad, "gate_grad": layer.gate.weight.grad,
            "losses": (losses.load_balancing.item(), losses.z_loss.item())}


def forced_sync(rank: int, world: int) -> dict:
    """MC2_FORCE_SYNC=1: same numbers, a warning, the timeline marked, no async transfers."""
    import os
    import warnings

    from tests.problems import make_problem

    os.environ["MC2_FORCE_SYNC"] = "1"
    p = make_problem(world, "uniform")
    with mc2.profile() as prof, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = mc2.fused_expert(p.xs[rank], *p.local_weights(rank), p.ids[rank], p.rws[rank],
                               micro_batches=3, overlap=True)
    del os.environ["MC2_FORCE_SYNC"]
    kinds = {s.kind for s in prof.spans}
    return {"out": out, "warned": [str(w.message) for w in caught
                                   if issubclass(w.category, mc2.engine.transport.env.SyncFallbackWarning)],
            "fallback": prof.sync_fallback, "kinds": kinds}


def topology_of(rank: int, world: int, local_world: int) -> dict:
    """Discover a (pretend) multi-node layout and use its sub-groups once."""
    import os

    os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
    topo = mc2.engine.transport.topology.discover()
    intra, inter = topo.subgroups()
    a = torch.tensor([float(rank)])
    b = torch.tensor([float(rank)])
    dist.all_reduce(a, group=intra)
    dist.all_reduce(b, group=inter)
    return {"nodes": topo.nodes, "node": topo.node, "local": topo.local_rank,
            "intra_sum": a.item(), "inter_sum": b.item(), "text": topo.describe()}


def run_cases_as_nodes(rank: int, world: int, local_world: int,
                       cases: list[tuple[Problem, dict[str, Any]]]) -> list[dict]:
    """:func:`run_cases` with the ranks presented as nodes of ``local_world`` ranks each."""
    import os

    os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
    return run_cases(rank, world, cases)


def hierarchy_pair(rank: int, world: int, problem: Problem) -> dict:
    """Flat and 2-D results of one problem (run inside an emulated cluster)."""
    out = {}
    for hierarchy in ("flat", "2d"):
        x = problem.xs[rank].clone().requires_grad_(True)
        o = mc2.fused_expert(x, *problem.local_weights(rank), problem.ids[rank],
                             problem.rws[rank], micro_batches=2, hierarchy=hierarchy)
        o.backward(problem.grad_outs[rank])
        out[hierarchy] = (o.detach(), x.grad)
    return out


def auto_trials(rank: int, world: int, tokens: list[int], calls: int) -> dict:
    """``"auto"`` over several forward+backward calls of one shape: the K each call used."""
    g = torch.Generator().manual_seed(rank)
    local, hidden, ffn = 2, 64, 128
    x = torch.randn(tokens[rank], hidden, generator=g)
    ids = torch.randint(0, world * local, (tokens[rank], 2), generator=g)
    ws = [torch.randn(local, hidden, ffn, generator=g) * 0.05,
          torch.randn(local, hidden, ffn, generator=g) * 0.05,
          torch.randn(local, ffn, hidden, generator=g) * 0.05]
    # the model's ranking fixed (K ascending, every split with a chance): the trials' order is
    # then known whatever this machine's calibration says
    # no drift guard: a slow spell of a loaded machine after the lock would re-plan
    planner = PriorPlanner([1, 2, 4, 8], candidates=(1, 2, 4, 8), explore=3, trials=2, drift=0)
    used, trial_marks, outs = [], [], []
    for _ in range(calls):
        tl = mc2.Timeline()
        out = mc2.fused_expert(x.clone().requires_grad_(True), *ws, ids, micro_batches="auto",
                               planner=planner, timeline=tl)
        out.sum().backward()
        used.append(1 + max((s.micro_batch for s in tl.spans), default=0))
        trial_marks.append([s.name for s in tl.spans if s.name.startswith("auto trial")])
        outs.append(out.detach())
    (decision,) = planner.decisions().values()
    return {"used": used, "trials": trial_marks, "decision": decision, "outs": outs}


class PriorPlanner(mc2.Planner):
    """A planner whose cost model ranks K as given (the prior of a run whose calibration
    came out another way), so which K the first round leaves out is known."""

    def __init__(self, order: list[int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.order = order

    def predictions(self, *, max_tokens: int, **_: Any) -> dict[int, float]:
        # every K this size allows close to K = 1's step (so all have a chance), in order
        return {k: 1.0 + 0.01 * i for i, k in enumerate(self.order)
                if k == 1 or (k in self.candidates and k <= max_tokens)}


def auto_widening(rank: int, world: int, order: list[int], calls: int) -> dict:
    """``"auto"`` with a prior that leaves out the neighbours of whatever wins the first
    round: the K each call used, and this rank's trial times."""
    g = torch.Generator().manual_seed(rank)
    local, hidden, ffn, tokens = 2, 64, 128, 300
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.randint(0, world * local, (tokens, 2), generator=g)
    ws = [torch.randn(local, hidden, ffn, generator=g) * 0.05,
          torch.randn(local, hidden, ffn, generator=g) * 0.05,
          torch.randn(local, ffn, hidden, generator=g) * 0.05]
    planner = PriorPlanner(order, candidates=tuple(sorted(order)), explore=3, trials=2,
                           drift=0)
    used = []
    for _ in range(calls):
        tl = mc2.Timeline()
        mc2.fused_expert(x.clone().requires_grad_(True), *ws, ids, micro_batches="auto",
                         planner=planner, timeline=tl).sum().backward()
        used.append(1 + max((s.micro_batch for s in tl.spans), default=0))
    (decision,) = planner.decisions().values()
    return {"used": used, "decision": decision}


def auto_hierarchy_row_bytes(rank: int, world: int, local_world: int, problem: Problem,
                             wires: list[Any]) -> list[list[int]]:
    """For each wire format in turn, ``hierarchy="auto"``: the row widths (bytes) it measured."""
    import os

    from mc2.engine.transport.group_state import group_state

    os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
    seen = []
    choices = group_state(None).two_stage
    for wire in wires:
        choices.clear()
        mc2.fused_expert(problem.xs[rank], *problem.local_weights(rank), problem.ids[rank],
                         problem.rws[rank], micro_batches=2, hierarchy="auto", wire_dtype=wire,
                         wire_block=8)
        seen.append(sorted({key[-1] for key in choices}))
    return seen


def measurement_after_the_comm_thread(rank: int, world: int, local_world: int) -> list[str]:
    """A 2-D exchange of another call still running on the communication thread (a sleep
    in its place) when ``hierarchy="auto"`` measures a new size: the order in which that
    exchange ended and the measurement's first timed exchange began."""
    import os
    import time

    import mc2.engine.transport.hierarchy as hierarchy
    from mc2.engine.transport.topology import topology_for

    os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
    topo = topology_for(None)
    intra, inter = topo.subgroups(None)
    order: list[str] = []
    barrier = hierarchy.barrier

    def timed_barrier(*args: Any, **kwargs: Any) -> None:
        order.append("measured")
        barrier(*args, **kwargs)

    hierarchy.barrier = timed_barrier
    try:
        hierarchy.comm_worker().submit(
            lambda: (time.sleep(0.5), order.append("exchange in flight ended")))
        hierarchy.two_stage_pays(None, rank=rank, nodes=topo.nodes, per_node=local_world,
                                 intra_group=intra, inter_group=inter, rows_per_rank=64,
                                 row_bytes=32, device=torch.device("cpu"), repeats=1)
    finally:
        hierarchy.barrier = barrier
    return order[:2]


class _FixedPlanner(mc2.Planner):
    """A planner that chooses without measuring (so ranks with different ones still make the
    same collectives up to the counts exchange)."""

    def __init__(self, k: int, candidates: tuple[int, ...] = (1, 2, 4, 8, 16)) -> None:
        super().__init__(candidates=candidates)
        self.k = k

    def choose(self, **_: Any) -> Any:
        from mc2.engine.decide.planner import Choice

        return Choice(self.k)


def planners_disagree(rank: int, world: int, case: str) -> dict:
    """Rank 1's planner chooses another K ("k"), or has other candidates ("candidates"):
    every rank must raise before any row moves, and the group must still work."""
    from tests.problems import make_problem

    p = make_problem(world, "uniform", tokens=24)
    # "fresh capacity": the same in capacity mode, whose steady calls carry no call count
    options = {"capacity": 48} if case == "fresh capacity" else {}
    if case == "k":
        planner = _FixedPlanner(2 if rank == 0 else 4)
    elif case.startswith("fresh"):  # both warm one planner, then rank 1 passes a new one
        planner = mc2.Planner(candidates=(1, 2), repeats=1)
        for _ in range(2):
            mc2.fused_expert(p.xs[rank], *p.local_weights(rank), p.ids[rank], p.rws[rank],
                             micro_batches="auto", planner=planner, **options)
        if rank == 1:
            planner = mc2.Planner(candidates=(1, 2), repeats=1)
    else:
        planner = _FixedPlanner(2, candidates=(1, 2, 4, 8, 16) if rank == 0 else (1, 2))
    error = None
    try:
        mc2.fused_expert(p.xs[rank], *p.local_weights(rank), p.ids[rank], p.rws[rank],
                         micro_batches="auto", planner=planner, **options)
    except ValueError as exc:
        error = str(exc)
    out = mc2.fused_expert(p.xs[rank], *p.local_weights(rank), p.ids[rank], p.rws[rank],
                           micro_batches="auto", planner=_FixedPlanner(3))
    return {"error": error, "good_rows": out.shape[0]}


def count_rows(rank: int, world: int, local_world: int, problem: Problem,
               options: dict[str, Any]) -> dict:
    """One forward under :func:`mc2.count_traffic` (ranks as nodes of ``local_world``)."""
    import os

    os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
    with mc2.count_traffic() as traffic:
        mc2.fused_expert(problem.xs[rank], *problem.local_weights(rank), problem.ids[rank],
                         problem.rws[rank], **options)
    return {"pairs": traffic.pairs, "rows_sent": traffic.rows_sent,
            "node_rows": traffic.node_rows, "row_bytes": traffic.row_bytes}


def limited_layer(rank: int, world: int, state: dict, x: torch.Tensor) -> dict:
    """A node-limited MoELayer (2 groups = the 2 ranks, 1 group per token) with dedup: this
    rank's output, its expert ids and the input gradient."""
    layer = mc2.MoELayer(16, 24, 8, topk=3, expert_groups=2, groups_per_token=1,
                         dtype=torch.float64, micro_batches=2, dedup=True)
    mc2.load_full_state_dict(layer, state)
    mine = x.chunk(world)[rank].clone().requires_grad_(True)
    out = layer(mine)
    out.pow(2).sum().backward()
    return {"out": out.detach(), "ids": layer.route(mine)[0], "grad": mine.grad}


def _raised(fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def capacity_overflow(rank: int, world: int, problem: Problem, capacity: int) -> dict:
    """A capacity call whose slabs are too small, with overflow='raise': what the call itself
    raised, what ``mc2.check_overflow()`` then raised, and a second check; the same overflow
    raised by the next normal call's handshake instead, and a normal call after it; then with
    overflow='drop' (output, gradients, the count, a check that stays quiet), and one that
    fits. Counts the device assertions made on the way."""
    from mc2.engine.decide.capacity import dropped_rows

    asserts = []
    real_assert = torch._assert_async
    torch._assert_async = lambda *a, **k: (asserts.append(a), real_assert(*a, **k))[1]
    args = (problem.xs[rank], *problem.local_weights(rank), problem.ids[rank], problem.rws[rank])
    out: dict[str, Any] = {}
    import mc2.engine.passes.travel.slabs as capacity_pass

    out["raised_at_once"] = _raised(lambda: mc2.fused_expert(*args, micro_batches=1,
                                                             capacity=capacity))  # on a CPU
    out["after_at_once"] = _raised(mc2.check_overflow)
    capacity_pass.raises_at_once = lambda device: False  # as on an accelerator
    out["raised_in_call"] = _raised(lambda: mc2.fused_expert(*args, micro_batches=1,
                                                             capacity=capacity))
    out["raised"] = _raised(mc2.check_overflow)
    out["raised_again"] = _raised(mc2.check_overflow)
    mc2.fused_expert(*args, micro_batches=1, capacity=capacity)
    out["raised_by_next_call"] = _raised(lambda: mc2.fused_expert(*args, micro_batches=1))
    out["next_call_after"] = _raised(lambda: mc2.fused_expert(*args, micro_batches=1))
    x = problem.xs[rank].clone().requires_grad_(True)
    got = mc2.fused_expert(x, *args[1:], micro_batches=1, capacity=capacity, overflow="drop")
    got.backward(problem.grad_outs[rank])
    out.update(out=got.detach(), x=x.grad, dropped=int(dropped_rows()))
    out["raised_after_drop"] = _raised(mc2.check_overflow)
    fits = mc2.fused_expert(*args, micro_batches=1, capacity=max(len(t) for t in problem.xs))
    out["fits"] = fits
    out["device_asserts"] = len(asserts)
    torch._assert_async = real_assert
    return out


def capacity_collectives(rank: int, world: int, problem: Problem) -> dict:
    """The collectives and host syncs of a no-grad capacity call of a few tokens."""
    from mc2.observation.host_syncs import HostSyncCounter
    from tests.workers_recompute import CollectiveCounter

    args = (problem.xs[rank], *problem.local_weights(rank), problem.ids[rank], problem.rws[rank])
    with torch.no_grad():
        mc2.fused_expert(*args, micro_batches=1, capacity=8)  # groups made, caches warm
        counter, syncs = CollectiveCounter(), HostSyncCounter()
        try:
            with syncs:
                mc2.fused_expert(*args, micro_batches=1, capacity=8)
        finally:
            counter.close()
        mc2.fused_expert(*args, micro_batches=1)  # its control group made
        plain, plain_syncs = CollectiveCounter(), HostSyncCounter()
        try:
            with plain_syncs:
                mc2.fused_expert(*args, micro_batches=1)
        finally:
            plain.close()
    return {"collectives": counter.count, "reads": syncs.reads, "uploads": syncs.uploads,
            "plain_collectives": plain.count, "plain_reads": plain_syncs.reads}


def initialised_ranks(rank: int, world: int) -> list[bool]:
    """Which ranks had made their process group when this rank's function began, read from
    the world's store (``mc2.tools.launch`` marks each rank there after its init)."""
    import os
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=timedelta(seconds=30))
    return [store.check([f"mc2/initialised/{r}"]) for r in range(world)]


def _timed_auto_call(x: torch.Tensor, ws: list, ids: torch.Tensor, planner: Any,
                     trained: bool) -> tuple[torch.Tensor, Any]:
    """One ``"auto"`` call with a timeline, and its backward where ``trained``."""
    tl = mc2.Timeline()
    with torch.set_grad_enabled(trained):
        out = mc2.fused_expert(x.clone().requires_grad_(trained), *ws, ids,
                               micro_batches="auto", planner=planner, timeline=tl)
        if trained:
            out.sum().backward()
    return out, tl


def _auto_shape(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, list, Any]:
    """One ``"auto"`` shape whose splits all have trials (the prior ranks K ascending): this
    rank's tokens, ids, weights and the planner."""
    g = torch.Generator().manual_seed(rank)
    local, hidden, ffn, tokens = 2, 64, 128, 300
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.randint(0, world * local, (tokens, 2), generator=g)
    ws = [torch.randn(local, hidden, ffn, generator=g) * 0.05 for _ in range(2)] + \
        [torch.randn(local, ffn, hidden, generator=g) * 0.05]
    planner = PriorPlanner([1, 2, 4, 8], candidates=(1, 2, 4, 8), explore=3, trials=2, drift=0)
    return x, ids, ws, planner


def auto_by_kind(rank: int, world: int, calls: int) -> dict:
    """Forwards alone (no gradient) of one shape until ``"auto"`` locks them, then training
    calls of the same shape: the K each training call used and whether it was a trial."""
    x, ids, ws, planner = _auto_shape(rank, world)

    def call(trained: bool) -> list[str]:
        _, tl = _timed_auto_call(x, ws, ids, planner, trained)
        return [s.name for s in tl.spans if s.name.startswith("auto trial")]

    for _ in range(planner.max_trial_calls + 1):
        call(False)
        if planner.settled():
            break
    locked_alone = planner.settled()
    training = [call(True) for _ in range(calls)]
    kinds = {key[-1]: d["locked"] for key, d in planner.decisions().items()}
    return {"locked_alone": locked_alone, "training_trials": training, "kinds": kinds}


def auto_recompute_beside_an_evaluation(rank: int, world: int, steps: int) -> dict:
    """``"auto"`` trials under non-reentrant activation checkpointing, where a forward alone
    of the same shape (an evaluation) runs between each training forward and its backward,
    one call ahead in its own trials: the K each training forward and its recompute ran,
    and the first error."""
    from torch.utils.checkpoint import checkpoint

    x, ids, ws, planner = _auto_shape(rank, world)

    def experts(h: torch.Tensor) -> torch.Tensor:
        return mc2.fused_expert(h, *ws, ids, micro_batches="auto", planner=planner)

    with torch.no_grad():
        experts(x)  # the evaluation's trials one call ahead of training's
    error = None
    try:
        for _ in range(steps):
            out = checkpoint(experts, x.clone().requires_grad_(True), use_reentrant=False)
            with torch.no_grad():
                experts(x)
            out.sum().backward()
    except Exception as exc:  # noqa: BLE001 - the test reports whatever ended the loop
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error}
