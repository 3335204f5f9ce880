"""Wire formats: what each format does to a row, and fused_expert with each of them.

Bounds, relative to the largest reference magnitude. ``eps`` is a format's worst rounding of one
element relative to its block's largest magnitude: bf16 keeps 8 significant bits (2^-8), fp16 11
(2^-11), fp8 e4m3 4 (2^-4); int8 rounds to 1/127 of the block's largest value (1/254 ~ 2^-8).
A pass crosses two rounded transfers (dispatch, combine) with a SwiGLU expert between them, whose
gain on these problems is a few units; so a few ``eps`` bound outputs and input gradients. The
weight gradients sum the products of two rounded tensors over many rows; int8's error is
relative to the block maximum rather than to each element, so small elements of a block with a
large one lose their precision, and the sums collect it: it gets a wider factor. Each bound
stays well below O(1), what a wrong route or a lost row would give.
"""

from __future__ import annotations

import pytest
import torch

import mc2
from mc2.engine.transport.wire import WireFormat, parse_wire_dtype, wire_problem
from tests.problems import make_problem
from tests.test_fused_expert_distributed import reference
from tests.workers import run_cases, run_cases_as_nodes, run_with_shared

FP8 = torch.float8_e4m3fn
EPS = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, FP8: 2 ** -4, "int8": 2 ** -8}
FACTOR = {torch.bfloat16: 6, torch.float16: 6, FP8: 2, "int8": 24}
FORMATS = [torch.bfloat16, torch.float16, FP8, "int8"]
BLOCK = 8  # the test problems have hidden 32


def bound(wire) -> float:
    kinds = wire if isinstance(wire, tuple) else (wire,)
    return max(FACTOR[k] * EPS[k] for k in kinds)


# --- one row at a time ---------------------------------------------------------------------

@pytest.mark.parametrize("kind", FORMATS, ids=str)
def test_a_round_trip_stays_within_eps_of_the_block_maximum(kind) -> None:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 256, generator=g, dtype=torch.float64)
    rows[0] *= 1e4  # large dynamic range: one row much larger than the others
    rows[1, :128] *= 1e-4  # and within a row: one block tiny, the next normal
    rows[2] = 0.0  # all zeros
    fmt = WireFormat(kind, block=128)
    data = fmt.encode(rows.float())
    assert data.dtype == torch.uint8 and data.shape == (64, fmt.bytes_per_row(256, torch.float32))
    back = fmt.decode(data, 256, torch.float64)
    assert torch.isfinite(back).all()
    assert torch.equal(back[2], rows[2])  # zeros stay zeros, never 0/0
    block_max = rows.abs().view(64, 2, 128).amax(-1, keepdim=True).expand(64, 2, 128)
    err = ((back - rows).abs().view(64, 2, 128) / block_max.clamp_min(1e-30)).max().item()
    assert 0 < err <= EPS[kind] * 1.01, err
    # the tiny block keeps its own precision (per-block scales); a plain cast has no scale
    tiny = (back[1, :128] - rows[1, :128]).abs().max() / rows[1, :128].abs().max()
    assert tiny <= EPS[kind] * 1.01


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", [FP8, "int8"], ids=str)
def test_half_precision_rows_decode_finite_at_every_block_scale(kind, dtype) -> None:
    """Scales stay float32 whatever the compute dtype: with float16 rows a small block's
    reciprocal scale would overflow to inf and its zeros decode to NaN."""
    g = torch.Generator().manual_seed(1)
    fmt = WireFormat(kind, block=16)
    for block_max in (1e-6, 1e-4, 1e-2, 1.0, 1e2, 1e4):
        rows = torch.rand(16, 64, generator=g, dtype=torch.float64) * 2 - 1
        rows = (rows / rows.abs().view(16, 4, 16).amax(-1, keepdim=True).repeat_interleave(
            16, -1).view(16, 64) * block_max)
        rows[0] = 0.0
        rows[1, :16] = 0.0  # a zero block beside non-zero ones
        x = rows.to(dtype)
        back = fmt.decode(fmt.encode(x), 64, dtype)
        assert back.dtype == dtype and torch.isfinite(back).all(), (block_max, back)
        assert torch.equal(back[0], x[0]) and torch.equal(back[1, :16], x[1, :16])
        # the format's rounding, plus the half type's own spacing at this magnitude
        spacing = max(torch.finfo(dtype).eps * block_max, torch.finfo(dtype).smallest_normal
                      * torch.finfo(dtype).eps)
        err = (back.double() - x.double()).abs().max().item()
        assert err <= EPS[kind] * 1.01 * block_max + 2 * spacing, (block_max, err)


