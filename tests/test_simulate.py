"""The step model's arithmetic on hand-computable cases, presets, and the CLI."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from mc2.sim.model import Scenario, all_to_all_time, layer_flops, simulate
from mc2.sim.presets import (
    Hardware,
    Link,
    Model,
    PresetError,
    available,
    load_hardware,
    load_model,
)

FAST = Link(bandwidth_gbps=100.0, latency_us=0.0, async_=True)
SLOW = Link(bandwidth_gbps=10.0, latency_us=0.0, async_=True)
HW = Hardware("toy", "", devices_per_node=4, peak_tflops=1.0, gemm_efficiency=1.0,
              memory_gbps=1e12, intra_node=FAST, inter_node=SLOW, chunk_overhead_us=0.0)
# 1 layer, no attention cost to speak of: heads * head_dim tiny
MODEL = Model("toy", hidden=1000, ffn=1000, experts=8, topk=2, layers=1, heads=1, kv_heads=1,
              head_dim=1, vocab=1)


def test_comm_only_and_compute_only_steps() -> None:
    s = Scenario(HW, MODEL, nodes=1, ep=4, tokens_per_device=100, seq_len=1, dtype_bytes=2)
    p = simulate(s)
    rows_bytes = 100 * 2 * 1000 * 2  # tokens * topk * hidden * bytes = 400 kB per All-to-All
    t = rows_bytes * 3 / 4 / 100e9  # 3 of 4 EP peers in the node, 100 GB/s
    assert p.comm_s == pytest.approx(4 * t)
    assert p.exposed_comm_s == pytest.approx(4 * t), "no fusion: nothing hidden"
    f = layer_flops(MODEL, 100, 1)
    assert f["experts"] == 100 * 2 * 6 * 1000 * 1000
    lm_head = 2 * 100 * 1000 * 1
    want = 3 * (f["experts"] + f["router"] + f["attention"] + lm_head) / 1e12
    assert p.compute_s == pytest.approx(want, rel=1e-6)
    single = simulate(replace(s, ep=1))
    assert single.comm_s == 0 and single.exposed_comm_s == 0


def test_pipeline_hides_all_but_fill_and_drain() -> None:
    s = Scenario(HW, MODEL, nodes=1, ep=4, tokens_per_device=100, seq_len=1, mc2=True,
                 micro_batches=4)
    p = simulate(s)
    x = 100 * 2 * 1000 * 2 * 3 / 4 / 100e9  # the All-to-All of all the rows
    # compute per micro-batch dwarfs 2x: only the first dispatch and last combine of each pass,
    # micro-batches of 1/6 of the rows (tapered ends: 1, 2, 2, 1)
    assert p.exposed_comm_s == pytest.approx(2 * 2 * x / 6)
    assert p.comm_s == pytest.approx(4 * x)


def test_hierarchical_volume_per_link() -> None:
    s = Scenario(HW, MODEL, nodes=2, ep=8, tokens_per_device=100, seq_len=1)
    b = 1e6
    flat, _ = all_to_all_time(s, b)
    # flat: 4 of 8 peers on the other node (0.5 MB over 10 GB/s) in parallel with 3 in the node
    assert flat == pytest.approx(max(b * 4 / 8 / 10e9, b * 3 / 8 / 100e9))
    two_d, _ = all_to_all_time(replace(s, hierarchy="2d"), b)
    # 2d: same 0.5 MB across, then the node redistributes 3/4 of it plus its own 3/8
    assert two_d == pytest.approx(b * 4 / 8 / 10e9 + (b * 3 / 8 + b * 4 / 8 * 3 / 4) / 100e9)


def test_latency_counts_messages_flat_vs_2d() -> None:
    lat = replace(HW, inter_node=Link(1e9, latency_us=10.0, async_=True),
                  intra_node=Link(1e9, 0.0, True))
    s = Scenario(lat, MODEL, nodes=2, ep=8, tokens_per_device=1, seq_len=1)
    assert all_to_all_time(s, 0)[0] == pytest.approx(4 * 10e-6)  # 4 inter-node peers
    assert all_to_all_time(replace(s, hierarchy="2d"), 0)[0] == pytest.approx(10e-6)  # 1 node


def test_no_async_link_falls_back_to_sync() -> None:
    tcp = replace(HW, inter_node=Link(10.0, 0.0, async_=False))
    s = Scenario(tcp, MODEL, nodes=2, ep=8, tokens_per_device=100, seq_len=1, mc2=True,
                 micro_batches=4)
    p = simulate(s)
    assert p.sync_fallback
    assert p.exposed_comm_s == pytest.approx(p.comm_s)


def test_presets_load_and_validate(tmp_path) -> None:
    assert {"atlas-800i-a2", "atlas-800t-a2", "dgx-h100"} <= set(available("hardware"))
    assert {"mixtral-8x7b", "mixtral-8x22b", "deepseek-v3", "qwen3-30b-a3b"} <= set(
        available("models"))
    for name in available("hardware"):
        assert load_hardware(name).flops > 0
    for name in available("models"):
        assert load_model(name).topk <= load_model(name).experts
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\nhidden = 10\nffn = -3\n')
    with pytest.raises(PresetError, match=r"bad.toml.*'experts'|bad.toml.*'ffn'"):
        load_model(str(bad))
    hw = tmp_path / "hw.toml"
    hw.write_text('name = "x"\ndevices_per_node = 8\n[compute]\npeak_tflops = 1.0\n'
                  'gemm_efficiency = 0.5\nmemory_gbps = 1.0\n[intra_node]\nbandwidth_gbps = 1.0\n'
                  'latency_us = 1.0\nasync = true\n')
    with pytest.raises(PresetError, match=r"hw.toml: missing section \[inter_node\]"):
        load_hardware(str(hw))
    with pytest.raises(PresetError, match="unknown hardware preset"):
        load_hardware("no-such-box")


def test_cli_prints_the_article_table_in_seconds() -> None:
    proc = subprocess.run([sys.executable, "-m", "mc2.tools.cli", "simulate", "--hardware",
                           "atlas-800i-a2", "--model", "mixtral-8x7b", "--nodes", "1,2"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for text in ("no fusion, 1 node", "MC2 one node", "MC2 across 2 nodes", "47%", "1,420",
                 "MORE than overlap alone allows"):
        assert text in proc.stdout


def test_wire_bytes_shrink_mc2_transfers_and_cost_memory_traffic() -> None:
    s = Scenario(HW, MODEL, nodes=1, ep=4, tokens_per_device=100, seq_len=1, dtype_bytes=2,
                 mc2=True, micro_batches=1)
    plain, fp8 = simulate(s), simulate(replace(s, wire_bytes=1 + 4 / 128))
    assert fp8.comm_s == pytest.approx(plain.comm_s * (1 + 4 / 128) / 2)
    # encode + decode read and write every element of the 4 transfers once
    codec = 4 * 2 * 100 * 2 * 1000 * (2 + 1 + 4 / 128) / 1e12 / 1e9
    assert fp8.compute_s == pytest.approx(plain.compute_s + codec, rel=1e-6)
    serial = replace(s, mc2=False, wire_bytes=1.0)  # no fusion keeps the model's dtype
    assert simulate(serial).comm_s == pytest.approx(simulate(replace(s, mc2=False)).comm_s)


def test_dedup_sends_the_distinct_destinations_only() -> None:
    """MC2 with ``dedup``: a flat exchange moves D_rank / k of the rows, the 2-D one D_node / k
    across nodes (8 experts, top-2, EP 8 over 2 nodes); the no-fusion baseline keeps them all."""
    from mc2.engine.decide.dedup import expected_destinations

    s = Scenario(HW, MODEL, nodes=2, ep=8, tokens_per_device=100, seq_len=1, mc2=True,
                 dedup=True)
    rank, node = expected_destinations(8, 8, 2) / 2, expected_destinations(8, 2, 2) / 2
    assert s.row_shares() == pytest.approx((rank, node))
    b = 1e6
    flat, _ = all_to_all_time(s, b)
    assert flat == pytest.approx(max(b * rank * 4 / 8 / 10e9, b * rank * 3 / 8 / 100e9))
    two_d, _ = all_to_all_time(replace(s, hierarchy="2d"), b)
    across = b * node * 1 / 2 / 10e9
    assert two_d == pytest.approx(across + (b * rank * 3 / 8 + b * rank * 4 / 8 * 3 / 4) / 100e9)
    assert rank == 1.0  # one expert per rank: a token's two experts are on two ranks
    two = replace(s, hierarchy="2d")
    assert simulate(two).comm_s < simulate(replace(two, dedup=False)).comm_s
    assert replace(s, mc2=False).row_shares() == (1.0, 1.0)
    assert simulate(s).rows_saved == pytest.approx((1 - rank, 1 - node))
