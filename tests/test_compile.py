"""torch.compile and torch.export of an enable_mc2 Mixtral on 2 ranks: one graph, no break,
equal to eager (the fused call is the operator ``torch.ops.mc2.fused_expert``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mc2
from tests.workers_compile import compile_and_export


@pytest.fixture(scope="module")
def saved_program(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("export") / "model.pt2"


@pytest.fixture(scope="module")
def captured(saved_program: Path):
    return mc2.run_local(compile_and_export, 2, args=(str(saved_program),), timeout_s=600)


def test_the_model_compiles_as_one_graph(captured) -> None:
    for r in captured:
        assert (r["graphs"], r["breaks"]) == (1, 0)


def test_compiled_equals_eager_forward_and_backward(captured) -> None:
    for r in captured:
        assert r["loss_diff"] <= 1e-5
        assert r["logits_diff"] <= 1e-5
        assert r["grad_rel_diff"] <= 1e-5


def test_export_keeps_one_call_per_moe_layer(captured) -> None:
    for r in captured:
        assert r["exported_calls"] == 2  # two decoder layers
        assert r["export_diff"] <= 1e-6


def test_an_exported_program_loads_after_import_mc2(captured, saved_program: Path) -> None:
    """A fresh process that only imports mc2 finds the operator registered (it was registered
    on a lazy import before, and ``torch.export.load`` failed)."""
    code = ("import sys, torch, mc2\n"
            f"program = torch.export.load({str(saved_program)!r})\n"
            "print(sum('mc2.fused_expert' in str(n.target) for n in program.graph.nodes))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "2"


def test_the_operator_refuses_runtime_objects_while_tracing() -> None:
    layer = mc2.MoELayer(8, 8, 2, topk=1, micro_batches=1)
    x = torch.randn(4, 8)
    ids, weights = torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1)
    timeline = mc2.Timeline()

    def traced(x):
        return mc2.fused_expert_packed(x, layer.w_gate_up, layer.w_down, ids, weights,
                                       timeline=timeline)

    with pytest.raises(Exception, match="cannot be passed under torch.compile"):
        torch.compile(traced, fullgraph=True)(x)


def test_both_operators_stay_out_of_inductors_cuda_graphs() -> None:
    """The forward reads split sizes to the host; the backward finds its call's state by a
    host integer and runs the call's Python, which a CUDA graph's replay would skip (the
    recorded call's state and memory replayed: wrong gradients, silently). Inductor keeps an
    operator out of its graphs (``mode="reduce-overhead"``) by this tag alone."""
    for op in (torch.ops.mc2.fused_expert, torch.ops.mc2.fused_expert_backward):
        assert torch.Tag.cudagraph_unsafe in op.default.tags, op
