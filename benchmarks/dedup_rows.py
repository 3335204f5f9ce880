"""Rows once per destination (``dedup=True``): the rows counted against the formula, and the
layer step with and without it.

Three parts (``--parts counts,step,nodes``):

- ``counts``: the rows a call's exchanges were sized for (:func:`mc2.count_traffic`), per
  routed (token, expert) pair, against ``D / k`` (:func:`mc2.engine.decide.dedup.expected_destinations`)
  on uniform random routing: 8 experts top-2 on 2 ranks and 64 experts top-6 on 8 ranks (real
  fused calls in local worlds), and 256 experts top-8 per node over 2, 4 and 8 nodes of 8 ranks
  (counted by mc2's own routing code without sending).
- ``step``: ``mc2 bench``'s layer step (forward + backward, 2 ranks, 4096 tokens per rank,
  hidden 1024, ffn 2048, 8 experts, top-2, float32), the serial path, MC2 and MC2 with dedup,
  interleaved in every round, median of ``--repeats``; plain loopback and loopback shaped with
  ``tc tbf`` (``--regimes``; root; always removed).
- ``nodes``: 2 emulated nodes x 2 ranks (network namespaces, root), 16 experts, top-4,
  inter-node link ``--inter-node`` (500 Mbit), ``hierarchy="2d"``, with and without dedup; and
  the bytes that crossed between nodes per call (counted).

::

    sudo .venv/bin/python benchmarks/dedup_rows.py --json docs/dedup_rows.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_peers import ShapedLoopback, can_shape  # noqa: E402

import mc2  # noqa: E402
from mc2.engine.decide.dedup import destinations, expected_destinations, node_destinations  # noqa: E402
from mc2.tools.bench import BenchConfig, run_bench  # noqa: E402


def _uniform(tokens: int, experts: int, topk: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, experts, generator=g).topk(topk, dim=-1).indices


def _count_rank(rank: int, world: int, tokens: int, experts: int, topk: int) -> dict[str, Any]:
    """One forward of a uniform routing under the counter (hidden 64: only rows matter)."""
    g = torch.Generator().manual_seed(rank)
    local = experts // world
    ids = _uniform(tokens, experts, topk, 100 + rank)
    x = torch.randn(tokens, 64, generator=g)
    w = [torch.randn(local, 64, 32, generator=g), torch.randn(local, 64, 32, generator=g),
         torch.randn(local, 32, 64, generator=g)]
    out = {}
    for dedup in (False, True):
        with torch.no_grad(), mc2.count_traffic() as traffic:
            mc2.fused_expert(x, *w, ids, torch.ones(tokens, topk), micro_batches=2, dedup=dedup)
        out[dedup] = {"pairs": traffic.pairs, "rows": traffic.rows}
    return out


def counts() -> list[dict[str, Any]]:
    rows = []
    for experts, topk, world, tokens in ((8, 2, 2, 4096), (64, 6, 8, 2048)):
        print(f"== counts: {experts} experts, top-{topk}, {world} ranks", file=sys.stderr,
              flush=True)
        ranks = mc2.run_local(_count_rank, world, args=(tokens, experts, topk), timeout_s=300)
        pairs = sum(r[True]["pairs"] for r in ranks)
        sent = sum(r[True]["rows"] for r in ranks)
        assert sum(r[False]["rows"] for r in ranks) == pairs  # one row per pair without dedup
        want = expected_destinations(experts, world, topk) / topk
        rows.append({"shape": f"{experts} experts, top-{topk}, {world} ranks", "per": "rank",
                     "measured": sent / pairs, "formula": want, "saved": 1 - sent / pairs,
                     "error": sent / pairs / want - 1, "how": "fused calls, counted"})
    for nodes in (2, 4, 8):
        per_node, experts, topk, tokens = 8, 256, 8, 65536
        world = nodes * per_node
        ids = _uniform(tokens, experts, topk, nodes)
        hit = node_destinations(destinations(ids, experts // world, world), nodes)
        measured = int(hit.sum()) / ids.numel()
        want = expected_destinations(experts, nodes, topk) / topk
        rows.append({"shape": f"{experts} experts, top-{topk}, {nodes} nodes x {per_node}",
                     "per": "node", "measured": measured, "formula": want,
                     "saved": 1 - measured, "error": measured / want - 1,
                     "how": "mc2's routing, counted without sending"})
    return rows


def _step_config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(tokens_per_rank=4096, hidden=1024, ffn=2048, experts=8, topk=2,
                       dtype="float32", micro_batches=(args.k,), repeats=args.repeats,
                       warmup=1, dedups=(False, True), quiet=True)


def _modes(report: Any) -> dict[str, float]:
    return {r.mode: r.step_s for r in report.results}


def steps(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for regime in args.regimes.split(","):
        if regime != "plain" and (why := can_shape()):
            print(f"{regime}: skipped ({why})", file=sys.stderr)
            continue
        print(f"== step: {regime}", file=sys.stderr, flush=True)
        if regime == "plain":
            report = run_bench(_step_config(args))
        else:
            with ShapedLoopback(regime):
                report = run_bench(_step_config(args))
        t = _modes(report)
        k = args.k
        rows.append({"regime": regime, "serial_s": t["serial"], "mc2_s": t[f"mc2 K={k}"],
                     "dedup_s": t[f"mc2 K={k} dedup"],
                     "dedup_over_mc2": t[f"mc2 K={k} dedup"] / t[f"mc2 K={k}"]})
    return rows


def _node_count_rank(rank: int, world: int, cfg: BenchConfig) -> dict[str, Any]:
    from mc2.engine.transport.topology import topology_for
    from mc2.tools.bench import Mode, _problem

    x, ws, ids, rw, _ = _problem(rank, cfg)
    node_of_rank = topology_for(None).node_of_rank
    out = {}
    for dedup in (False, True):
        mode = Mode("count", cfg.micro_batches[0], True, "2d", dedup=dedup)
        with torch.no_grad(), mc2.count_traffic() as traffic:
            mc2.fused_expert_packed(x, *ws, ids, rw, config=cfg.call_config(mode))
        out[dedup] = traffic.rows_across_nodes(node_of_rank, rank) * traffic.row_bytes
    return out


def nodes(args: argparse.Namespace) -> dict[str, Any]:
    from mc2.tools.netns import EmulatedCluster, cluster_problem

    cfg = replace(_step_config(args), experts=16, topk=4, hierarchies=("2d",))
    counted = mc2.run_local(_node_count_rank, 4, args=(cfg,), ranks_per_node=2, timeout_s=300)
    result: dict[str, Any] = {
        "bytes_across_nodes_per_call": {"off": sum(r[False] for r in counted),
                                        "on": sum(r[True] for r in counted)}}
    if (problem := cluster_problem()) is not None:
        print(f"nodes: step skipped ({problem})", file=sys.stderr)
        return result
    print(f"== nodes: 2 x 2, inter-node {args.inter_node}", file=sys.stderr, flush=True)
    with EmulatedCluster(2, 2, args.inter_node) as cluster:
        report = run_bench(cfg, world_size=4, ranks_per_node=2,
                           rank_env=cluster.rank_environment)
    t = _modes(report)
    k = args.k
    result.update({"serial_s": t["serial"], "mc2_2d_s": t[f"mc2 K={k} 2d"],
                   "dedup_2d_s": t[f"mc2 K={k} 2d dedup"],
                   "dedup_over_mc2": t[f"mc2 K={k} 2d dedup"] / t[f"mc2 K={k} 2d"]})
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--parts", default="counts,step,nodes")
    p.add_argument("--regimes", default="plain,500mbit,200mbit",
                   help="for step: plain, or tc tbf rates")
    p.add_argument("--inter-node", default="500mbit", help="for nodes: the inter-node rate")
    p.add_argument("--k", type=int, default=4, help="micro-batches of the MC2 modes")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    out: dict[str, Any] = {}
    parts = args.parts.split(",")
    if "counts" in parts:
        out["counts"] = counts()
        for r in out["counts"]:
            print(f"{r['shape']:<34} rows/pair {r['measured']:.4f}, formula {r['formula']:.4f} "
                  f"({r['error'] * 100:+.2f}%), saved {r['saved'] * 100:.1f}% per {r['per']}")
    if "step" in parts:
        out["step"] = steps(args)
        for r in out["step"]:
            print(f"step {r['regime']:<8} serial {r['serial_s']:.3f} s, mc2 {r['mc2_s']:.3f} s, "
                  f"mc2+dedup {r['dedup_s']:.3f} s ({r['dedup_over_mc2']:.3f}x)")
        plain = next((r for r in out["step"] if r["regime"] == "plain"), None)
        for r in out["step"]:
            if plain is not None and r is not plain:
                print(f"  {r['regime']}: mc2+dedup / unshaped mc2+dedup "
                      f"{r['dedup_s'] / plain['dedup_s']:.3f}")
    if "nodes" in parts:
        out["nodes"] = nodes(args)
        print(f"nodes: {json.dumps(out['nodes'])}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
