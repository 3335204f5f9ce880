"""A helper thread used as a coroutine of its caller, with the caller's thread-local state.

``mc2.forward_backward`` runs micro-batch n+1's forward (the user's own ``loss_fn``, which
calls mc2 deep inside the model and cannot be suspended half-way by a generator) in such a
thread, handing over at fixed points (:mod:`mc2.engine.autograd.pairing`). What a forward
depends on that is thread-local goes with it: context variables, autocast regions, the
accelerator's device and stream, saved-tensor hooks, function and dispatch modes, and autograd's
own switch of whether it runs a backward in device threads (TorchTitan's trainer turns that
off in its thread, so that what autograd runs can reach the thread's device meshes).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Any, Callable, Iterator

import torch

from mc2.engine.transport.deadline import Abandoned


def _autocast_regions() -> list[tuple[str, torch.dtype, bool]]:
    """The autocast regions enabled in this thread (thread-local state a forward depends
    on), by device type, with whether autocast caches its casts of the weights (also the
    thread's: a caller's ``cache_enabled=False`` holds in the paired forwards too)."""
    kinds = ["cpu"] + ([torch.accelerator.current_accelerator().type]
                       if torch.accelerator.is_available() else [])
    cache = torch.is_autocast_cache_enabled()
    return [(kind, torch.get_autocast_dtype(kind), cache) for kind in kinds
            if torch.is_autocast_enabled(kind)]


def _caller_stream() -> Any:
    """The calling thread's current accelerator stream (CUDA, or any other accelerator torch
    knows: an NPU's, an XPU's), or ``None`` on a CPU or where the accelerator was never
    initialised here (nothing to carry, and asking would initialise it)."""
    if not torch.accelerator.is_available():
        return None
    backend = getattr(torch, torch.accelerator.current_accelerator().type, None)
    initialised = getattr(backend, "is_initialized", None)
    if initialised is not None and not initialised():
        return None
    return torch.accelerator.current_stream()


def _mode_stacks() -> tuple[list[Any], list[Any]]:
    """The calling thread's ``TorchFunctionMode`` and ``TorchDispatchMode`` stacks, bottom
    first (a tracing mode would be among the dispatch modes: :func:`tracing_mode` refuses a
    pairing under one before any forward is carried)."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_function_mode_stack(), _get_current_dispatch_mode_stack()


def tracing_mode() -> str | None:
    """The name of the tracing mode that runs (fake tensors, ``make_fx``'s proxies,
    functionalization, or any pre-dispatch mode), or ``None``: its state belongs to the thread
    that entered it, so no forward can run beside it in another thread."""
    for key in torch._C._TorchDispatchModeKey.__members__.values():
        mode = torch._C._get_dispatch_mode(key)
        if mode is not None:
            return type(mode).__name__
    if torch._ops._len_torch_dispatch_stack_pre_dispatch() > 0:
        return "a pre-dispatch mode (make_fx(pre_dispatch=True), export)"
    return None


def traced_step() -> str | None:
    """Why a step cannot be paired here because of :func:`tracing_mode`, or ``None``."""
    if (mode := tracing_mode()) is None:
        return None
    return (f"the step runs under {mode}, a tracing mode whose state belongs to this "
            "thread, and a paired forward runs in another")


@contextlib.contextmanager
def _modes_entered(functions: list[Any], dispatches: list[Any]) -> Iterator[None]:
    """``functions`` and ``dispatches`` pushed onto this thread's mode stacks, in order (not
    entered again: a mode's ``__enter__`` may reset what it counts), and at the end every
    mode popped, whatever the job pushed or popped itself, and the thread's default device
    forgotten: the thread serves the next steps, and a mode left on it (a ``DeviceContext``
    that ``torch.set_default_device`` in a forward pushed below the carried ones) would run
    in their forwards."""
    from torch.overrides import _pop_mode as pop_function, _push_mode as push_function
    from torch.utils._python_dispatch import _pop_mode as pop_dispatch, _push_mode as push_dispatch

    for mode in functions:
        push_function(mode)
    for mode in dispatches:
        push_dispatch(mode)
    try:
        yield
    finally:
        for depth, pop in ((torch._C._len_torch_dispatch_stack, pop_dispatch),
                           (torch._C._len_torch_function_stack, pop_function)):
            while depth() > 0:
                try:
                    pop()
                except RuntimeError:  # nothing it can pop (an infra slot): leave it
                    break
        device = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)
        if device is not None and getattr(device, "device_context", None) is not None:
            device.device_context = None


