"""``ep_implementation="mc2"``: mc2's pipeline inside Hugging Face's own expert parallelism.

Registers ``"mc2"`` in transformers' ``EPImplementationInterface`` when imported (``import mc2``
does not import transformers; :func:`register` registers again under another name or
:class:`~mc2.MC2Config`). Each experts module's tokens run through :func:`mc2.fused_expert_module`
in both of Hugging Face's layouts; no-grad calls on a shared batch may instead run Hugging Face's
``AllReduceEP`` (:func:`all_reduce_pays`), where the experts module can take its masked routes
(:meth:`MC2ExpertParallel._takes_masked_routes`).

See docs/huggingface.md, '``ep_implementation="mc2"``' (registration, both layouts, the
all-reduce's byte and latency rule).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from mc2.engine.autograd.ops import fused_expert_module
from mc2.engine.decide.config import MC2Config

NAME = "mc2"
# per-rank tokens of a no-grad call on a shared batch at or below which the all-reduce runs
# whatever the group's size: five collectives' latency against one
ALL_REDUCE_TOKENS = 64
_log = logging.getLogger(__name__)


def all_reduce_pays(tokens: int, ranks: int, topk: int) -> bool:
    """Whether a no-grad call on a shared batch of ``tokens`` runs the all-reduce: it moves no
    more bytes (``R <= 2k``) or the batch is small (docs/huggingface.md, 'No-grad calls')."""
    return ranks <= 2 * topk or tokens <= ALL_REDUCE_TOKENS * ranks


def _runs_masked_route(implementation: Any, hidden_states: Tensor) -> bool:
    """One token through ``implementation``'s experts forward with every route masked as
    ``AllReduceEP`` masks it (local id ``num_local_experts``, weight 0), on this rank alone;
    whether it ran and gave zeros. CPU only: a forward that fails raises there."""
    row = hidden_states[:1].detach()
    k = 2
    ids = torch.full((1, k), implementation.num_local_experts, dtype=torch.int64,
                     device=row.device)
    weights = torch.zeros(1, k, dtype=row.dtype, device=row.device)
    try:
        with torch.no_grad():
            out = implementation.experts_forward(row, ids, weights)
    except (RuntimeError, IndexError, ValueError):
        return False
    return bool((out == 0).all())


def _implementation(config: MC2Config) -> type:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from transformers.distributed.expert_parallel import AllReduceEP, EPImplementation

    class MC2ExpertParallel(EPImplementation):
        """An experts module's tokens through mc2's pipeline (see docs/huggingface.md)."""

        def __init__(self, experts: Any, ep_mesh: Any, tp_mesh: Any) -> None:
            super().__init__(experts, ep_mesh, tp_mesh)
            self.experts = experts
            self.config = config
            self.all_reduce = AllReduceEP(experts, ep_mesh, tp_mesh) if self.shares_batch \
                else None
            self.last_choice: str | None = None
            self.masked_routes: bool | None = None
            experts.mc2_expert_parallel = self  # where a user (or a test) finds the choice

        def __call__(self, hidden_states: Tensor, top_k_index: Tensor,
                     top_k_weights: Tensor) -> Tensor:
            tokens, ranks = hidden_states.shape[0], self.ep_mesh.size()
            grad = torch.is_grad_enabled() and (hidden_states.requires_grad
                                                or top_k_weights.requires_grad)
            if self.all_reduce is not None and not grad and all_reduce_pays(
                    tokens, ranks, top_k_index.shape[-1]) and self._takes_masked_routes(
                    hidden_states):
                return self._chose("all_reduce", self.all_reduce(hidden_states, top_k_index,
                                                                 top_k_weights))
            sliced = self.tp_mesh.size() > 1
            if sliced:  # each rank its slice of the shared batch; the backward gathers them
                hidden_states, top_k_index, top_k_weights = (
                    DTensor.from_local(t, self.tp_mesh, [Replicate()], run_check=False)
                    .redistribute(self.tp_mesh, [Shard(0)]).to_local()
                    for t in (hidden_states, top_k_index, top_k_weights))
            out = fused_expert_module(hidden_states, self.experts, top_k_index, top_k_weights,
                                      group=self.ep_mesh.get_group(), config=self.config,
                                      local_experts=self.num_local_experts,
                                      forward=self.experts_forward)
            if sliced:
                hidden = out.shape[-1]
                out = DTensor.from_local(out.contiguous(), self.tp_mesh, [Shard(0)],
                                         shape=(tokens, hidden), stride=(hidden, 1)
                                         ).full_tensor()
            return self._chose("mc2", out)

        def _takes_masked_routes(self, hidden_states: Tensor) -> bool:
            """Whether this experts module can run ``AllReduceEP``'s masked routes (local id
            ``num_local_experts``, weight 0), decided once per module alike on every rank.

            Hugging Face's kernels (``grouped_mm``, ``batched_mm``, ...) skip them; an eager
            forward may not (gpt-oss's one-hots over the experts alone and fails). On a CPU
            one masked route is tried; elsewhere an eager forward is not trusted with it, since
            the failure there is a device-side assert that leaves the device unusable. A
            module that cannot take them runs mc2's pipeline, which hands the experts local ids
            only.
            """
            if self.masked_routes is None:
                implementation = getattr(getattr(self.experts, "config", None),
                                         "_experts_implementation", None)
                if implementation not in (None, "eager"):
                    self.masked_routes = True
                elif hidden_states.device.type != "cpu":
                    self.masked_routes = False
                else:
                    self.masked_routes = _runs_masked_route(self, hidden_states)
            return self.masked_routes

        def _chose(self, choice: str, out: Tensor) -> Tensor:
            if choice != self.last_choice:
                _log.info("mc2 expert parallelism: %s (%s)", choice,
                          "no-grad call on a shared batch" if choice == "all_reduce"
                          else "pipelined all-to-all")
            self.last_choice = choice
            return out

    return MC2ExpertParallel


# What ep_implementation="mc2" runs unless registered with another config: rows once per
# destination (measured on Hugging Face's own stack, Mixtral shape, 2 ranks, 200 Mbit: the train
# step 1.35x HF's all_to_all against 1.28x without; equal on plain loopback: docs/huggingface.md)
DEFAULT_CONFIG = MC2Config(dedup=True)


def register(name: str = NAME, config: MC2Config | None = None) -> type:
    """Register mc2 in ``EPImplementationInterface`` as ``name``, its calls run with
    ``config`` (default :data:`DEFAULT_CONFIG`: the defaults with ``dedup=True``); the
    registered class."""
    from transformers.distributed.expert_parallel import EPImplementationInterface

    cls = _implementation(config or DEFAULT_CONFIG)
    EPImplementationInterface.register(name, cls)
    return cls


register()