@pytest.mark.parametrize("kind", [FP8, "int8"], ids=str)
@pytest.mark.parametrize("magnitude", [1e5, 1e30])
def test_huge_blocks_stay_finite(kind, magnitude) -> None:
    # blocks far beyond fp8's 448 (scales > 1): the decode must stay finite and within eps
    rows = torch.randn(16, 256, generator=torch.Generator().manual_seed(1)) * magnitude
    rows[1] /= magnitude  # a normal row beside the huge ones
    fmt = WireFormat(kind, block=128)
    back = fmt.decode(fmt.encode(rows), 256, torch.float32)
    assert torch.isfinite(back).all()
    block_max = rows.abs().view(16, 2, 128).amax(-1, keepdim=True).expand(16, 2, 128)
    err = ((back - rows).abs().view(16, 2, 128) / block_max).max().item()
    assert err <= EPS[kind] * 1.01, err


@pytest.mark.parametrize("kind", FORMATS, ids=str)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_value_arrives_non_finite_and_alone(kind, bad) -> None:
    """NaN or Inf in a row reaches the receiver non-finite (with ``check_finite=False`` the
    model's own loss shows it, as without a wire format), and only in its block: before, int8
    gave a NaN block the scale 1 and cast NaN to 0, delivering finite values."""
    rows = torch.randn(4, 256, generator=torch.Generator().manual_seed(2))
    rows[1, 7] = bad
    fmt = WireFormat(kind, block=128)
    back = fmt.decode(fmt.encode(rows), 256, torch.float32)
    assert not torch.isfinite(back[1, 7])
    mask = torch.ones_like(rows, dtype=torch.bool)
    mask[1, :128] = False  # the block holding it
    assert torch.isfinite(back[mask]).all()


@pytest.mark.parametrize("kind", [FP8, "int8"], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_blocks_with_a_tiny_maximum_arrive_finite_and_close(kind, dtype) -> None:
    """Block maxima far below float32's normal range (1e-36 .. 1e-40): the scale is held at
    float32's smallest normal, so its reciprocal stays finite (before: infinite, zeros came
    back NaN and values as the block's maximum); the error within the format's bound at that
    scale."""
    fmt = WireFormat(kind, block=16)
    tiny = torch.finfo(torch.float32).tiny
    for block_max in (1e-36, 1e-38, 1e-40):
        rows = torch.rand(4, 32, generator=torch.Generator().manual_seed(3),
                          dtype=torch.float64) * 2 - 1
        rows = rows / rows.abs().max() * block_max
        rows[0, :16] = 0.0
        x = rows.to(dtype)
        back = fmt.decode(fmt.encode(x), 32, dtype)
        assert torch.isfinite(back).all() and torch.equal(back[0, :16], x[0, :16]), block_max
        scale_max = max(float(x.abs().max()), tiny * (127 if kind == "int8" else 448))
        err = (back.double() - x.double()).abs().max().item()
        assert err <= EPS[kind] * 1.01 * scale_max, (block_max, err, scale_max)


def test_bytes_per_row() -> None:
    assert WireFormat(None).bytes_per_row(1024, torch.float32) == 4096
    assert WireFormat(torch.bfloat16).bytes_per_row(1024, torch.float32) == 2048
    assert WireFormat(FP8).bytes_per_row(1024, torch.float32) == 1024 + 8 * 4
    assert WireFormat("int8", 64).bytes_per_row(1024, torch.float32) == 1024 + 16 * 4


def test_names_and_bad_formats() -> None:
    assert parse_wire_dtype("bf16") is torch.bfloat16 and parse_wire_dtype("fp8") is FP8
    assert parse_wire_dtype("none") is None and parse_wire_dtype("int8") == "int8"
    with pytest.raises(ValueError, match="unknown wire format"):
        parse_wire_dtype("fp4")
    assert "wire_dtype must be" in wire_problem(torch.int32, 128, 256)
    assert "must divide the hidden size" in wire_problem(FP8, 100, 256)
    assert "(dispatch, combine)" in wire_problem((FP8,), 128, 256)
    assert wire_problem((FP8, torch.bfloat16), 128, 256) is None
    assert wire_problem(torch.bfloat16, 100, 256) is None  # casts have no blocks


# --- fused_expert on 2 ranks (and 4 as 2 nodes x 2) -------------------------------------

def hostile(routing: str, world: int = 2):
    p = make_problem(world, routing, hidden=32, seed=3)
    if p.xs[0].shape[0] >= 2:
        p.xs[0][0, :BLOCK] *= 100.0  # a row with a large dynamic range (fits fp16's 65504)
        p.xs[0][1] = 0.0  # an all-zero row
    return p


WIRES = [None, *FORMATS, (FP8, torch.bfloat16)]
ROUTINGS = ("uniform", "one_expert", "zero_tokens")  # one_expert: every token to a hot expert


@pytest.fixture(scope="module")
def two_ranks():
    cases = [(hostile(r), {"micro_batches": 2, "wire_dtype": w, "wire_block": BLOCK})
             for r in ROUTINGS for w in WIRES]
    cases.append((hostile("uniform"), {"micro_batches": 2}))  # no wire_dtype argument at all
    return cases, mc2.run_local(run_cases, 2, args=(cases,), deadline_s=180)


def check(results, problem, wire, what: str) -> None:
    ref = reference(problem)
    tol = 1e-10 if wire is None else bound(wire)
    for rank, r in enumerate(results):
        for key in ("out", "x", "rw"):
            got, want = r[key].double(), ref[key][rank]
            if want.numel() == 0:
                continue
            assert torch.isfinite(got).all(), f"{what} rank {rank} {key}: not finite"
            err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-3)).item()
            assert err <= tol, f"{what} rank {rank} {key}: {err:.2e} > {tol:.2e}"
        for got, want in zip(r["w"], ref["w"][rank]):
            err = ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-3)).item()
            assert err <= tol, f"{what} rank {rank} weight grad: {err:.2e} > {tol:.2e}"


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("wire", WIRES, ids=str)
def test_every_format_stays_within_its_bound(two_ranks, routing: str, wire) -> None:
    cases, results = two_ranks
    i = ROUTINGS.index(routing) * len(WIRES) + WIRES.index(wire)
    check([r[i] for r in results], cases[i][0], wire, f"{routing} {wire}")


