"""``MoELayer``: router + this rank's experts + the fused, overlapped op, as an ``nn.Module``.

Model code uses this; it owns parameters, :func:`mc2.fused_expert` owns the math and the
schedule. Each rank of the expert-parallel group holds ``num_experts // world`` experts; the
router (and the shared experts) are replicated, so their gradients must be averaged over the
data-parallel ranks like any other replicated parameter.

Checkpoints: ``state_dict()`` holds only this rank's experts (their global indices are the
``expert_index`` property, from the layout). :mod:`mc2.parallel.checkpoint` saves and reshards
them with ``torch.distributed.checkpoint``, between any EP x DP meshes and one process.
:func:`load_full_state_dict` stays for one job DCP does not do: taking an unsharded state held in
memory (a single-process ``state_dict()``, or a file in the earlier split layout) onto this
rank's experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Unpack, overload

import torch
from torch import Tensor, nn

from mc2.engine.decide.config import ConfigOptions, MC2Config
from mc2.engine.autograd.ops import fused_expert_packed
from mc2.engine.decide.routing import count_on_device
from mc2.engine.autograd.staged import StagedCall, begin_packed
from mc2.parallel.mesh import resolve_layout

EXPERT_KEYS = ("experts.w_gate_up", "experts.w_down")
_FLAT_KEYS = {"w_gate_up": "experts.w_gate_up", "w_down": "experts.w_down"}  # before 0.2


class PackedExperts(nn.Module):
    """This rank's routed experts, packed (``[L, 2F, H]`` gate rows first, ``[L, H, F]``),
    as a module whose ``forward`` runs the fused call.

    Why a module of its own that is *called*: wrappers act on module calls. FSDP2
    (:func:`mc2.fully_shard`) gathers a module's sharded parameters in its pre-forward hook, so
    the experts, sharded over other ranks than the rest of the block, must be a module that the
    block calls. Subclasses name the two tensors (:attr:`names`).
    """

    names: tuple[str, str] = ("w_gate_up", "w_down")

    def __init__(self, gate_up: Tensor, down: Tensor) -> None:
        super().__init__()
        self.register_parameter(self.names[0], nn.Parameter(gate_up))
        self.register_parameter(self.names[1], nn.Parameter(down))

    def weights(self) -> tuple[Tensor, Tensor]:
        """``(gate_up, down)``."""
        return getattr(self, self.names[0]), getattr(self, self.names[1])

    def forward(self, x: Tensor, expert_ids: Tensor, routing_weights: Tensor, *,
                group: Any, config: MC2Config,
                shared: tuple[Tensor | None, Tensor | None, Tensor | None] = (None, None, None),
                shared_scale: Tensor | None = None) -> Tensor:
        """:func:`mc2.fused_expert_packed` of ``x`` with these experts (``shared``: the split
        ``(up, gate, down)`` shared experts, or ``None``s; ``shared_scale``: their per-token
        factor, or ``None``). The weights in the router's dtype, as a model's experts take
        them (a hook of the user's computes on them in that dtype), cast here."""
        gate_up, down = self.weights()
        routing_weights = routing_weights.to(x.dtype)
        return fused_expert_packed(x, gate_up, down, expert_ids, routing_weights, group=group,
                                   config=config, shared_up=shared[0], shared_gate=shared[1],
                                   shared_down=shared[2], shared_scale=shared_scale)

    def begin_staged(self, x: Tensor, expert_ids: Tensor, routing_weights: Tensor, *,
                     group: Any, config: MC2Config,
                     shared: tuple[Tensor | None, Tensor | None, Tensor | None] = (None, None,
                                                                                   None),
                     shared_scale: Tensor | None = None) -> StagedCall:
        """:meth:`forward` in stages (batch overlap, :mod:`mc2.engine.autograd.staged`): plans the
        call and issues its dispatch; ``.experts()`` and ``.end()`` do the rest."""
        gate_up, down = self.weights()
        return begin_packed(x, gate_up, down, expert_ids, routing_weights.to(x.dtype), group=group,
                            config=config, shared=shared, shared_scale=shared_scale)


@dataclass(frozen=True)
class RouterLosses:
    """Auxiliary router losses of one forward (scalars, differentiable w.r.t. the router).

    Attributes:
        load_balancing: Switch/Mixtral style ``E * sum_e f_e * P_e`` over this rank's tokens
            (``f_e``: share of routed slots to expert ``e``; ``P_e``: mean router probability);
            1 when perfectly balanced.
        z_loss: mean squared log-sum-exp of the router logits (ST-MoE), keeps logits small.
    """

    load_balancing: Tensor
    z_loss: Tensor


class MoEOutput(NamedTuple):
    """What :class:`MoELayer` returns when the router losses are asked for."""

    output: Tensor
    losses: RouterLosses


class MoELayer(nn.Module):
    """A Mixtral/DeepSeek-style sparse MoE block with expert parallelism and overlap.

    Args:
        hidden: model width ``H``.
        ffn: expert FFN width ``F``.
        num_experts: global routed experts ``E`` (a multiple of the group size).
        topk: experts per token.
        group: the expert-parallel process group (``None``: default group, or one process).
        mesh: instead of ``group``, a :class:`DeviceMesh`: 1-D (expert parallel), or 2-D with
            dimensions ``("dp", "ep")`` (experts split over ``ep``, replicated over ``dp``;
            :func:`mc2.expert_parallel_mesh` makes one).
        shared_experts: experts every token passes through (DeepSeek/Qwen), replicated.
        shared_ffn: their width (default ``ffn``).
        renormalize: rescale the top-k probabilities to sum to 1 (Mixtral does).
        expert_groups: node-limited routing (DeepSeek-V3's group-limited top-k), off by
            default: the experts form this many equal groups (consecutive ids: with the experts
            split evenly over the ranks, a group per node when it equals the node count), a
            group scores the sum of its two best probabilities, and each token picks its top-k
            among the experts of its ``groups_per_token`` best groups only. Its rows then
            cross to at most that many nodes (with ``dedup=True``, once each).
        groups_per_token: ``M``, the groups a token may use (with ``expert_groups``).
        config: how the fused call runs (:class:`mc2.MC2Config`); ``**options`` its fields as
            keywords (``micro_batches=4``, ``wire_dtype="fp8"``, ...), a shorthand.

    The experts are kept packed, in the ``nn.Linear`` layout of Hugging Face and Megatron:
    ``w_gate_up [local_experts, 2 * ffn, hidden]`` (gate rows first) and
    ``w_down [local_experts, hidden, ffn]``; gate and up run as one GEMM and no call copies a
    weight (:func:`mc2.fused_expert_packed`).
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, topk: int = 2, *,
                 group: Any = None, mesh: Any = None, shared_experts: int = 0,
                 shared_ffn: int | None = None, renormalize: bool = True,
                 expert_groups: int | None = None, groups_per_token: int | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 config: MC2Config | None = None, **options: Unpack[ConfigOptions]) -> None:
        super().__init__()
        self.layout = resolve_layout(group, mesh, num_experts=num_experts)
        if not 1 <= topk <= num_experts:
            raise ValueError(f"topk must be in [1, {num_experts}], got {topk}")
        if (problem := _groups_problem(num_experts, topk, expert_groups, groups_per_token)):
            raise ValueError(problem)
        self.expert_groups, self.groups_per_token = expert_groups, groups_per_token
        self.group, self.num_experts, self.topk = self.layout.ep_group, num_experts, topk
        self.renormalize = renormalize
        self.config = MC2Config.of(config, **options)
        mine = self.layout.experts_of_this_rank(num_experts)
        local = len(mine)
        kw = {"dtype": dtype, "device": device}
        self.gate = nn.Linear(hidden, num_experts, bias=False, **kw)
        self.experts = PackedExperts(torch.empty(local, 2 * ffn, hidden, **kw),
                                     torch.empty(local, hidden, ffn, **kw))
        self.shared: nn.ParameterList | None = None
        if shared_experts:
            sf = shared_ffn or ffn
            self.shared = nn.ParameterList([
                nn.Parameter(torch.empty(shared_experts, hidden, sf, **kw)),
                nn.Parameter(torch.empty(shared_experts, hidden, sf, **kw)),
                nn.Parameter(torch.empty(shared_experts, sf, hidden, **kw))])
        self.reset_parameters()
        self._register_load_state_dict_pre_hook(_renamed_flat_keys)

    @property
    def expert_index(self) -> Tensor:
        """The global indices of this rank's experts, derived from the layout (not a buffer:
        it differs between ranks, checkpoints place experts by the layout, and ``to_empty``
        after a meta-device build cannot leave it garbage)."""
        mine = self.layout.experts_of_this_rank(self.num_experts)
        return torch.arange(mine.start, mine.stop, device=self.w_gate_up.device)

    @property
    def w_gate_up(self) -> nn.Parameter:
        """This rank's ``[local_experts, 2 * ffn, hidden]`` (``experts.w_gate_up``)."""
        return self.experts.w_gate_up

    @property
    def w_down(self) -> nn.Parameter:
        """This rank's ``[local_experts, hidden, ffn]`` (``experts.w_down``)."""
        return self.experts.w_down

    def reset_parameters(self, std: float = 0.02) -> None:
        """``N(0, std)`` everywhere. Expert ``e`` (global index) is drawn from a generator of
        its own, seeded from one draw of the global generator plus ``e``: every rank runs with
        the same seed (the replicated parameters need it), and without this the experts of
        different ranks would start equal, and a layer built at one EP size would not be the
        one built at another from the same seed."""
        seed = int(torch.randint(0, 2 ** 62, (1,), device="cpu"))  # a meta build too
        first = self.layout.experts_of_this_rank(self.num_experts).start
        for p in (self.w_gate_up, self.w_down):
            if p.is_meta:  # nothing to draw into before to_empty
                continue
            for i in range(p.shape[0]):
                generator = torch.Generator(device=p.device).manual_seed(seed + first + i)
                with torch.no_grad():
                    p[i].normal_(0.0, std, generator=generator)
        for p in self.shared or []:
            nn.init.normal_(p, std=std)

    def mc2_expert_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's expert shards (see :mod:`mc2.parallel.expert_shards`)."""
        return {"experts.w_gate_up": self.w_gate_up, "experts.w_down": self.w_down}

    @property
    def local_experts(self) -> int:
        return self.w_gate_up.shape[0]

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(expert_ids, routing_weights, router_logits)`` for tokens ``x [..., H]``."""
        logits = self.gate(x)
        probs = logits.float().softmax(-1)
        if self.expert_groups:
            ids = limited_to_groups(probs, self.expert_groups, self.groups_per_token, self.topk)
            weights = probs.gather(-1, ids)
        else:
            weights, ids = probs.topk(self.topk, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights.to(x.dtype), logits

    def router_losses(self, logits: Tensor, ids: Tensor) -> RouterLosses:
        flat = logits.reshape(-1, self.num_experts).float()
        probs = flat.softmax(-1)
        if flat.shape[0] == 0:
            zero = flat.sum()
            return RouterLosses(zero, zero)
        share = count_on_device(ids, self.num_experts, torch.float32) / ids.numel()
        balance = self.num_experts * (share * probs.mean(0)).sum()
        z = torch.logsumexp(flat, -1).pow(2).mean()
        return RouterLosses(balance, z)

    @overload
    def forward(self, x: Tensor, *, return_losses: Literal[False] = False) -> Tensor: ...

    @overload
    def forward(self, x: Tensor, *, return_losses: Literal[True]) -> MoEOutput: ...

    def forward(self, x: Tensor, *, return_losses: bool = False) -> Tensor | MoEOutput:
        """``x [batch, seq, H]`` or ``[tokens, H]`` -> the same shape; with
        ``return_losses=True`` a :class:`MoEOutput` ``(output, losses)`` (the return type is
        fixed by the flag, as ``torch.max`` with and without ``dim``)."""
        ids, weights, logits = self.route(x)
        out = self.experts(x, ids, weights, group=self.group, config=self.config,
                           shared=self._shared_tensors())
        if return_losses:
            return MoEOutput(out, self.router_losses(logits, ids))
        return out

    def begin_staged(self, x: Tensor) -> StagedCall:
        """This layer's forward in stages, for batch overlap
        (:class:`mc2.integrations.batch_overlap.BatchOverlapStack`): routes ``x``, plans the
        call and issues its dispatch; ``.experts()`` then ``.end()`` (the output) finish it."""
        ids, weights, _ = self.route(x)
        return self.experts.begin_staged(x, ids, weights, group=self.group, config=self.config,
                                         shared=self._shared_tensors())

    def _shared_tensors(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """The shared experts ``(up, gate, down)``, or ``None``s."""
        return tuple(self.shared) if self.shared is not None else (None, None, None)


def _groups_problem(experts: int, topk: int, groups: int | None, per_token: int | None
                    ) -> str | None:
    if groups is None:
        return None if per_token is None else "groups_per_token needs expert_groups"
    if groups < 1 or experts % groups:
        return f"expert_groups ({groups}) must divide the expert count ({experts})"
    if per_token is None or not 1 <= per_token <= groups:
        return f"groups_per_token must be in [1, {groups}], got {per_token}"
    if topk > per_token * (experts // groups):
        return (f"topk ({topk}) exceeds the experts of {per_token} group(s) of "
                f"{experts // groups}")
    return None


def limited_to_groups(probs: Tensor, groups: int, per_token: int, topk: int) -> Tensor:
    """``[..., topk]`` expert ids, each token's among its ``per_token`` best groups of
    ``groups`` (a group's score: the sum of its two best probabilities, DeepSeek-V3's rule)."""
    size = probs.shape[-1] // groups
    grouped = probs.unflatten(-1, (groups, size))
    score = grouped.topk(min(2, size), dim=-1).values.sum(-1)
    chosen = score.topk(per_token, dim=-1).indices
    allowed = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, chosen, True)
    masked = grouped.masked_fill(~allowed.unsqueeze(-1), -1.0).flatten(-2)
    return masked.topk(topk, dim=-1).indices


def _renamed_flat_keys(state: dict[str, Any], prefix: str, *args: Any) -> None:
    """States written before the experts became a submodule name them ``w_gate_up`` and
    ``w_down``; they load as ``experts.w_gate_up`` and ``experts.w_down``."""
    for old, new in _FLAT_KEYS.items():
        if prefix + old in state and prefix + new not in state:
            state[prefix + new] = state.pop(prefix + old)


def _packed_from_split(full: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """Checkpoints written before the packed layout hold ``w_up``/``w_gate [E, H, F]`` and
    ``w_down [E, F, H]``; turn them into ``w_gate_up [E, 2F, H]`` and ``w_down [E, H, F]``."""
    up, gate = prefix + "w_up", prefix + "w_gate"
    if up not in full or gate not in full or prefix + "w_gate_up" in full:
        return full
    full = dict(full)
    full[prefix + "w_gate_up"] = torch.cat([full.pop(gate).transpose(1, 2),
                                            full.pop(up).transpose(1, 2)], 1).contiguous()
    full[prefix + "w_down"] = full[prefix + "w_down"].transpose(1, 2).contiguous()
    return full


def load_full_state_dict(layer: MoELayer, full: dict[str, Tensor], prefix: str = "") -> None:
    """Load an unsharded state (experts ``[E, ...]``) into ``layer``, taking this rank's experts.

    States in the earlier split layout (``w_up``, ``w_gate``, ``w_down [E, F, H]``) are packed
    on the way in.
    """
    full = _packed_from_split(full, prefix)
    full = dict(full)
    _renamed_flat_keys(full, prefix)
    mine = layer.expert_index.to("cpu")
    state = {}
    for name in layer.state_dict():
        key = prefix + name
        if key not in full:
            raise KeyError(f"load_full_state_dict: missing '{key}'")
        value = full[key]
        if name in EXPERT_KEYS:
            if value.shape[0] != layer.num_experts:
                raise ValueError(f"'{key}' holds {value.shape[0]} experts, the layer "
                                 f"{layer.num_experts}")
            value = value.index_select(0, mine.to(value.device))
        state[name] = value
    layer.load_state_dict(state)
