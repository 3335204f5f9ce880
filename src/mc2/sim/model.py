"""The model of one training step (forward + backward) of an MoE model under expert parallelism.

Per device and MoE layer:

* compute: attention (projections and causal scores), router, routed experts
  (``tokens * topk * 6 * hidden * ffn`` FLOPs forward), shared experts; backward = 2 x forward;
  time = FLOPs / achievable FLOP/s. Dense layers and the LM head add their FLOPs too.
* dispatch and combine volumes: ``tokens * topk * hidden * bytes`` per device per All-to-All
  (times ``skew`` for the busiest device), split by destination into self, same node and other
  nodes for uniform routing over the EP group.
* with ``dedup`` (MC2's rows once per destination, :mod:`mc2.engine.decide.dedup`): a flat
  exchange moves ``D_rank / topk`` of those rows, where ``D`` is the expected number of distinct
  destinations of a token under uniform routing
  (:func:`mc2.engine.decide.dedup.expected_destinations`); the 2-D one ``D_node / topk`` across
  nodes and ``D_rank / topk`` inside them.
* links (alpha-beta): a flat All-to-All sends one message per peer, intra- and inter-node
  traffic in parallel; the hierarchical (``"2d"``) one sends one message per other node between
  same-local-rank peers, then redistributes inside the node (both stages in sequence).
* the MC2 pipeline with K micro-batches, per pass (forward 1/3 of the expert math, backward
  2/3), micro-batches with tapered ends (:func:`mc2.engine.decide.routing.micro_batch_fractions`), costed by
  :func:`mc2.engine.decide.pipeline_cost.overlapped_pass`: the first dispatch and last combine are exposed;
  in between two transfers run under each micro-batch's compute; each micro-batch pays a
  launch overhead and re-reads every local expert's weights (forward reads, backward reads and
  gradient read-modify-writes). Shared experts run while the first dispatch is in flight.
* without asynchronous communication on a link class the pipeline falls back to synchronous
  communication: nothing is hidden (the article's "RDMA off" case), and the result says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from mc2.engine.decide.dedup import expected_destinations
from mc2.engine.decide.pipeline_cost import training_step
from mc2.engine.decide.routing import micro_batch_fractions
from mc2.sim.presets import Hardware, Model

Hierarchy = Literal["flat", "2d"]


@dataclass(frozen=True)
class Scenario:
    hardware: Hardware
    model: Model
    nodes: int = 1
    ep: int | None = None  # expert-parallel group size (None: as large as experts and devices allow)
    tokens_per_device: int = 4096
    seq_len: int = 4096
    dtype_bytes: int = 2
    micro_batches: int = 1
    mc2: bool = False
    hierarchy: Hierarchy = "flat"
    skew: float = 1.0  # busiest device's traffic / average (1 = uniform routing)
    spread: int | None = None  # nodes one EP group spans (None: as few as hold it)
    wire_bytes: float | None = None  # MC2 rows on the wire, bytes per element (None: dtype)
    dedup: bool = False  # MC2 rows once per destination rank (2-D: per node across nodes)

    @property
    def devices(self) -> int:
        return self.nodes * self.hardware.devices_per_node

    @property
    def ep_size(self) -> int:
        if self.ep is not None:
            return self.ep
        return max(d for d in range(1, min(self.devices, self.model.experts) + 1)
                   if self.model.experts % d == 0 and self.devices % d == 0)

    def row_shares(self) -> tuple[float, float]:
        """``(per rank, per node)``: the rows MC2 sends as a share of (token, expert) pairs
        (1 without ``dedup``; the no-fusion baseline never deduplicates)."""
        if not (self.mc2 and self.dedup):
            return 1.0, 1.0
        k, experts = self.model.topk, self.model.experts
        return (expected_destinations(experts, self.ep_size, k) / k,
                expected_destinations(experts, self.ep_nodes, k) / k)

    @property
    def ep_nodes(self) -> int:
        """Nodes one EP group spans: packed into as few nodes as hold it, unless ``spread``."""
        if self.spread is not None:
            return max(1, min(self.spread, self.nodes, self.ep_size))
        return min(self.nodes, math.ceil(self.ep_size / self.hardware.devices_per_node))

    def validate(self) -> None:
        if self.nodes < 1 or self.tokens_per_device < 1 or self.micro_batches < 1:
            raise ValueError("nodes, tokens_per_device and micro_batches must be positive")
        if self.ep_size > self.devices or self.ep_size < 1:
            raise ValueError(f"ep ({self.ep_size}) must be in [1, {self.devices}] devices")
        if self.model.experts % self.ep_size:
            raise ValueError(f"ep ({self.ep_size}) must divide the expert count "
                             f"({self.model.experts})")


@dataclass(frozen=True)
class StepPrediction:
    scenario: Scenario
    step_s: float
    compute_s: float
    comm_s: float  # All-to-All time, hidden or not
    exposed_comm_s: float
    sync_fallback: bool  # the pipeline could not overlap some link (no async communication)

    @property
    def rows_saved(self) -> tuple[float, float]:
        """``(per rank, across nodes)``: the share of rows ``dedup`` leaves off the wire."""
        rank, node = self.scenario.row_shares()
        return 1 - rank, 1 - node

    @property
    def comm_share(self) -> float:
        return self.exposed_comm_s / self.step_s

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.scenario.tokens_per_device / self.step_s


def layer_flops(m: Model, tokens: int, seq: int) -> dict[str, float]:
    """Forward FLOPs per device of one layer's parts."""
    q = m.heads * m.head_dim
    kv = m.kv_heads * m.head_dim
    attention = 2 * tokens * m.hidden * (q + 2 * kv) + 2 * tokens * q * m.hidden
    attention += 2 * tokens * seq * q  # causal QK^T and PV: 2 x 2 x T x S x q / 2
    return {
        "attention": attention,
        "router": 2 * tokens * m.hidden * m.experts,
        "experts": tokens * m.topk * 6 * m.hidden * m.ffn,
        "shared": tokens * m.shared_experts * 6 * m.hidden * m.shared_ffn,
        "dense_ffn": tokens * 6 * m.hidden * m.dense_ffn,
    }