class Partner:
    """Functions run one after another in one helper thread, each as a coroutine of the
    caller: :meth:`start` hands it the next, :meth:`resume` runs it until it calls
    :meth:`pause` (from inside, in its thread) or ends; the caller waits meanwhile, so the two
    never run at once. Each function takes the caller's context variables, autocast regions,
    accelerator device and stream, saved-tensor hooks and default device as they were at
    :meth:`start` (a forward in the caller's autocast stays in it, one under activation
    offload offloads), its autograd threading switch, and its
    ``TorchFunctionMode`` and ``TorchDispatchMode`` stacks (the same mode objects, pushed
    without entering them again: a mode's ``__enter__`` may reset what it counts).

    One thread for all the functions of a step, not one each (a thread's first parallel
    kernel makes it a team of intra-op threads, and a new team per micro-batch costs), kept
    for the next steps (:class:`_Process`). Its thread is a daemon that waits between
    steps."""

    def __init__(self) -> None:
        self._run = threading.Semaphore(0)  # the partner's turn
        self._back = threading.Semaphore(0)  # the caller's turn
        self._thread: threading.Thread | None = None
        self._job: Callable[[], Any] | None = None
        self._begun = self._cancelled = False
        self._turn = False  # the partner's turn, not yet handed back (see settle)
        self.resumed_by: int | None = None  # the thread that last handed it the turn
        self.done, self.result, self.error = True, None, None

    def start(self, fn: Callable[[], Any]) -> None:
        """The next function to run (the previous one must have finished)."""
        context, regions = contextvars.copy_context(), _autocast_regions()
        # a new thread starts on device 0 and its default stream: the caller's, carried over
        stream = _caller_stream()
        # thread-local too: activation offload's (or a checkpoint's) saved-tensor hooks, and
        # the modes (a quantiser's, a counter's; torch.set_default_device's is one)
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        modes = _mode_stacks()
        threads = torch.autograd.is_multithreading_enabled()

        def job() -> Any:
            with contextlib.ExitStack() as stack:
                if stream is not None:  # the thread's own: each job sets it anew
                    torch.accelerator.set_device_index(stream.device.index)
                    torch.accelerator.set_stream(stream)
                stack.enter_context(_modes_entered(*modes))
                stack.enter_context(torch.autograd.set_multithreading_enabled(threads))
                if hooks is not None:
                    stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*hooks))
                for kind, dtype, cache in regions:
                    stack.enter_context(torch.autocast(kind, dtype=dtype, cache_enabled=cache))
                return context.run(fn)

        self._job, self.done, self.result, self.error = job, False, None, None
        self._begun = self._cancelled = False

    def _main(self) -> None:
        while True:
            self._run.acquire()
            job, self._job = self._job, None
            if job is None:  # closed
                return
            self._begun = True
            try:
                self.result = job()
            except BaseException as exc:  # noqa: BLE001 - raised in the caller by finish()
                self.error = exc
            finally:
                del job  # the micro-batch and its context: not kept until the next step
                self.done = True
                self._back.release()

    def running_here(self) -> bool:
        return self._thread is threading.current_thread()

    def resume(self) -> None:
        """Run the current function to its next pause (or its end)."""
        if self.done:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name="mc2-paired-forward",
                                            daemon=True)
            self._thread.start()
        self._turn = True
        self.resumed_by = threading.get_ident()
        self._run.release()
        self._back.acquire()
        self._turn = False

    def settle(self, seconds: float) -> bool:
        """After the caller was interrupted (Ctrl-C) in :meth:`resume`, the partner may still
        hold the turn: wait up to ``seconds`` for it to hand back (its next pause, or its
        end). Whether the turns are known again (the partner can then be cancelled and
        kept)."""
        if not self._turn:
            return True
        if not self._back.acquire(timeout=seconds):
            return False
        self._turn = False
        return True

    def pause(self) -> None:
        """Hand back to the caller (called from the partner's own thread); raises
        :class:`Abandoned` there where the caller gave the function up (:meth:`cancel`)."""
        self._back.release()
        self._run.acquire()
        if self._cancelled:
            raise Abandoned("mc2 pairing: the step failed while this forward was paired")

    def finish(self) -> Any:
        """Run the current function to its end; its result (its exception raised here)."""
        while not self.done:
            self.resume()
        result, error, self.result, self.error = self.result, self.error, None, None
        if error is not None:
            raise error
        return result

    def cancel(self) -> None:
        """Give the current function up (the step failed while it was suspended): it
        unwinds from its pause, leaving the transfers it issued in flight (its peers may never
        complete them), and the thread is free for the next step. A function not yet begun
        never runs."""
        if self.done:  # ended (perhaps with an error, whose frames it would keep)
            self.result = self.error = None
            return
        self._cancelled = True
        if not self._begun:
            self._job, self.done = None, True
            return
        while not self.done:
            self.resume()
        self.result = self.error = None
