"""Input checks that fail on every rank together, never leaving a peer inside a collective.

Each rank first checks its own arguments locally (:func:`local_problem`: types, shapes, dtypes,
devices, options; nothing that reads a tensor's values), then all ranks take part in one small
``all_reduce`` (:func:`agree`, the handshake) that carries an error flag together with the values
every rank must share (micro-batch request, hidden size, expert count, dtype, device type,
overlap flag, whether gradients are needed, ...) and the checks that need the data itself,
computed on the device: the range of the expert ids and, with ``check_finite=True``, whether
any token holds NaN or Inf. If any rank found a problem, or the ranks disagree, *every* rank
raises ``ValueError`` before the first data collective is issued. The same reduction also yields
the global maximum token count and top-k that ``micro_batches="auto"`` plans with, so all ranks
agree on K without a second message.

The handshake costs the call one upload of host integers and one device-to-host read
(:mod:`mc2.engine.transport.host`); only its error path reads more, to say which rank and which row.
Its vector also carries the group's capacity-mode error counts (:mod:`mc2.engine.decide.overflow`,
kept on the device by calls that read nothing): where they are not zero every rank raises
:class:`~mc2.engine.decide.overflow.CapacityOverflow` here, at no read of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from mc2.engine.decide.config import HIERARCHIES
from mc2.engine.decide.overflow import COUNTS, pending, raise_counted
from mc2.engine.decide.shared_facts import SharedFacts
from mc2.engine.transport.comm import all_reduce_max_later, gather_objects, group_rank, group_size
from mc2.engine.transport.host import host_vector, read, read_host_memory, upload

DTYPE_CODES = {torch.float64: 1, torch.float32: 2, torch.bfloat16: 3, torch.float16: 4}


def _is_tensor(name: str, t: Any) -> str | None:
    return None if isinstance(t, Tensor) else f"{name} must be a torch.Tensor, got {type(t).__name__}"


def _weights_problem(x: Any, weights: dict[str, Any], packed: bool) -> str | None:
    """What is wrong with the expert weights (either layout, see
    :mod:`mc2.engine.compute.experts`), or ``None``."""
    for name, w in weights.items():
        if (msg := _is_tensor(name, w)) is not None:
            return msg
    hidden = x.shape[-1]
    for name, w in weights.items():
        if w.dtype != x.dtype:
            return f"{name} must have x's dtype {x.dtype}, got {w.dtype}"
        if w.device != x.device:
            return f"{name} must be on x's device {x.device}, got {w.device}"
        if w.dim() != 3:
            return f"{name} must be 3-D [local_experts, ...], got shape {tuple(w.shape)}"
    if packed:
        gate_up, down = weights["weights_gate_up"], weights["weights_down"]
        local, two_f, h = gate_up.shape
        if local < 1:
            return "weights_gate_up holds no expert (local_experts == 0); every rank needs one"
        if h != hidden or two_f % 2:
            return (f"weights_gate_up must be [local_experts, 2 * ffn, {hidden}] to match x, got "
                    f"{tuple(gate_up.shape)}")
        if tuple(down.shape) != (local, hidden, two_f // 2):
            return f"weights_down must be {(local, hidden, two_f // 2)}, got {tuple(down.shape)}"
        return None
    w_up, w_gate, w_down = (weights[k] for k in ("weights_up", "weights_gate", "weights_down"))
    local, h_up, ffn = w_up.shape
    if local < 1:
        return "weights_up holds no expert (local_experts == 0); every rank needs at least one"
    if h_up != hidden:
        return f"weights_up must be [local_experts, {hidden}, ffn] to match x, got {tuple(w_up.shape)}"
    if tuple(w_gate.shape) != tuple(w_up.shape):
        return f"weights_gate must match weights_up {tuple(w_up.shape)}, got {tuple(w_gate.shape)}"
    if tuple(w_down.shape) != (local, ffn, hidden):
        return f"weights_down must be {(local, ffn, hidden)}, got {tuple(w_down.shape)}"
    return None


def local_problem(
    x: Any,
    weights: dict[str, Any],
    expert_ids: Any,
    routing_weights: Any,
    *,
    packed: bool,
    world_size: int,
    num_experts: int | None,
    module: Any = None,
) -> str | None:
    """A human-readable description of what is wrong with this rank's arguments, or ``None``.

    ``weights`` maps argument names to the expert weights: ``weights_up``, ``weights_gate``,
    ``weights_down`` (split layout) or ``weights_gate_up``, ``weights_down`` (``packed``).
    ``module``: the routed experts as a module stage
    (:class:`~mc2.engine.compute.module_experts.ModuleExperts`) instead of ``weights``. Reads no
    tensor's values (the expert-id range is checked in the handshake, on the device).
    """
    if (msg := _is_tensor("x", x)) is not None or (msg := _is_tensor("expert_ids", expert_ids)):
        return msg
    if not x.is_floating_point() or x.dtype not in DTYPE_CODES:
        return f"x must be float64/float32/bfloat16/float16, got {x.dtype}"
    if x.dim() not in (2, 3):
        return f"x must be [batch, seq, hidden] or [tokens, hidden], got shape {tuple(x.shape)}"
    if module is not None:
        if any(p.device != x.device for p in module.params):
            return f"the experts module's parameters must be on x's device {x.device}"
        if (msg := module.problem(x)) is not None:
            return msg
        local = module.local_experts
    elif (msg := _weights_problem(x, weights, packed)) is not None:
        return msg
    else:
        local = weights["weights_down"].shape[0]
    total_experts = world_size * local
    if num_experts is not None and num_experts != total_experts:
        return (f"num_experts={num_experts} does not match the group: {world_size} ranks x "
                f"{local} local experts = {total_experts}")
    if expert_ids.dtype in (torch.bool,) or expert_ids.is_floating_point() or expert_ids.is_complex():
        return f"expert_ids must be an integer tensor, got {expert_ids.dtype}"
    if expert_ids.device != x.device:
        return f"expert_ids must be on x's device {x.device}, got {expert_ids.device}"
    if expert_ids.dim() != x.dim() or tuple(expert_ids.shape[:-1]) != tuple(x.shape[:-1]):
        return (f"expert_ids must be {tuple(x.shape[:-1])} + (topk,) to match x, "
                f"got {tuple(expert_ids.shape)}")
    if expert_ids.shape[-1] < 1:
        return "expert_ids has topk == 0; every token needs at least one expert"
    if routing_weights is not None:
        if (msg := _is_tensor("routing_weights", routing_weights)) is not None:
            return msg
        if not routing_weights.is_floating_point():
            return f"routing_weights must be floating point, got {routing_weights.dtype}"
        if routing_weights.device != x.device:
            return f"routing_weights must be on x's device {x.device}, got {routing_weights.device}"
        if tuple(routing_weights.shape) != tuple(expert_ids.shape):
            return (f"routing_weights must have expert_ids' shape {tuple(expert_ids.shape)}, "
                    f"got {tuple(routing_weights.shape)}")
    return None


NO_EXPERT = -1
"""The expert id of a slot that goes nowhere (a slot a capacity factor dropped): it sends no
row, computes nothing and adds nothing to its token's output; its routing weight's gradient
is zero."""


def range_problem(expert_ids: Tensor, total_experts: int, world_size: int) -> str | None:
    """Where this rank's expert ids leave ``[0, total_experts)`` and are not
    :data:`NO_EXPERT` (the handshake's error path: it reads the ids)."""
    if expert_ids.numel() == 0:
        return None
    lo, hi = int(expert_ids.min()), int(expert_ids.max())
    if lo < NO_EXPERT or hi >= total_experts:
        bad = lo if lo < NO_EXPERT else hi
        return (f"expert id {bad} out of range [0, {total_experts}) "
                f"({world_size} ranks x {total_experts // world_size} local experts; "
                f"{NO_EXPERT}: no expert)")
    return None


def nonfinite_problem(x: Tensor, routing_weights: Tensor | None) -> str | None:
    """``check_finite=True``: where this rank's tokens hold NaN or Inf, or ``None``.

    Without the check a NaN token stays in its own output row in the forward, but in the
    backward it poisons the weight gradients of every expert it visited (a gradient is a sum
    over rows). The check costs one pass over ``x`` on the device and rides on the call's
    handshake (:func:`agree`), so every rank raises together and no collective or read is
    added; this function only words the error, reading the rows.
    """
    for name, t in (("x", x), ("routing_weights", routing_weights)):
        if t is None or t.numel() == 0:
            continue
        bad = ~torch.isfinite(t.reshape(-1, t.shape[-1])).all(-1)
        if bool(bad.any()):
            rows = bad.nonzero().flatten()
            return (f"{name} holds NaN or Inf in {rows.numel()} token row(s), the first is "
                    f"{int(rows[0])} (check_finite=True)")
    return None


def shared_problem(x: Any, s_up: Any, s_gate: Any, s_down: Any, s_scale: Any = None
                   ) -> str | None:
    """What is wrong with the optional shared experts and their per-token scale, or ``None``."""
    given = [t is not None for t in (s_up, s_gate, s_down)]
    if not any(given):
        if s_scale is not None:
            return "shared_scale scales the shared experts' output: pass shared_up/gate/down too"
        return None
    if not all(given):
        return "shared_up, shared_gate and shared_down go together: pass all three or none"
    for name, t in (("shared_up", s_up), ("shared_gate", s_gate), ("shared_down", s_down)):
        if (msg := _is_tensor(name, t)) is not None:
            return msg
        if t.dtype != x.dtype or t.device != x.device or t.dim() != 3:
            return (f"{name} must be a 3-D tensor with x's dtype and device, got "
                    f"{tuple(t.shape)} {t.dtype} on {t.device}")
    n, hidden, ffn = s_up.shape
    if hidden != x.shape[-1] or tuple(s_gate.shape) != tuple(s_up.shape) or \
            tuple(s_down.shape) != (n, ffn, hidden):
        return (f"shared experts must be up/gate [shared, {x.shape[-1]}, ffn] and down "
                f"[shared, ffn, {x.shape[-1]}], got {tuple(s_up.shape)}, {tuple(s_gate.shape)}, "
                f"{tuple(s_down.shape)}")
    return None if s_scale is None else _scale_problem(x, s_scale)


def _scale_problem(x: Tensor, scale: Any) -> str | None:
    """``shared_scale`` must be one factor per token: ``x.shape[:-1] + (1,)`` or ``[T, 1]``."""
    if (msg := _is_tensor("shared_scale", scale)) is not None:
        return msg
    tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    shapes = {tuple(x.shape[:-1]) + (1,), (tokens, 1)}
    if tuple(scale.shape) not in shapes:
        return (f"shared_scale must be one factor per token, {' or '.join(map(str, sorted(shapes)))}"
                f", got {tuple(scale.shape)}")
    if scale.dtype != x.dtype or scale.device != x.device:
        return (f"shared_scale must have x's dtype {x.dtype} and device {x.device}, got "
                f"{scale.dtype} on {scale.device}")
    return None


@dataclass(frozen=True)
class Agreement:
    """What the group agreed on: the largest local token count and top-k (for ``"auto"``)."""

    max_tokens: int
    max_topk: int
    max_rows: int | None = None  # rows once per destination: the most any rank sends
    # every rank's expert ids (``[T_r][topk_r]``, by rank) where every rank's call was small
    # enough to carry them in the handshake (:data:`FOLD_IDS`): its routes are counted here,
    # with no counts exchange; ``None`` otherwise
    folded: list[list[list[int]]] | None = None


HIERARCHY_CODES = {h: i for i, h in enumerate(HIERARCHIES)}
_DEVICE_CODES = {"cpu": 1, "cuda": 2, "xpu": 3, "npu": 4, "mps": 5, "hpu": 6}
_ABSENT = -(2 ** 62)  # the neutral value of a maximum: this rank has nothing for the slot
# A call whose ids fit here on every rank carries them in the handshake: every rank counts the
# routes itself and the counts exchange is not made (a decode-sized call: three collectives,
# not four). Each rank owns a block of the vector (its token count, top-k and ids) and leaves
# the others absent, so the maximum is every rank's block. Not beyond FOLD_WORLD ranks: the
# vector grows with the group, and every call, small or not, reduces it.
FOLD_IDS = 32
FOLD_WORLD = 16


def fold_width(world: int) -> int:
    """The handshake's per-rank blocks, in values (none beyond :data:`FOLD_WORLD` ranks)."""
    return world * (2 + FOLD_IDS) if 1 < world <= FOLD_WORLD else 0


def may_fold(expert_ids: Any, world: int) -> bool:
    """Whether this rank's ids fit its block of the handshake."""
    return 1 < world <= FOLD_WORLD and isinstance(expert_ids, Tensor) and \
        expert_ids.dim() >= 1 and expert_ids.numel() <= FOLD_IDS


def agree(problem: str | None, **kwargs: Any) -> Agreement:
    """:func:`agreement_issued`, waited for at once."""
    return agreement_issued(problem, **kwargs)()


def agreement_issued(
    problem: str | None,
    *,
    x: Any,
    expert_ids: Any,
    routing_weights: Any,
    shared: SharedFacts,
    group: Any,
    total_experts: int = 0,
    check_finite: bool = False,
    rows: Tensor | None = None,
    on_host: bool = False,
    trusted: bool = False,
    fold: bool = False,
) -> Callable[[], Agreement]:
    """One collective, issued now: the returned function waits for it, reads it and raises the
    same ``ValueError`` on every rank if any rank cannot proceed (work done before calling it
    hides the collective's latency: a trusted capacity call plans its slabs meanwhile).

    Args:
        problem: what :func:`local_problem` (and friends) found wrong here, or ``None``.
        shared: values every rank must pass alike, by name (only looked at when valid).
        total_experts: the group's expert count, for the id range check.
        check_finite: also reject NaN or Inf in ``x`` and ``routing_weights``.
        rows: where rows travel once per destination, the number this rank sends (a device
            scalar; the group's largest is agreed in the same collective, for the planner).
        on_host: reduce the vector in host memory (a group with a host backend): what the
            device computed is read first, in one read, and nothing is uploaded. A capacity
            call's handshake runs so, first or steady, so that the two always pair up.
        trusted: a steady capacity call (its configuration agreed before, ``on_host``): the
            facts only, no data check and no error count, so nothing at all is read from a
            device; ranks whose configurations differ still raise here, on every rank
            (:func:`~mc2.engine.decide.call_plan.plan_call`).
        fold: this rank's call may count its routes from every rank's ids (a flat exchange,
            a row per pair, ids that fit :data:`FOLD_IDS`: :func:`may_fold`): its ids go in its
            block, and where every rank's did, :attr:`Agreement.folded` holds them all.

    The vector reduced is named slot by slot (:class:`_Slots`): this rank's facts and their
    negations (one maximum gives both ends), then what only the data shows, computed on the
    device (the expert-id range, non-finite values, the rows once per destination, capacity
    calls' error counts); every value is read back by its name.
    """
    if problem is None:
        alike = {"device type": _DEVICE_CODES.get(x.device.type, 9), **shared.described()}
        facts = {"failed": 0, "tokens": x.numel() // x.shape[-1], "topk": expert_ids.shape[-1],
                 **alike}
        device = x.device
    else:
        alike = {"device type": 0, **SharedFacts.unknown().described()}
        facts = {"failed": 1, "tokens": 0, "topk": 0, **alike}
        device = x.device if isinstance(x, Tensor) else torch.device("cpu")
    world = group_size(group)
    slots = _Slots(list(facts), fold_width(world))
    head = list(facts.values()) + [-v for v in facts.values()]
    if on_host:  # trusted, or a bad input: nothing of this rank's data to add (no read)
        data = _neutral_tail(slots) if trusted or problem is not None else \
            read(_data_tail(x, expert_ids, routing_weights, check_finite, rows, group)) + \
            [_ABSENT] * slots.fold
        reduced = all_reduce_max_later(host_vector(head + data), group, "handshake")
        values = lambda: read_host_memory(reduced())  # noqa: E731
    else:  # the head uploaded (with the neutral tail, for a bad input), the data's appended
        vector = upload(head + _neutral_tail(slots), device) if problem is not None else \
            torch.cat([upload(head, device),
                       _data_tail(x, expert_ids, routing_weights, check_finite, rows, group),
                       _fold_block(expert_ids if fold else None, slots, group, device)])
        reduced = all_reduce_max_later(vector, group, "handshake")
        values = lambda: read(reduced())  # noqa: E731
    return lambda: _agreement(slots.read(values()), problem, alike, x, expert_ids,
                              routing_weights, group, total_experts, rows)


def _neutral_tail(slots: "_Slots") -> list[int]:
    """The data part of a vector with nothing of this rank's data in it: every check absent,
    no error counted, no ids (a rank whose input is bad, or a trusted capacity call)."""
    return [_ABSENT] * len(slots.data) + [0] * COUNTS + [_ABSENT] * slots.fold


def _fold_block(expert_ids: Tensor | None, slots: "_Slots", group: Any,
                device: torch.device) -> Tensor:
    """The per-rank blocks with this rank's filled in (``[tokens, topk, ids...]``, on the
    device, nothing read), or all absent where ``expert_ids`` is ``None``."""
    block = torch.full((slots.fold,), _ABSENT, dtype=torch.int64, device=device)
    if expert_ids is not None and slots.fold:
        start = group_rank(group) * (2 + FOLD_IDS)
        ids = expert_ids.reshape(-1, expert_ids.shape[-1])
        # slices, not elements: a Python number written into one element of a device
        # tensor is a blocking copy; into a slice it is a fill kernel, nothing waits
        block[start:start + 1] = ids.shape[0]
        block[start + 1:start + 2] = ids.shape[1]
        block[start + 2:start + 2 + ids.numel()] = ids.reshape(-1)
    return block


def _data_tail(x: Tensor, expert_ids: Tensor, routing_weights: Tensor | None,
               check_finite: bool, rows: Tensor | None, group: Any) -> Tensor:
    """The data part of this rank's vector, computed on the device, nothing read back: the
    checks (``[max id, -min id, non-finite]``), the rows once per destination (absent where
    rows go per pair: the slot is always present, so ranks that disagree on dedup still reduce
    tensors of one size) and the group's capacity-call error counts."""
    device = x.device
    if expert_ids.numel():
        ids = expert_ids.reshape(-1).to(torch.int64)
        stats = [ids.max(), ids.min().neg()]
    else:
        stats = [torch.full((), _ABSENT, dtype=torch.int64, device=device)] * 2
    bad = torch.zeros((), dtype=torch.int64, device=device)
    if check_finite:
        for t in (x, routing_weights):
            if t is not None and t.numel():
                bad = bad + (~torch.isfinite(t)).any().to(torch.int64)
    sent = rows.reshape(1).to(torch.int64) if rows is not None else \
        torch.full((1,), _ABSENT, dtype=torch.int64, device=device)
    return torch.cat([torch.stack([*stats, bad]), sent, pending(group, device)])


def _agreement(reduced: "_Reduced", problem: str | None, alike: dict[str, int], x: Any,
               expert_ids: Any, routing_weights: Any, group: Any, total_experts: int,
               rows: Tensor | None) -> Agreement:
    """What the reduced vector says: an error on every rank alike, or the agreement."""
    if reduced.highest["failed"]:
        _raise_for(problem, group)
    raise_counted(group, *reduced.errors)
    for name in alike:  # what every rank must pass alike (the rest is maxima)
        hi, lo = reduced.highest[name], reduced.lowest[name]
        if hi != lo:
            raise ValueError(
                f"fused_expert: ranks disagree on {name} (values between {lo} and {hi}); every "
                "rank of the group must pass the same value"
            )
    max_id, min_id = reduced.data["max id"], -reduced.data["-min id"]
    if max_id != _ABSENT and (min_id < NO_EXPERT or max_id >= total_experts):
        _raise_for(range_problem(expert_ids, total_experts, group_size(group)), group)
    if reduced.data["non-finite"] > 0:
        _raise_for(nonfinite_problem(x, routing_weights), group)
    return Agreement(max_tokens=int(reduced.highest["tokens"]),
                     max_topk=int(reduced.highest["topk"]),
                     max_rows=int(reduced.data["rows sent"]) if rows is not None else None,
                     folded=_folded(reduced.blocks))


def _folded(blocks: list[int]) -> list[list[list[int]]] | None:
    """Every rank's ids from its block, or ``None`` where any rank left its block absent."""
    width, out = 2 + FOLD_IDS, []
    for start in range(0, len(blocks), width):
        tokens, topk = blocks[start], blocks[start + 1]
        if tokens == _ABSENT:
            return None
        ids = blocks[start + 2:start + 2 + tokens * topk]
        out.append([ids[t * topk:(t + 1) * topk] for t in range(tokens)])
    return out or None


@dataclass(frozen=True)
class _Reduced:
    """The handshake's reduced vector, by name."""

    highest: dict[str, int]  # each fact's largest value over the group
    lowest: dict[str, int]  # ... and its smallest
    data: dict[str, int]  # "max id", "-min id", "non-finite", "rows sent"
    errors: list[int]  # capacity calls' error counts (:data:`~.overflow.COUNTS` of them)
    blocks: list[int]  # every rank's block of ids (:func:`fold_width` values)


@dataclass(frozen=True)
class _Slots:
    """Where each named value sits in the handshake's vector (facts, their negations, the
    data checks, the error counts), so it is read back by name."""

    facts: list[str]
    fold: int = 0  # the per-rank blocks' values
    data: tuple[str, ...] = ("max id", "-min id", "non-finite", "rows sent")

    def read(self, values: list[int]) -> _Reduced:
        n, d = len(self.facts), len(self.data)
        if len(values) != 2 * n + d + COUNTS + self.fold:
            raise AssertionError(f"handshake vector of {len(values)} values, expected "
                                 f"{2 * n + d + COUNTS + self.fold}")
        errors = 2 * n + d
        return _Reduced(dict(zip(self.facts, values[:n])),
                        dict(zip(self.facts, (-v for v in values[n:2 * n]))),
                        dict(zip(self.data, values[2 * n:errors])),
                        list(values[errors:errors + COUNTS]),
                        list(values[errors + COUNTS:]))


def _raise_for(problem: str | None, group: Any) -> None:
    """The error path: every rank learns every rank's problem and raises."""
    messages = gather_objects(problem, group)
    if problem is not None:
        raise ValueError(f"fused_expert: {problem}")
    culprits = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None)
    raise ValueError(
        f"fused_expert: another rank of the group rejected its input ({culprits}); "
        f"rank {group_rank(group)} stops too so that no rank waits in a collective"
    )
