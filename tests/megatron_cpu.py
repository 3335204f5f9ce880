"""CPU shims for megatron-core 0.16.1 in the tests (Gloo ranks, a CPU-only torch).

Megatron-Core assumes CUDA in places that have no arithmetic in them: its alltoall dispatcher
copies the split sizes to the host on a side stream and waits on an event, buffers are
allocated on ``torch.cuda.current_device()``, and a TransformerEngine name is referenced
whether or not TransformerEngine is installed, and the legacy ``GroupedMLP`` calls the
``grouped_gemm`` package's CUDA kernel (a stand-in with its contract, one matmul per expert:
the same products). :func:`install` replaces exactly those, in the
calling process only (each rank calls it first thing; the pytest process never does, so no
other test sees a patched ``torch.cuda``). Nothing here computes: a stream is a no-op on CPU,
the current device is ``"cpu"``, and the split sizes become the Python lists that
``all_to_all_single`` takes, the same numbers Megatron reads on a GPU.

Written for this project (the peers' ``patch_mcore.py`` was read for which calls need it).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class _HostEvent:
    """A CUDA event on a CPU: everything has already happened when it is asked."""

    def record(self, *args: Any, **kwargs: Any) -> None:
        return None

    def wait(self, *args: Any, **kwargs: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _HostStream:
    """A CUDA stream on a CPU: work is issued in program order, so every wait is a no-op."""

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        return None

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        return None

    def record_event(self, *args: Any, **kwargs: Any) -> _HostEvent:
        return _HostEvent()

    def synchronize(self) -> None:
        return None


_STREAM = _HostStream()
_INSTALLED = False


class _HostRNGTracker:
    """Megatron's CUDA RNG tracker (named generator states that dropout forks into) over the
    CPU generator. Megatron-LM's ``model_parallel_cuda_manual_seed`` would call
    ``torch.cuda.manual_seed``; here each named state is a CPU state seeded as Megatron seeds
    it. (The tests run without dropout; the states are only forked into and out of.)"""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}

    def is_initialized(self) -> bool:
        return True

    def reset(self) -> None:
        self.states_ = {}

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Any:
        if name not in self.states_:
            raise KeyError(f"rng state {name!r} was not added")
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


def install() -> None:
    """Install the shims in this process (idempotent). Call before Megatron builds a layer."""
    global _INSTALLED
    if _INSTALLED:
        return
    torch.cuda.Stream = lambda *a, **k: _STREAM  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda *a, **k: _STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.Event = lambda *a, **k: _HostEvent()  # type: ignore[assignment,misc]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]

    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    # without TransformerEngine, 0.16.1 references te_general_gemm without defining it
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # the dispatcher turns split sizes into numpy only for CUDA tensors; on a CPU they would
    # stay tensors, which torch 2.13's all_to_all_single refuses as split sizes
    to_host = moe_utils.maybe_move_tensor_to_cpu

    def host_splits(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = host_splits

    # the RNG tracker that attention's dropout forks into, on the CPU generator
    import megatron.core.tensor_parallel.random as random

    random._CUDA_RNG_STATE_TRACKER = _HostRNGTracker()
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    seed_rng(1234)

    # the legacy GroupedMLP calls the grouped_gemm package (CUDA kernels); a stand-in with
    # its gmm's contract, one matmul per expert
    import megatron.core.transformer.moe.grouped_gemm_util as grouped_gemm_util

    if grouped_gemm_util.grouped_gemm is None:
        grouped_gemm_util.grouped_gemm = _GroupedGemm
        grouped_gemm_util.ops = _GroupedGemm.ops
    _INSTALLED = True


def _gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False
         ) -> torch.Tensor:
    """``grouped_gemm.ops.gmm``: rows of ``a`` grouped by ``batch_sizes`` (on the host), each
    group times its own ``b[e]`` (``[E, K, N]``, or ``[E, N, K]`` with ``trans_b``)."""
    groups = a.split(batch_sizes.tolist())
    return torch.cat([g @ (w.t() if trans_b else w) for g, w in zip(groups, b)])


class _GroupedGemm:
    """What Megatron reads of the ``grouped_gemm`` module: ``ops.gmm``."""

    class ops:  # noqa: N801  the package's name
        gmm = staticmethod(_gmm)


def seed_rng(seed: int, rank: int = 0) -> None:
    """Seed the named RNG states as ``model_parallel_cuda_manual_seed(seed)`` does (the
    model-parallel state ``seed + 2718``, the expert-parallel one also by ``rank``), on the CPU
    generator."""
    import megatron.core.tensor_parallel.random as random

    tracker = random._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718)
    tracker.add(random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + 100 * (rank + 1))
    tracker.add(random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)


class _TorchOnCpu:
    """``torch`` as Megatron's pipeline schedules see it, but for their one CUDA allocation
    (the no-pipelining schedule's token count, ``torch.zeros(..., device="cuda")``), which is
    made on the CPU: no arithmetic depends on where it lives."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def cpu_schedules() -> None:
    """Let Megatron's ``forward_backward_no_pipelining`` run on a CPU (this process only)."""
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _TorchOnCpu()