def all_to_all_time(s: Scenario, bytes_per_device: float) -> tuple[float, bool]:
    """Seconds of one All-to-All moving ``bytes_per_device`` (self included) from every device.

    Returns the time and whether every link it uses is asynchronous.
    """
    hw, ep = s.hardware, s.ep_size
    per_node = math.ceil(ep / s.ep_nodes)  # EP peers in one node
    other_nodes = s.ep_nodes - 1
    intra_peers = per_node - 1
    inter_peers = ep - per_node
    rank_share, node_share = s.row_shares()
    b_intra = bytes_per_device * rank_share * intra_peers / ep
    b_inter = bytes_per_device * rank_share * inter_peers / ep
    intra, inter = hw.intra_node, hw.inter_node
    t_intra = (intra.latency_us * 1e-6 * intra_peers + b_intra / (intra.bandwidth_gbps * 1e9)
               if intra_peers else 0.0)
    if not inter_peers:
        return t_intra, intra.async_
    if s.hierarchy == "flat":
        t_inter = inter.latency_us * 1e-6 * inter_peers + b_inter / (inter.bandwidth_gbps * 1e9)
        t = max(t_intra, t_inter)
    else:
        across = bytes_per_device * node_share * other_nodes / s.ep_nodes  # once per node
        t_inter = inter.latency_us * 1e-6 * other_nodes + across / (inter.bandwidth_gbps * 1e9)
        redistributed = b_inter * (per_node - 1) / per_node
        t_stage2 = (intra.latency_us * 1e-6 * intra_peers
                    + (b_intra + redistributed) / (intra.bandwidth_gbps * 1e9)) if intra_peers else 0
        t = t_inter + t_stage2
    return t, intra.async_ and inter.async_


def simulate(s: Scenario) -> StepPrediction:
    """Predict one training step of ``s`` (see the module docstring)."""
    s.validate()
    hw, m = s.hardware, s.model
    flops = hw.flops
    f = layer_flops(m, s.tokens_per_device, s.seq_len)
    local_experts = m.experts // s.ep_size
    k = s.micro_batches if s.mc2 else 1

    rows = s.tokens_per_device * m.topk * s.skew
    wire = s.wire_bytes if s.mc2 and s.wire_bytes is not None else s.dtype_bytes
    fractions = micro_batch_fractions(k)
    transfers = []
    for fraction in fractions:
        t, is_async = all_to_all_time(s, rows * fraction * m.hidden * wire)
        transfers.append(0.0 if s.ep_size == 1 else t)
    expert_s = 3 * f["experts"] * s.skew / flops
    shared_s = 3 * f["shared"] / flops
    weight_bytes = 3 * m.hidden * m.ffn * s.dtype_bytes * local_experts
    per_micro_batch = 3 * weight_bytes / (hw.memory_gbps * 1e9) + hw.chunk_overhead_us * 1e-6
    per_row = expert_s / rows if rows else 0.0
    if wire != s.dtype_bytes:  # encode + decode of 4 transfers: read and write each element
        per_row += 4 * 2 * m.hidden * (s.dtype_bytes + wire) / (hw.memory_gbps * 1e9)

    overlap = s.mc2 and is_async and k >= 1
    c = [per_row * rows * fraction + per_micro_batch for fraction in fractions]
    moe, exposed = training_step(c, transfers, overlap=overlap, local=shared_s)
    other = 3 * (f["attention"] + f["router"]) / flops
    per_layer = moe + other
    dense = m.dense_layers * 3 * (f["attention"] + f["dense_ffn"]) / flops
    head = 3 * 2 * s.tokens_per_device * m.hidden * m.vocab / flops
    step = m.moe_layers * per_layer + dense + head
    compute = step - m.moe_layers * exposed
    return StepPrediction(
        scenario=s, step_s=step, compute_s=compute,
        comm_s=m.moe_layers * 4 * sum(transfers), exposed_comm_s=m.moe_layers * exposed,
        sync_fallback=s.mc2 and not is_async,
    )


def best(s: Scenario, ks: tuple[int, ...] = (1, 2, 4, 8, 16, 32)) -> StepPrediction:
    """The fastest MC2 micro-batch count for ``s``."""
    preds = [simulate(replace(s, mc2=True, micro_batches=k)) for k in ks
             if k <= s.tokens_per_device]
    return min(preds, key=lambda p: p.step_s)
