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


# docs/accelerators.md: per call, 2 device-to-host reads (handshake, counts) and 1 upload in the
# forward, none of either in the backward, whatever K, flat or 2-D
BUDGET = {"forward": {"reads": 2, "uploads": 1}, "backward": {"reads": 0, "uploads": 0}}
# ExtraRead (tests/workers_accel.py) in front of the call: one read more each way
WITH_EXTRA_READ = {"forward": {"reads": 3, "uploads": 1}, "backward": {"reads": 1, "uploads": 0}}
# capacity mode (MC2Config(capacity=N)): nothing at all, each way
NOTHING = {"forward": {"reads": 0, "uploads": 0}, "backward": {"reads": 0, "uploads": 0}}


def _assert_counts(rank: int, name: str, counted: dict, want: dict) -> None:
    got = {phase: {kind: counted[phase][kind] for kind in ("reads", "uploads")}
           for phase in ("forward", "backward")}
    where = "\n".join(f"  {phase}: {w}" for phase in ("forward", "backward")
                      for w in counted[phase]["where"])
    assert got == want, f"rank {rank} {name}: counted {got}, budget {want}\n{where}"


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks, 2-D"])
def counted(request):
    if request.param == 4:
        return request.param, mc2.run_local(host_syncs, 4, ranks_per_node=2)
    return request.param, mc2.run_local(host_syncs, 2)


def test_two_reads_one_upload_none_in_the_backward(counted) -> None:
    """Exactly 2 device-to-host reads and 1 upload per forward, none in the backward, on every
    rank, for K = 1, 4, 8, serial or overlapped, flat or 2-D, wire formats, shared experts,
    rows once per destination, MoELayer with losses; none at all in capacity mode; and a call
    with one deliberate extra read each way counts exactly one
    more (a counter that saw nothing, or missed the backward, would fail here)."""
    world, results = counted
    assert len(results) == world
    names = set(results[0])
    for rank, cases in enumerate(results):
        assert set(cases) == names and cases, f"rank {rank} counted {sorted(cases)}"
        for name, c in cases.items():
            want = WITH_EXTRA_READ if "extra read" in name else \
                NOTHING if "capacity" in name else BUDGET
            _assert_counts(rank, name, c, want)
            if "extra read" in name:  # the one more is the deliberate one, on each side
                for phase in ("forward", "backward"):
                    probe = [w for w in c[phase]["where"] if "workers_accel.py" in w]
                    assert len(probe) == 1, (rank, name, phase, c[phase]["where"])
    if world == 2:
        assert {"K1", "K4", "K8", "K1 + extra read", "K4 + extra read"} <= names
    else:
        assert {"K1 2d", "K4 2d"} <= names


def test_counter_sees_what_a_gpu_would_stall_on() -> None:
    from mc2.observation.host_syncs import HostSyncCounter

    t = torch.arange(6)
    with HostSyncCounter() as c:
        t.tolist(), int(t[0]), bool(t[1] > 0), t.nonzero(), torch.bincount(t), t[t > 2]
        torch.repeat_interleave(t, t), torch.tensor([1, 2]), t.unique()
        torch.repeat_interleave(t, t, output_size=15), torch.zeros(3), t.sum()  # not syncs
    assert c.reads == 8 and c.uploads == 1, c.by_op


def test_an_upload_counts_once_on_a_device() -> None:
    """On a device mc2's upload makes a CPU tensor of the host numbers, then copies it over: one
    upload, not two (``meta`` stands in for the accelerator; on CPU there is no copy)."""
    from mc2.engine.transport.host import upload
    from mc2.observation.host_syncs import HostSyncCounter

    for device in ("cpu", "meta"):
        with HostSyncCounter() as c:
            t = upload([1, 2, 3], torch.device(device))
        assert t.device.type == device and dict(c.by_op) == {"upload:tensor": 1}, c.where
    on_device = torch.empty(2, device="meta")
    with HostSyncCounter() as c:
        torch.tensor([1.0, 2.0]).to(torch.float64).contiguous().to("meta")  # made, sent: 1
        on_device.copy_(torch.as_tensor([3.0, 4.0]))  # made, sent: 1
        torch.zeros(2).to("meta", non_blocking=True)  # computed on the host, sent: 1
    assert dict(c.by_op) == {"upload:tensor": 1, "upload:as_tensor": 1, "upload:to": 1}, c.where