def test_wire_none_is_bitwise_today(two_ranks) -> None:
    cases, results = two_ranks
    explicit, default = WIRES.index(None), len(cases) - 1
    for r in results:
        for key in ("out", "x", "rw"):
            assert torch.equal(r[explicit][key], r[default][key])


def test_quantised_formats_do_change_the_numbers(two_ranks) -> None:
    """Not a no-op: every format moves the result away from the exact one, fp8 the most."""
    _, results = two_ranks
    exact = results[0][WIRES.index(None)]["out"]
    errs = {str(w): (results[0][WIRES.index(w)]["out"] - exact).abs().max().item()
            for w in FORMATS}
    assert all(e > 0 for e in errs.values()), errs
    assert errs[str(FP8)] > errs[str(torch.bfloat16)] > errs[str(torch.float16)]


def test_formats_with_the_2d_hierarchy_and_shared_experts() -> None:
    p = hostile("uneven", world=4)
    cases = [(p, {"micro_batches": 2, "hierarchy": "2d", "wire_dtype": w, "wire_block": BLOCK})
             for w in (FP8, (FP8, torch.bfloat16))]
    results = mc2.run_local(run_cases_as_nodes, 4, args=(2, cases), deadline_s=180)
    for i, (_, opts) in enumerate(cases):
        check([r[i] for r in results], p, opts["wire_dtype"], f"2d {opts['wire_dtype']}")
    # shared experts run locally (no wire); routed rows travel in int8
    q = hostile("uniform")
    g = torch.Generator().manual_seed(9)
    shared = [torch.randn(1, 32, 24, generator=g, dtype=torch.float64) * 0.3,
              torch.randn(1, 32, 24, generator=g, dtype=torch.float64) * 0.3,
              torch.randn(1, 24, 32, generator=g, dtype=torch.float64) * 0.3]
    exact = mc2.run_local(run_with_shared, 2, args=(q, shared, 2, None))
    wired = mc2.run_local(run_with_shared, 2, args=(q, shared, 2, "int8"))
    for e, w in zip(exact, wired):
        scale = e["out"].abs().max()
        assert 0 < (w["out"] - e["out"]).abs().max() <= bound("int8") * scale
        for a, b in zip(e["shared"], w["shared"]):
            assert (a - b).abs().max() <= bound("int8") * a.abs().max()
