"""``ep_implementation="mc2"``: mc2's pipeline inside Hugging Face's own expert parallelism.

transformers 5 shards a MoE model's experts with ``DistributedConfig(ep_size=N, ...)`` and asks
an implementation registered in ``EPImplementationInterface`` to bring each experts module its
tokens. Its ``"all_to_all"`` runs dispatch, experts and combine one after another. This module
registers ``"mc2"``, which runs the same three as mc2's pipeline (:func:`mc2.fused_expert_module`):
micro-batches overlapped, the backward pipelined with the gradient exchanges, the model's own
experts forward (whatever ``experts_implementation``) on each micro-batch::

    import mc2.integrations.hf_expert_parallel  # registers "mc2" (or call register())
    model = AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(ep_size=2, fsdp_size=2, ep_implementation="mc2"))

**When it is registered**: when this module is imported (``import mc2`` does not import
transformers). :func:`register` registers it again under another name or with another
:class:`~mc2.MC2Config`.

**Both of Hugging Face's layouts.** Ranks holding different batches (EP across FSDP ranks):
each rank's tokens go through the pipeline as they are. An EP group sharing one batch
(``tp_size == ep_size``): as Hugging Face's ``"all_to_all"`` does, each rank takes its slice of
the batch (a ``Replicate -> Shard(0)`` redistribution, whose backward gathers the slices'
gradients), runs the pipeline on it, and the slices' outputs are gathered back.

**No-grad calls on a shared batch** choose per call between the pipeline and Hugging Face's
own ``AllReduceEP`` (every rank runs its experts on the whole batch, one all-reduce sums the
outputs), as its ``"auto"`` does at inference, where the experts module can take the
all-reduce's masked routes (Hugging Face's kernels can; an eager forward is tried once on a
CPU and not trusted elsewhere: gpt-oss's eager forward cannot, and runs the pipeline). The
all-reduce is one collective where the
pipeline runs five (handshake, counts, dispatch, combine, the gather of the slices), and it moves
``2 (R-1)/R`` of the batch's rows against the pipeline's ``(R-1)/R (2k/R + 1)``: it is taken
where it moves no more bytes (``R <= 2k``) or the batch is small (at most
:data:`ALL_REDUCE_TOKENS` tokens per rank). :attr:`MC2ExpertParallel.last_choice` says what the
last call ran; each experts module holds its implementation as ``mc2_expert_parallel``.
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
    """Whether a no-grad call on a shared batch of ``tokens`` runs the all-reduce (see the
    module docstring)."""
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
        """An experts module's tokens through mc2's pipeline (see the module docstring)."""

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