@pytest.mark.parametrize("entry", ["Tensor.backward", "autograd.backward", "autograd.grad",
                                   "reentrant checkpoint"])
def test_counter_sees_inside_the_backward(entry: str) -> None:
    """Torch hands a TorchFunctionMode a whole backward as one call, with the mode off while it
    runs: the counter must put itself back on, or every backward would count 0."""
    from torch.utils.checkpoint import checkpoint

    from mc2.observation.host_syncs import HostSyncCounter
    from tests.workers_accel import ExtraRead

    x = torch.randn(4, requires_grad=True)
    if entry == "reentrant checkpoint":  # the backward runs the forward again, then backward
        y = checkpoint(ExtraRead.apply, x, use_reentrant=True)
    else:
        y = ExtraRead.apply(x)
    checks = torch.autograd.has_torch_function
    with HostSyncCounter() as c:
        loss = (y * 2).sum()
        if entry == "autograd.grad":
            torch.autograd.grad(loss, x)
        elif entry == "autograd.backward":
            torch.autograd.backward(loss, retain_graph=False)
        else:
            loss.backward(gradient=torch.ones(()))
    want = {"read:item": 1} if entry != "reentrant checkpoint" else {"read:item": 1,
                                                                     "read:tolist": 1}
    assert dict(c.by_op) == want, c.where
    assert torch.autograd.has_torch_function is checks, "the entry's check was left bypassed"


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
        for name, c in r["counted"].items():
            _assert_counts(rank, f"stream flat {name}", c, BUDGET)
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
    assert len(results) == world
    for rank, r in enumerate(results):
        assert all(t is None for t in r["waits"]) and r["waits"]
        assert set(r["counted"]) == {"K1", "K3"}
        # each chained transfer holds its rows and the plan's stage-2 gather, which the side
        # stream's permutation reads (a pass that abandons the transfer drops the plan)
        assert all(r["held"]) and (bool(r["held"]) == (per_node < world)), r["held"]
        for name, c in r["counted"].items():  # the chained 2-D stages add no read
            _assert_counts(rank, f"stream 2-D {name}", c, BUDGET)
        for got in r["results"]:
            torch.testing.assert_close(got["out"], want[rank], rtol=0, atol=1e-10)
            torch.testing.assert_close(got["x"], grads[rank], rtol=0, atol=1e-10)


def test_a_stream_backend_whose_waits_block_the_host_still_chains_the_2d_stages() -> None:
    """NCCL under ``TORCH_NCCL_BLOCKING_WAIT`` (emulated: the stream backend's waits taken
    for host waits, with the call's deadline): its collectives still run on device streams,
    so the 2-D stages stay chained in the caller's thread (before, they went to the
    communication thread, which issued NCCL collectives beside the caller's, in an order
    that differs from rank to rank); results exact. Its transfers are timed by the device's
    clock, the end stamped on the observer stream after the work's future made it wait for
    the collective, as the timeline reads them: before, by the host's clock at the
    collective's enqueue, whose floats a device clock cannot read."""
    results = mc2.run_local(fake_stream_worker, 4, args=("2d", True), ranks_per_node=2,
                            backend=fake_stream_backend.NAME,
                            before_init=fake_stream_backend.install)
    p = make_problem(4, "uneven", seed=1)
    want, grads = _reference(p)
    for rank, r in enumerate(results):
        assert r["style"] is False and any(t is not None for t in r["waits"]), r["waits"]
        assert r["held"] and all(r["held"]), r["held"]
        assert r["transfers"] and r["observer_stamps"] == 2 * r["transfers"], r
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


def test_capacity_calls_beside_dropless_calls_read_nothing() -> None:
    """A dropless call's drift window on the same planner moved the count the capacity call's
    handshake carries, and each capacity call then checked its data again: a read every call
    (found by a review). On a host group that handshake compares the count anyway: nothing
    read after the first call with both shapes locked."""
    from tests.workers_accel import capacity_beside_dropless

    for r in mc2.run_local(capacity_beside_dropless, 2, args=(30,)):
        assert r["settled"] and len(r["reads"]) > 8, r
        assert sum(r["reads"][1:]) == 0, r["reads"]
