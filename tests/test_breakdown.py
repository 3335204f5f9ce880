"""The five-part step decomposition adds up and every part is a real, positive share."""

from __future__ import annotations

import pytest

from mc2.tools.breakdown import PARTS, BreakdownConfig, format_breakdown, run_breakdown


def test_parts_add_up_to_the_step() -> None:
    cfg = BreakdownConfig(batch=2, seq=16, hidden=32, ffn=64, heads=4, experts=4, topk=2,
                          vocab=100, micro_batches=2, repeats=2, warmup=1)
    result = run_breakdown(cfg, world_size=2)
    assert set(result) == {"serial", "mc2 K=2"}
    for name, parts in result.items():
        for part in PARTS:
            assert parts[part] > 0, f"{name}: {part} = {parts[part]}"
        assert sum(parts[p] for p in PARTS) == pytest.approx(parts["step"], rel=0.2)
    text = format_breakdown(result, cfg)
    for part in PARTS:
        assert part in text
