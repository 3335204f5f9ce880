"""A process-group backend that behaves, as far as mc2 can tell, like NCCL or HCCL, on CPU.

It is a Python ``ProcessGroup`` over a real Gloo backend (so the data moves and results can be
checked), registered with ``torch.distributed`` under :data:`NAME` and declared to mc2 as a
stream backend. Its works record every ``wait`` and the timeout it was called with, which is
what the tests check: mc2 must never wait on a stream backend with a timeout (that would
busy-poll the host on NCCL). Two more behaviours of a stream backend are emulated:

* an abort (what mc2's watchdog does to every group on a timeout) makes every blocked wait
  raise, as an aborted NCCL communicator ends its kernels (``STATE`` counts the aborts and the
  groups of the last one);
* ``MC2_FAKE_STALL="<rank>:<n>:<seconds>"`` delays that rank's ``n``-th All-to-All (0-based,
  counting the counts exchange), a peer that stalls in the middle of the pipeline.

A real stream wait returns at once and the device waits; on CPU there is no device, so the
emulated wait blocks until the data is there (results stay checkable). The deadline path does
not depend on it: mc2 registers the work with its watchdog before it waits.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

NAME = "mc2fakestream"
WAITS: list[Any] = []  # the timeout argument of every wait, in order
STATE = {"aborted": False, "alltoalls": 0}


class FakeStreamWork(dist._Work):
    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner

    def wait(self, timeout: Any = None) -> bool:
        # ``work.wait()`` reaches here with the binding's default, ``kNoTimeout`` (0 ms)
        WAITS.append(None if timeout in (None, timedelta(0)) else timeout)
        while not self.inner.is_completed():
            if STATE["aborted"]:
                raise RuntimeError("fake stream backend: communicator aborted")
            time.sleep(0.001)
        return self.inner.wait()

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def get_future(self) -> Any:
        return self.inner.get_future()


class FakeStreamGroup(dist.ProcessGroup):
    def __init__(self, store: Any, rank: int, size: int, timeout: Any) -> None:
        super().__init__(rank, size)
        self.inner = dist.ProcessGroupGloo(dist.PrefixStore(f"{NAME}-inner", store), rank,
                                           size, timeout)
        self.my_rank = rank
        self.options = self.inner.options  # its timeout, where torch's backends keep theirs

    def getBackendName(self) -> str:  # noqa: N802 - the binding's name
        return NAME

    def _stall(self) -> None:
        spec = os.environ.get("MC2_FAKE_STALL")
        count = STATE["alltoalls"]
        STATE["alltoalls"] += 1
        if spec:
            rank, nth, seconds = spec.split(":")
            if int(rank) == self.my_rank and int(nth) == count:
                time.sleep(float(seconds))

    def allreduce(self, tensors: Any, opts: Any) -> FakeStreamWork:
        return FakeStreamWork(self.inner.allreduce(tensors, opts))

    def alltoall_base(self, out: Any, inp: Any, out_splits: Any, in_splits: Any,
                      opts: Any) -> FakeStreamWork:
        self._stall()
        return FakeStreamWork(self.inner.alltoall_base(out, inp, out_splits, in_splits, opts))

    def allgather(self, outs: Any, ins: Any, opts: Any) -> FakeStreamWork:
        return FakeStreamWork(self.inner.allgather(outs, ins, opts))

    def _allgather_base(self, out: Any, inp: Any, opts: Any) -> FakeStreamWork:
        return FakeStreamWork(self.inner._allgather_base(out, inp, opts))

    def barrier(self, opts: Any) -> FakeStreamWork:
        return FakeStreamWork(self.inner.barrier(opts))

    def broadcast(self, tensors: Any, opts: Any) -> FakeStreamWork:
        return FakeStreamWork(self.inner.broadcast(tensors, opts))


def install() -> None:
    """Register the backend with torch.distributed and declare it a stream backend to mc2;
    aborts from mc2's watchdog reach the emulated communicator."""
    from mc2.engine.transport.backend import register_stream_backend
    from mc2.engine.transport.watchdog import watchdog

    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, FakeStreamGroup, devices=["cpu"])
    register_stream_backend(NAME)
    watchdog().abort = lambda groups: STATE.update(aborted=True, aborted_groups=len(groups),
                                                   aborts=STATE.get("aborts", 0) + 1)
