"""The accelerator path, checked on CPU: host syncs counted, stream-backend waits, backend by
device, autocast.

No GPU is needed: a ``TorchFunctionMode`` counts the reads and uploads a call would make on
one; a Python process-group backend over Gloo behaves like NCCL as far as waits go
(:mod:`tests.fake_stream_backend`).
"""

from __future__ import annotations

import pytest
import torch

import mc2
from tests import fake_stream_backend
from tests.problems import make_problem
from tests.reference import dense_moe
from tests.workers_accel import (
    autocast_bf16,
    backend_by_device,
    fake_stream_backend as fake_stream_worker,
    fake_stream_stall,
    host_syncs,
)


def _reference(p, rank_slices=True):
    xs = [x.clone().requires_grad_(True) for x in p.xs]
    out = dense_moe(torch.cat(xs), p.w_up, p.w_gate, p.w_down, torch.cat(p.ids),
                    torch.cat(p.rws))
    out.backward(torch.cat(p.grad_outs))
    return out.detach().split([x.shape[0] for x in p.xs]), [x.grad for x in xs]


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks, 2-D"])
def counted(request):
    if request.param == 4:
        return mc2.run_local(host_syncs, 4, ranks_per_node=2)
    return mc2.run_local(host_syncs, 2)


def test_two_reads_one_upload_none_in_the_backward(counted) -> None:
    """At most 2 device-to-host reads and 1 upload per forward, none in the backward, for any K,
    serial or overlapped, flat or 2-D, wire formats, shared experts, MoELayer with losses."""
    for rank, cases in enumerate(counted):
        assert cases, "nothing was counted"
        for name, c in cases.items():
            fwd, bwd = c["forward"], c["backward"]
            where = "\n".join(fwd["where"] + bwd["where"])
            assert fwd["reads"] <= 2, f"rank {rank} {name}: {fwd['reads']} reads\n{where}"
            assert fwd["uploads"] <= 1, f"rank {rank} {name}: {fwd['uploads']} uploads\n{where}"
            assert bwd["reads"] == 0 and bwd["uploads"] == 0, f"rank {rank} {name}\n{where}"


def test_counter_sees_what_a_gpu_would_stall_on() -> None:
    from mc2.observation.host_syncs import HostSyncCounter

    t = torch.arange(6)
    with HostSyncCounter() as c:
        t.tolist(), int(t[0]), bool(t[1] > 0), t.nonzero(), torch.bincount(t), t[t > 2]
        torch.repeat_interleave(t, t), torch.tensor([1, 2]), t.unique()
        torch.repeat_interleave(t, t, output_size=15), torch.zeros(3), t.sum()  # not syncs
    assert c.reads == 8 and c.uploads == 1, c.by_op


@pytest.fixture(scope="module")
def fake_flat():
    return mc2.run_local(fake_stream_worker, 2, args=("flat",), backend=fake_stream_backend.NAME,
                         before_init=fake_stream_backend.install)


def test_stream_backend_never_waits_with_a_timeout(fake_flat) -> None:
    p = make_problem(2, "uneven", seed=1)
    want, grads = _reference(p)
    for rank, r in enumerate(fake_flat):
        assert r["backend"] == fake_stream_backend.NAME and r["style"] is True
        assert len(r["waits"]) > 10, "the stream path was not taken"
        assert all(t is None for t in r["waits"]), r["waits"]
        assert r["transfers"] == 12, "3 micro-batches x 2 transfers x 2 passes observed"
        for got in r["results"]:
            torch.testing.assert_close(got["out"], want[rank], rtol=0, atol=1e-10)
            torch.testing.assert_close(got["x"], grads[rank], rtol=0, atol=1e-10)


@pytest.mark.parametrize("world,per_node", [(4, 2), (2, 2), (2, 1)],
                         ids=["2 nodes x 2", "one node (inter-node stage of one)",
                              "2 nodes x 1 (intra-node stage of one)"])
def test_stream_backend_2d_chains_stages_without_a_thread(world: int, per_node: int) -> None:
    results = mc2.run_local(fake_stream_worker, world, args=("2d",), ranks_per_node=per_node,
                            backend=fake_stream_backend.NAME,
                            before_init=fake_stream_backend.install)
    p = make_problem(world, "uneven", seed=1)
    want, grads = _reference(p)
    for rank, r in enumerate(results):
        assert all(t is None for t in r["waits"]) and r["waits"]
        for got in r["results"]:
            torch.testing.assert_close(got["out"], want[rank], rtol=0, atol=1e-10)
            torch.testing.assert_close(got["x"], grads[rank], rtol=0, atol=1e-10)


def test_stream_backend_stall_is_a_comm_timeout_from_the_watchdog() -> None:
    # rank 1 holds its 3rd All-to-All (counts, dispatch 0, dispatch 1) for 4 s; deadline 1 s
    results = mc2.run_local(
        fake_stream_stall, 2, backend=fake_stream_backend.NAME,
        before_init=fake_stream_backend.install, deadline_s=120,
        rank_env=lambda r: {"MC2_FAKE_STALL": "1:2:4"})
    first = results[0]
    assert first["error"], "rank 0 did not time out"
    assert first["error"]["operation"] == "dispatch"
    assert first["error"]["micro_batch"] == 1 and first["error"]["phase"] == "forward"
    assert first["error"]["waited"] >= 1.0
    assert first["aborted"], "the watchdog did not abort the group"
    assert results[1]["error"], "rank 1 was left waiting"
    for r in results:
        assert all(t is None for t in r["waits"])


@pytest.mark.parametrize("backend", ["cpu:gloo,cuda:gloo", None], ids=["mixed", "default"])
def test_backend_is_the_one_serving_the_device(backend) -> None:
    results = mc2.run_local(backend_by_device, 2, backend=backend)
    p = make_problem(2, "uniform")
    want, _ = _reference(p)
    for rank, r in enumerate(results):
        assert r["serving_cpu"] == "gloo"
        assert r["fallback"] is None and not r["warnings"], r
        assert "transfer" in r["kinds"] and "wait" in r["kinds"], "ran synchronously"
        torch.testing.assert_close(r["out"], want[rank], rtol=0, atol=1e-10)


def test_bf16_autocast_matches_the_dense_reference() -> None:
    results = mc2.run_local(autocast_bf16, 2)
    p = make_problem(2, "uneven", dtype=torch.float32, hidden=32, ffn=16, seed=2)
    p64 = make_problem(2, "uneven", dtype=torch.float64, hidden=32, ffn=16, seed=2)
    want, grads = _reference(p64)
    for rank, r in enumerate(results):
        assert r["dtype"] == torch.bfloat16, "autocast computes in its dtype"
        assert all(d == torch.float32 for d in r["w_dtypes"]), "grads keep the params' dtype"
        scale = want[rank].abs().max()
        assert (r["out"].double() - want[rank]).abs().max() <= 3e-2 * scale
        gscale = grads[rank].abs().max()
        assert (r["x"].double() - grads[rank]).abs().max() <= 3e-2 * gscale
    assert p.xs[0].dtype == torch.float32
