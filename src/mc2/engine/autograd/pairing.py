"""One micro-batch's forward run beside another's backward, layer by layer.

Under gradient accumulation the forward of micro-batch n+1 does not depend on the backward of
micro-batch n (the parameters do not change between them; only their ``.grad`` does, which no
forward reads). So n+1's forward can fill the waits of n's backward, and n's backward can fill
the waits of n+1's forward: each one's All-to-Alls travel while the other computes. Batch
overlap alone cannot do that: its backward begins after its forward ends, and a forward
carries more communication than compute while a backward carries more compute
(``docs/batch_overlap.md``).

How: n's backward is autograd's, running the eager calls of n's forward
(:mod:`mc2.engine.autograd.function`: a model that runs its layers through mc2's layer loop
runs them whole under a pairing, as its framework does); each call stops where it waits for
a transfer it just issued (the output gradients' dispatch, the input gradients' combine), and
there it *gives way* (:meth:`Pairing.give_way`). n+1's forward is the user's own
``loss_fn(model, micro_batch)``, which cannot be suspended half-way by a generator (the
model's forward calls mc2 deep inside), so it runs in a helper thread used as a coroutine
(:class:`Partner`): exactly one of the two threads runs at any time, handing over at fixed
points. Given way to, the partner runs n+1's forward, whose eager calls hand back between
their steps, up to the next transfer it issues. Everything is issued in the same order on
every rank, from one thread at a time, so the collectives of a group meet in one order.
Results are those of the sequential loop: the same forwards on the same parameters, the same
backwards, each ``.grad`` accumulated in micro-batch order.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
from typing import Any, Callable, ContextManager, Iterator, TypeVar

import torch

from mc2.engine.autograd.autograd_watch import EngineWatch, watched
from mc2.engine.autograd.partner import Partner, traced_step, tracing_mode
from mc2.engine.decide.batch_split import say_once
from mc2.engine.transport.comm import host_max
from mc2.engine.transport.deadline import Abandoned

T = TypeVar("T")

_ACTIVE: contextvars.ContextVar["Pairing | None"] = contextvars.ContextVar(
    "mc2_pairing", default=None)


class _Process:
    """What the pairings of this process share.

    ``active``: the pairings that run. On an accelerator a checkpoint's recompute runs in
    autograd's device thread, where the context variable is not set, and it must still run
    the K of "auto" under a pairing and give way where its backward waits
    (:func:`current_pairing`).

    ``idle``: partners whose thread waits for the next step's forwards. A thread kept from
    step to step keeps its allocator arena warm: a new thread per step gets an arena whose
    memory was handed back, and every paired forward's activations page-fault in again
    (docs/forward_backward.md, 'The partner thread kept from step to step').

    ``engine``: autograd's engine entry, wrapped while a step watches it where an
    accelerator is present (:mod:`mc2.engine.autograd.autograd_watch`)."""

    def __init__(self) -> None:
        self.active: list[Pairing] = []
        self.idle: list[Partner] = []
        self.engine = EngineWatch()


_PROCESS = _Process()
# a forked child has none of the parent's threads: its partners would wait forever
os.register_at_fork(after_in_child=_PROCESS.idle.clear)

# micro-batches inside each paired call whose config says "auto" (batch overlap's run K = 1,
# the other half of the batch giving the overlap): a paired backward hides only part of a
# forward transfer, and MC2's own split hides more of the rest (K = 1 measured slower:
# docs/forward_backward.md)
PAIRED_SPLITS = 2

# how long an interrupted step waits for its partner to hand the turn back before dropping it
SETTLE_S = 5.0


class Pairing:
    """The pairing of one ``forward_backward`` call: the partner forward that the running
    backward gives way to, and how many eager calls ran under it (none: the model calls no
    mc2 pipeline, and nothing could be paired)."""

    def __init__(self) -> None:
        self.partner: Partner | None = None
        self.calls = 0  # eager calls made under it
        self.traced = 0  # calls run as the operator inside a compiled graph (whole)
        # held by the thread that runs the partner's turn from a backward's wait: the step's
        # own, or autograd's device thread on an accelerator (see stop)
        self._turns = threading.Lock()

    def give_way(self) -> None:
        """Where a backward waits for a transfer it issued: the partner forward runs up to
        its next transfer (nothing where no forward is paired with this backward, or the
        step ended: :meth:`stop`)."""
        partner = self.partner
        if partner is None or partner.running_here():
            return
        with self._turns:
            if self.partner is partner:
                partner.resume()
        if partner.done and partner.error is not None:
            # the paired forward failed: the step has, here. Going on, this rank's backward
            # issued its collectives where its peers' paired forwards issue theirs (the
            # groups' orders crossed: every rank waited out its deadline, and the error, kept
            # for finish(), was dropped with the partner); raised now, the rank stops
            raise partner.error

    def stop(self, partner: Partner, seconds: float) -> bool:
        """The step failed in its own thread: no more turns from a backward's wait. On an
        accelerator another thread may run a turn now (autograd's device thread, while a
        node of the backward that the step's thread ran, a CPU one, raised and ended the
        backward there): that turn ends first, at the partner's next transfer (up to
        ``seconds``), and that thread alone takes it back (two threads waiting for one
        hand-over: one would wait forever). A turn the step's thread left open (Ctrl-C in a
        hand-over) is waited for as :meth:`Partner.settle` does. Whether the turns are known
        again (the partner can then be given up and kept)."""
        if not self._turns.acquire(timeout=seconds):
            self.partner = None  # the turn's forward runs on to its end
            return False
        try:
            self.partner = partner  # an open turn pauses at the partner's next transfer
            return partner.settle(seconds)
        finally:
            self.partner = None
            self._turns.release()

    def hand_back(self) -> None:
        """Where a paired forward issued a transfer: the backward it is paired with goes on
        (nothing for a forward that runs alone: the first micro-batch's)."""
        partner = self.partner
        if partner is not None and partner.running_here():
            partner.pause()


TRACED = ("the model's mc2 calls ran as the operator torch.ops.mc2.fused_expert inside a "
          "compiled graph or an exported program (not through mc2.fused_expert), which runs "
          "each call whole: none can hand over to another micro-batch, so nothing can be "
          "paired; pair an eagerly run model, or run the sequential loop")


def current_pairing() -> Pairing | None:
    """The pairing a call runs under (set by ``forward_backward``), or ``None``.

    Inside a backward where the context variable is not set (on an accelerator autograd runs
    the backward, and a reentrant checkpoint's recompute in it, in a device thread of its
    own), the one pairing this process runs: without it a recomputed call's backward would
    never give way, and the paired forward would run after it, unpaired."""
    pairing = _ACTIVE.get()
    if pairing is None and len(_PROCESS.active) == 1 and \
            torch._C._current_graph_task_id() != -1:
        return _PROCESS.active[0]
    return pairing


def paired_config(config: Any) -> Any:
    """An eager call's config under a pairing: ``"auto"`` runs :data:`PAIRED_SPLITS`
    micro-batches (the planner's trials would time the paired forward's work with the call's
    own), the same on every rank (every rank pairs alike). Not a capacity call: which of its
    rows fit their slabs depends on its K where a rank has more tokens than the capacity
    (:func:`mc2.engine.decide.capacity.token_bounds`), so another K would drop, or raise on,
    other rows than the sequential loop's calls (measured: capacity 11-14, 18 tokens, top-1:
    the loop fine, the paired step ``CapacityOverflow``); its K is decided as there."""
    if config.micro_batches == "auto" and config.capacity is None and _PROCESS.active:
        return config.replace(micro_batches=PAIRED_SPLITS)
    return config


@contextlib.contextmanager
def pairing_active(pairing: Pairing) -> Iterator[None]:
    token = _ACTIVE.set(pairing)
    _PROCESS.active.append(pairing)
    try:
        yield
    finally:
        _PROCESS.active.remove(pairing)
        _ACTIVE.reset(token)


class PairedLoop:
    """Micro-batches handed one at a time, as a framework's own accumulation loop calls its
    forward-and-backward once per micro-batch: :meth:`add` runs the micro-batch's forward
    beside the previous one's backward (the first forward alone) and returns the forward's
    result; with ``last=True`` it also runs that micro-batch's backward alone, and the step
    is over (the next :meth:`add` begins another).

    ``backward(result)``: one micro-batch's backward. ``around()``: the context every forward
    and every backward but the last run in (a framework's gradient-sync suspension, FSDP2's
    units held gathered: the last backward reduces). ``unpaired``: the ``ValueError`` raised
    after the first forward where the model made no eager mc2 call, so nothing can be
    paired (every rank alike: every rank runs the same model). ``kept(result)`` of each
    forward is in :attr:`results`, in order, taken right after its backward: a result kept
    whole would keep its autograd graph alive until the last micro-batch, which the
    sequential loop frees at once (docs/forward_backward.md, 'Eight micro-batches').
    ``failed(exception)``: after a step failed anywhere (the last backward too, which runs
    outside ``around()``), what the step left to discard (FSDP2's units gathered, their
    gradients accumulated unsharded).
    ``strict``: a first forward that runs autograd itself on an accelerator (:meth:`_first`,
    agreed on ``group``) is refused; else its step runs unpaired, and ``alone(why)`` is told
    (the caller's decision can then run its later steps sequentially from the start).

    A micro-batch's backward runs one :meth:`add` later than the sequential loop runs it:
    nothing between two calls may read the gradients (a framework's loop reads them after
    the last micro-batch: clipping, the optimizer)."""

    def __init__(self, backward: Callable[[Any], None], *,
                 around: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
                 unpaired: str = "the model made no mc2 call, so nothing can be paired",
                 kept: Callable[[Any], Any] = lambda out: None,
                 failed: Callable[[BaseException], None] = lambda exc: None,
                 strict: bool = True, group: Any = None,
                 alone: Callable[[str], None] = lambda why: None) -> None:
        self._backward, self._around, self._unpaired, self._kept = backward, around, unpaired, kept
        self._failed, self._strict, self._group, self._said_alone = failed, strict, group, alone
        self._alone = False  # this step runs unpaired (its forward runs autograd: _first)
        self._caller: int | None = None  # the thread that runs the step (its first forward)
        self._first_ran_autograd = False
        self._in_first = False  # the step's first forward runs (in the caller's thread)
        self._pairing = Pairing()
        self._scope: contextlib.ExitStack | None = None  # around(); None between steps
        self._pending: Any = None  # the forward whose backward is next
        self._step: Any = None  # the framework's step count of the open step (of_step)
        self._partner: Partner | None = None
        self.results: list[Any] = []

    @property
    def taken(self) -> int:
        """How many micro-batches the running step has taken (0 between steps): each but the
        last one's backward has run."""
        return 0 if self._scope is None else len(self.results) + 1

    def add(self, forward: Callable[[], T], *, last: bool) -> T:
        try:
            # per call: nothing between calls is paired; nothing in a step that runs unpaired
            with pairing_active(self._pairing) if not self._alone else contextlib.nullcontext():
                return self._add(forward, last)
        except BaseException:
            # a turn still running (another thread's, or one Ctrl-C left open) ends at the
            # partner's next transfer, and the partner is given up as after an error
            partner, settled = self._partner, True
            if partner is not None:
                settled = self._pairing.stop(partner, SETTLE_S)
            self._end(keep_partner=settled, failure=sys.exc_info())
            raise

    def of_step(self, step: Any) -> None:
        """The next :meth:`add` belongs to the framework's optimizer step ``step`` (its count):
        a step still open under another count was left unfinished (the framework's loop
        raised or stopped between two calls, and the caller went on) and is ended first
        (:meth:`abandon`), so that this call begins a step instead of pairing its forward
        with a backward of the old one."""
        if self.taken and step != self._step:
            self.abandon(f"step {self._step} was left after {self.taken} micro-batches")
        if not self.taken:
            self._step = step

    def abandon(self, why: str) -> None:
        """End a step its caller left unfinished (its loop raised between two :meth:`add`
        calls, and the next call belongs to another step): as after a failure, the forward
        whose backward never ran is dropped, the contexts see an :class:`Abandoned` and the
        step's state is discarded (``failed``). Nothing where no step is open."""
        if self._scope is None:
            return
        exc = Abandoned(f"mc2 pairing: {why}")
        self._end(failure=(Abandoned, exc, None))

    def _cleaned_up(self, failure: Any, settled: bool) -> None:
        """After a failed step (its contexts exited): ``failed(exception)``, the caller's
        discard of what the step left (FSDP2's units and gradients), unless the partner
        never handed back (it may still use what a discard would free). A cleanup that fails
        in turn is noted on the step's exception, which stays the one raised."""
        exc = failure[1]
        if exc is None or not settled:
            return
        try:
            self._failed(exc)
        except Exception as cleanup:  # noqa: BLE001 - the step's own exception is raised
            exc.add_note(f"mc2: discarding the failed step's state failed too: {cleanup!r}")

    def _add(self, forward: Callable[[], T], last: bool) -> T:
        if self._scope is None:  # the step's first micro-batch: its forward alone
            if (why := traced_step()) is not None:
                raise ValueError(f"mc2 pairing: {why}; run the sequential loop")
            self.results = []
            self._scope = contextlib.ExitStack()
            self._scope.enter_context(self._around())
            if watched():  # autograd in a forward: seen in the first, refused in the others
                self._scope.enter_context(_PROCESS.engine.watching(self._engine_entered))
            out = self._first(forward)
            if self._pairing.calls == 0:
                raise ValueError(self._unpaired if not self._pairing.traced else TRACED)
        elif self._alone:  # the sequential loop's order: the backward, then the forward
            self._backward(self._pending)
            self.results.append(self._kept(self._pending))
            out = forward()
        else:
            if self._partner is None:
                self._partner = _PROCESS.idle.pop() if _PROCESS.idle else Partner()
            partner = self._partner
            partner.start(forward)
            self._pairing.partner = partner  # after a failure: add's stop
            self._backward(self._pending)  # gives way to the partner at each of its waits
            out = partner.finish()
            self._pairing.partner = None
            self.results.append(self._kept(self._pending))
        self._pending = out
        if last:
            self._scope.close()  # the last backward runs outside around()
            self._pending = None
            self._backward(out)
            self.results.append(self._kept(out))
            self._end()
        return out

    def _first(self, forward: Callable[[], T]) -> T:
        """The step's first forward, alone. Where an accelerator is present autograd is
        watched (:mod:`mc2.engine.autograd.autograd_watch`): a first forward that ran it,
        on any rank (agreed), would hang the step paired, so ``strict`` refuses on every
        rank, else the step runs unpaired, said once."""
        self._caller, self._first_ran_autograd = threading.get_ident(), False
        self._in_first = True
        try:
            out = forward()
        finally:
            self._in_first = False
        if not watched():
            return out
        (seen,) = host_max([float(self._first_ran_autograd)], self._group, "pairing")
        if seen:
            why = ("the forward runs autograd itself (torch.autograd.grad or .backward() "
                   "inside it); on an accelerator the paired backward runs in autograd's "
                   "device thread, which a forward beside it would wait for forever")
            if self._strict:
                raise ValueError(f"mc2 pairing: {why}; run the sequential loop "
                                 "(forward_backward's overlap=False)")
            say_once(why, "pairing one micro-batch's forward with another's backward")
            self._alone = True
            self._said_alone(why)
        return out

    def _engine_entered(self, outputs: Any) -> None:
        """At every entry into autograd's engine during the step: the first forward's is
        noted (not a compiler's, which differentiates a graph it traces and is no autograd of
        the forward's own); a paired forward's, where the thread that handed it the turn is
        not the step's (autograd's device thread, running the backward beside it:
        :func:`_backward_elsewhere`), is refused: it would wait for that thread, which waits
        for it. Per rank: a call that only some ranks make fails their step, and their peers'
        waits end in their deadline.

        Whatever the devices of ``outputs``: a graph rooted on a CPU tensor (a loss moved to
        the host) reaches the device's nodes too, and the entry does not say which devices
        its graph reaches. None where the entering thread turned autograd's device threads
        off (AOTAutograd does while it traces a compiled region's backward, a recompile in a
        paired forward included): the engine then runs the whole graph in that thread, and
        nothing waits for the stopped one."""
        if not torch.autograd.is_multithreading_enabled():
            return
        partner = self._partner
        if partner is not None and partner.running_here():
            if _backward_elsewhere(partner, self._caller):
                raise ValueError("mc2 pairing: a paired forward runs autograd itself "
                                 "(torch.autograd.grad or .backward() inside it), which on an "
                                 "accelerator waits for the device thread running the "
                                 "backward beside it, while that thread waits for the "
                                 "forward; run the sequential loop (forward_backward's "
                                 "overlap=False)")
        elif self._in_first and threading.get_ident() == self._caller and \
                not torch.compiler.is_compiling() and tracing_mode() is None:
            self._first_ran_autograd = True

    def _end(self, keep_partner: bool = True, failure: Any = (None, None, None)) -> None:
        """The step is over (or failed: ``failure``, the exception's ``sys.exc_info()``, which
        ``around()`` sees, so that it can discard the step's state): the contexts closed, the
        partner kept for the next step (a forward still suspended in it, given up). A
        partner that still held the turn
        :data:`SETTLE_S` after an interrupt (its forward blocked, say in a transfer its peers
        will not complete) is dropped instead: cancelled, it would run beside the caller, and
        a stale turn would let the next step's forward run beside its backward. Its daemon
        thread, and what its forward holds, stay until the process ends."""
        partner, self._partner, self._pending = self._partner, None, None
        self._alone, self._caller = False, None
        if partner is not None and keep_partner:
            partner.cancel()
            _PROCESS.idle.append(partner)
        scope, self._scope = self._scope, None
        if scope is not None:  # nothing left to close after the last backward
            try:
                scope.__exit__(*failure)
            except Exception as cleanup:  # noqa: BLE001 - the step's own exception is raised
                if failure[1] is None:
                    raise
                failure[1].add_note(f"mc2: closing the step's contexts failed too: {cleanup!r}")
        self._cleaned_up(failure, keep_partner)


def _backward_elsewhere(partner: Partner, caller: int | None) -> bool:
    """Whether the thread that handed the paired forward its turn is another than the
    step's: autograd's device thread, running the backward beside it on an accelerator (the
    step's own thread resumes it once the backward is over, and nothing then waits)."""
    return partner.resumed_by is not None and partner.resumed_by != caller


def run_pairs(count: int, forward: Callable[[int], T], backward: Callable[[T], None], *,
              around: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
              unpaired: str = "the model made no mc2 call, so nothing can be paired",
              kept: Callable[[T], Any] = lambda out: None,
              failed: Callable[[BaseException], None] = lambda exc: None,
              strict: bool = True, group: Any = None,
              alone: Callable[[str], None] = lambda why: None) -> list[Any]:
    """``forward(i)`` for each of ``count`` micro-batches and ``backward`` of what it returned,
    each forward after the first beside the previous micro-batch's backward
    (:class:`PairedLoop`); ``kept(result)`` of each, in order."""
    loop = PairedLoop(backward, around=around, unpaired=unpaired, kept=kept, failed=failed,
                      strict=strict, group=group, alone=alone)
    for i in range(count):
        loop.add(lambda i=i: forward(i), last=i == count - 1)
    return loop.results
