"""``mc2.forward_backward``: micro-batch n+1's forward beside micro-batch n's backward, equal
to the sequential gradient-accumulation loop, and really paired (its forward's transfers in
flight across the other's backward compute)."""

from __future__ import annotations

import pytest
import torch

import mc2
from tests.workers_pairing import (
    failed_step, fsdp2_paired, hf_hidden_states_paired, hf_paired, in_layer_paired, refusals,
    stack_paired)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    """Within ``tol`` of the tensor's own scale."""
    return float((got - want).norm()) <= tol * max(float(want.norm()), 1e-300)


def test_paired_micro_batches_equal_the_sequential_loop_and_overlap() -> None:
    for r in mc2.run_local(stack_paired, 2, timeout_s=120):
        want = r["loop"]
        for overlap in (False, True):
            got = r[overlap]
            assert [float(x) for x in got["losses"]] == pytest.approx(
                [float(x) for x in want["losses"]], rel=1e-12)
            assert all(_close(g, w, 1e-10) for g, w in zip(got["grads"], want["grads"]))
        # paired: the forward's exchanges travel across the backward's compute; the
        # sequential loop never (the check that fails when the pairing is removed)
        assert r[False]["under_backward"] == 0
        assert r[True]["under_backward"] >= 2 * 3 * (len(want["losses"]) - 1) // 2, r[True]


def test_a_model_calling_mc2_inside_its_layers_pairs_its_eager_calls() -> None:
    """No layer loop of mc2's: three ``MoELayer``s in a ``Sequential``. The eager calls hand
    back and give way between their steps and at the waits inside them; gradients are the
    sequential loop's, and the forward's exchanges travel across the backward's compute (none
    without pairing), its second dispatch of each call too (each call runs two micro-batches
    under a pairing: that dispatch is waited for inside a step, so it travels across the
    backward's compute only where the pass hands over at that wait: checked, this fails
    without it)."""
    for r in mc2.run_local(in_layer_paired, 2, timeout_s=120):
        for overlap in (False, True):
            assert all(_close(g, w, 1e-10) for g, w in zip(r[overlap]["grads"], r["loop"]))
        assert r[False]["under_backward"] == 0
        assert r[True]["under_backward"] >= 2 * 3 * 3 // 2, r[True]
        assert r[False]["later_under_backward"] == 0
        assert r[True]["later_under_backward"] >= 3 * 3 // 2, r[True]


def test_a_step_that_fails_while_a_forward_is_paired_gives_that_forward_up() -> None:
    """The first micro-batch's backward raises at its very end, while the second one's
    forward is suspended in the partner thread: the error is raised on every rank, the
    suspended forward unwinds (no thread is left behind), and the next paired step on the
    same model and group equals the sequential loop."""
    for r in mc2.run_local(failed_step, 2, timeout_s=120):
        assert r["raised"] == "the backward failed on purpose", r["raised"]
        assert r["threads"][1] == r["threads"][0], r["threads"]
        assert all(_close(g, w, 1e-10) for g, w in zip(r["got"], r["want"], strict=True))


def test_a_pairing_on_some_ranks_only_is_refused_on_every_rank() -> None:
    """Whether a call runs under a pairing is agreed in its handshake: a rank that pairs
    alone (a framework's loop switched on one rank) issues its collectives in another order
    than its peers. Before, with a fixed K nothing in the calls differed, and both ranks
    waited out the group's timeout (``"auto"`` was caught: a paired call takes K = 2)."""
    from tests.workers_pairing import paired_on_one_rank

    for r in mc2.run_local(paired_on_one_rank, 2, timeout_s=60):
        assert r is not None and "disagree on pairing" in r, r


def test_a_step_on_a_subgroup_agrees_on_that_group() -> None:
    """The kept decision is per group: one kept from a step on the world made group A's
    later step agree on the world, whose other ranks were elsewhere (a hang until the
    timeout; found by a review)."""
    from tests.workers_pairing import step_on_a_subgroup

    for rank, r in enumerate(mc2.run_local(step_on_a_subgroup, 4, timeout_s=20,
                                           deadline_s=90)):
        assert r == {"world": True, "group": rank < 2}, (rank, r)


def test_a_paired_forward_failing_on_one_rank_ends_every_ranks_step_at_once() -> None:
    """Rank 1's ``loss_fn`` raises in a paired forward: rank 1 raises that exception, from
    the backward's next wait, and its peer learns of the lost rank from its next
    collective. Before, rank 1's backward went on issuing collectives where rank 0's paired
    forward issued its own: both waited out the group's timeout, and rank 1 reported a
    ``CommTimeout``, its own exception dropped with the partner."""
    from mc2.tools.launch import LocalWorldError
    from tests.workers_pairing import failing_paired_forward

    with pytest.raises(LocalWorldError) as failed:
        mc2.run_local(failing_paired_forward, 2, timeout_s=60, deadline_s=300)
    failures = failed.value.failures
    assert "KeyError: 'loss_fn failed on purpose'" in failures[1], failures[1][-2000:]
    assert "lost its connection to a peer" in failures[0], failures[0][-2000:]


@pytest.mark.parametrize("where", ["forward", "last backward"])
def test_a_failed_fsdp2_step_leaves_no_gradient_for_the_next(where: str) -> None:
    """A paired FSDP2 step that fails in its third forward has accumulated the first
    micro-batch's gradients unsharded, which no optimizer's ``zero_grad`` clears (it holds
    the shards): the failure runs FSDP2's recovery and drops them, so the next step's
    gradients equal the sequential loop's on a twin model (before: off by their whole size,
    the stale gradients reduced with the new ones), and every unit is sharded again right
    after the failure (before: all held gathered). The same where the last backward fails,
    which runs outside the step's held units (a review found the discard skipped there)."""
    from tests.workers_pairing import fsdp2_failed_step

    for r in mc2.run_local(fsdp2_failed_step, 2, args=(where,), timeout_s=120):
        assert r["raised"] == ("the forward failed on purpose" if where == "forward"
                               else "the backward failed on purpose")
        assert r["after_failure"] and r["after_step"]
        assert all(_close(g, w, 1e-10) for g, w in zip(r["got"], r["want"], strict=True))


def test_capacity_mode_drops_the_rows_the_sequential_loop_drops() -> None:
    """Which rows fit a capacity call's slabs depends on its K where a rank has more tokens
    than the capacity, so the paired step leaves a capacity call's ``"auto"`` K to be decided
    as in the loop (before, it ran 2 splits: other rows dropped, or ``CapacityOverflow``
    where the loop ran fine): losses and gradients bitwise the loop's, as many rows dropped."""
    from tests.workers_pairing import capacity_paired

    for r in mc2.run_local(capacity_paired, 2, timeout_s=120):
        assert r[None]["dropped"] > 0 and r[True]["dropped"] == r[None]["dropped"], r
        assert all(torch.equal(g, w) for g, w in zip(r[True]["losses"], r[None]["losses"],
                                                     strict=True))
        assert all(torch.equal(g, w) for g, w in zip(r[True]["grads"], r[None]["grads"],
                                                     strict=True))


@pytest.mark.parametrize("units", ["layers", "root", "tied", "mixed"])
def test_an_fsdp2_sharded_model_pairs_and_reduces_as_its_sequential_loop(units: str) -> None:
    """FSDP2 over the world, each layer a unit under the root, or the root alone. The last
    micro-batch's forward is shorter and ends inside the backward before it, where FSDP2
    registers no hook for it: under the root alone, without mc2 queueing FSDP2's
    end-of-backward callback, its gradients are never reduce-scattered and the parameters
    stay gathered (checked: this test then fails). ``"tied"``: a tied input projection and
    output head as one unit of two modules (a language model's tied embedding), its one
    parameter group held once. Every rank's
    local gradient shards equal the sequential loop's under the same sharding (float64),
    the forward's exchanges travel across the backward's compute, and every parameter is
    sharded again after the step.

    ``"mixed"``: FSDP2's bf16 parameters with float32 reduction. The forwards are bitwise the
    sequential loop's (the losses equal); the gradients are float32 and equal to rounding:
    each micro-batch's bf16 gradient joins the float32 accumulation once, as in FSDP2's own
    loop, but a forward FSDP2 sees during a backward has no FSDP2 node on its units' inputs,
    so a residual stream's three gradient terms are summed in another order (measured: one
    bf16 step on ~10% of the expert weights' elements, at most 6.2e-4 of a tensor's norm; a
    micro-batch's gradient dropped or counted twice is 0.2 or more)."""
    tol = 4e-3 if units == "mixed" else 1e-10
    for r in mc2.run_local(fsdp2_paired, 2, args=(units,), timeout_s=120):
        assert r[True]["sharded"] and r[None]["sharded"]
        assert all(_close(g, w, tol) for g, w in zip(r[True]["grads"], r[None]["grads"],
                                                     strict=True))
        assert all(g.dtype == w.dtype == (torch.float32 if units == "mixed" else torch.float64)
                   for g, w in zip(r[True]["grads"], r[None]["grads"]))
        assert all(torch.equal(g, w) for g, w in zip(r[True]["losses"], r[None]["losses"],
                                                     strict=True))
        assert r[True]["under_backward"] >= 2 * 3 * 3 // 2, r[True]
        # held gathered: each parameter group gathered once, in the first forward (the
        # sequential loop gathers again in every forward and backward). The last backward
        # runs as FSDP2's own: the tied unit's post-backward hook sits on the head's input,
        # so it frees the unit after the head's part and gathers it again for the
        # embedding's (as in every backward of the sequential loop), and the layer after it
        # in FSDP2's order once more
        again = 2 if units == "tied" else 0
        assert r[True]["gathers"] == r[True]["groups"] + again < r[None]["gathers"] / 3, r


@pytest.mark.parametrize("dtype,hostile,tol,batch_overlap", [
    ("float64", False, 1e-10, True), ("float64", True, 1e-10, True),
    ("float32", False, 1e-4, True), ("float64", True, 1e-10, False)],
    ids=["float64", "one-expert", "float32", "in-layer-one-expert"])
def test_a_hugging_face_model_trains_as_its_sequential_loop(dtype: str, hostile: bool,
                                                            tol: float,
                                                            batch_overlap: bool) -> None:
    for r in mc2.run_local(hf_paired, 2, args=(dtype, hostile, batch_overlap), timeout_s=180):
        assert [float(x) for x in r["got"]] == pytest.approx([float(x) for x in r["want"]],
                                                             rel=tol)
        for name, (want, got) in r["grads"].items():
            assert (want is None) == (got is None), name
            if want is not None:
                assert _close(got, want, tol), name


def test_what_cannot_be_paired_is_refused_on_every_rank() -> None:
    for r in mc2.run_local(refusals, 2, timeout_s=60):
        assert "nothing can be paired" in r["no mc2 call"], r
        assert "DistributedDataParallel" in r["DDP"], r
        assert "replicate()" in r["replicate"], r  # DDP kept on a state, not a module
        assert "scalar" in r["not a scalar"], r
        # its calls ran, as the operator in a compiled graph: said so, not "the model made
        # no mc2 call"
        assert "ran as the operator" in r["compiled"] and "compiled" in r["compiled"], r
        # before: paired, every rank waited out the group's timeout; sequential, one rank's
        # micro-batch silently joined the other's next step; another overlap hung too
        for name in ("counts paired", "counts sequential"):
            assert "disagree on the number of micro-batches (between 2 and 3)" in r[name], r
        assert "disagree on overlap (between False and True)" in r["overlap"], r


def test_a_model_under_selective_checkpointing_pairs_as_its_sequential_loop() -> None:
    """Under selective activation checkpointing the model's mc2 calls run as the operator
    ``torch.ops.mc2.fused_expert`` (so that the policy sees one call), eagerly: they give
    way between their steps as the eager calls do, with mc2's policy (the call's output
    saved) and with one that recomputes everything (the call runs again in the backward,
    exchanges included, as under TorchTitan's own policy). Paired, the forward's exchanges
    travel across the backward's compute, with the sequential loop's losses and gradients
    (before, such a model was refused: its calls ran whole)."""
    from tests.workers_pairing import selective_paired

    for r in mc2.run_local(selective_paired, 2, timeout_s=120):
        for policy in (True, False):
            got = r[policy]
            assert got["under_backward"] > 0, (policy, got["under_backward"])
            assert got["losses"] == pytest.approx(got["want"], rel=1e-12), policy
            assert all(_close(g, w, 1e-10) for g, w in zip(got["grads"], got["want_grads"],
                                                            strict=True)), policy



def test_a_forward_batch_overlap_cannot_split_pairs_with_its_layers_whole() -> None:
    """``output_hidden_states`` (hooks on the decoder layers): batch overlap runs such a
    forward unsplit; under the pairing every forward runs its layers whole, so it pairs,
    equal to the sequential loop (float64, 1e-10)."""
    for r in mc2.run_local(hf_hidden_states_paired, 2, timeout_s=120):
        assert [float(x) for x in r["got"]] == pytest.approx([float(x) for x in r["want"]],
                                                             rel=1e-12)
        assert r["equal"] and r["under_backward"] > 0, r


def test_bad_arguments() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="True, False or 'auto'"):
        mc2.forward_backward(model, [], lambda m, b: m(b).sum(), overlap="yes")
    with torch.no_grad(), pytest.raises(ValueError, match="gradients are disabled"):
        mc2.forward_backward(model, [torch.ones(2)], lambda m, b: m(b).sum())


def test_auto_measures_both_schedules_then_keeps_one_on_every_rank() -> None:
    """``overlap="auto"``: the first calls alternate paired and sequential (three timed each,
    after an untimed one at each switch), then one is kept, the same on both ranks (agreed
    times); every call's gradients are the sequential loop's."""
    from tests.workers_pairing import auto_decides

    a, b = mc2.run_local(auto_decides, 2, args=(14,), timeout_s=180)
    assert a["paired"] == b["paired"] and a["chosen"] == b["chosen"] and a["times"] == b["times"]
    assert a["paired"][:12] == [True, True, False, False] * 3, a["paired"]
    assert a["chosen"] in (True, False) and a["paired"][12:] == [a["chosen"]] * 2
    assert [len(a["times"][side]) for side in ("on", "off")] == [3, 3]
    assert a["equal"] and b["equal"]


def test_hugging_faces_own_expert_parallelism_pairs_through_ep_implementation_mc2() -> None:
    """``DistributedConfig(tp_size=2, ep_size=2, ep_implementation="mc2")``: the experts call
    mc2 eagerly inside Hugging Face's own decoder loop, and the paired schedule pairs those
    calls; losses and every local gradient equal the sequential loop's (float32), and the
    forward's exchanges travel across the backward's compute. Hugging Face's other layout
    (``fsdp_size``) shards with FSDP2: its units stay gathered for the step and pair too,
    equal again."""
    from tests.workers_hf_ep import reference
    from tests.workers_pairing import hf_ep_paired

    path = reference("mixtral")["path"]
    for r in mc2.run_local(hf_ep_paired, 2, args=(path, "tp"), timeout_s=180):
        assert r["fsdp_units"] == 0 and r["refused"] is None, r["refused"]
        assert [float(x) for x in r["got"]] == pytest.approx([float(x) for x in r["want"]],
                                                             rel=1e-5)
        for name, (want, got) in r["grads"].items():
            assert (want is None) == (got is None), name
            if want is not None:
                assert _close(got, want, 1e-4), name
        assert r["under_backward"] > 0
    for r in mc2.run_local(hf_ep_paired, 2, args=(path, "dp"), timeout_s=180):
        assert r["fsdp_units"] > 0 and r["refused"] is None, r["refused"]
        assert r["under_backward"] > 0  # FSDP2's units held gathered for the step
        assert [float(x) for x in r["got"]] == pytest.approx([float(x) for x in r["want"]],
                                                             rel=1e-5)
        assert all(_close(got, want, 1e-4) for want, got in r["grads"].values()
                   if want is not None)


def test_the_callers_saved_tensor_hooks_reach_the_paired_forwards() -> None:
    """A saved-tensor hook around the step (activation offload's, a checkpoint's) is
    thread-local: the forwards that run in the partner thread (micro-batches 1-3) pack
    through it too, three times what micro-batch 0's forward packs in the caller's thread
    (without carrying it, they would pack none and keep their activations where the hook
    would not), with the gradients of the sequential loop under the same hook."""
    from tests.workers_pairing import hooks_carried

    for r in mc2.run_local(hooks_carried, 2, timeout_s=120):
        assert r[True]["partner"] == 3 * r[True]["caller"] > 0, r[True]
        assert r[None]["packed"] > 0 and r[None]["partner"] == 0
        assert all(_close(g, w, 1e-10) for g, w in zip(r[True]["grads"], r[None]["grads"],
                                                        strict=True))


@pytest.mark.parametrize("kind", ["function", "dispatch"])
def test_the_callers_modes_reach_the_paired_forwards(kind: str) -> None:
    """A ``TorchFunctionMode`` or ``TorchDispatchMode`` around the step (a quantiser, a
    FLOP counter, a tracer) is thread-local: one that doubles the loss's mean doubles it in
    the forwards that run in the partner thread too (micro-batches 1-3, three times micro-batch
    0's in the caller's thread), so losses and gradients equal the sequential loop's under the
    same mode; without carrying the mode, three of the four losses would be half as large."""
    from tests.workers_pairing import modes_carried

    for r in mc2.run_local(modes_carried, 2, args=(kind,), timeout_s=120):
        assert r[True]["partner"] == 3 * r[True]["caller"] == 3, r[True]
        assert r[None]["caller"] == 4 and r[None]["partner"] == 0
        assert r[True]["losses"] == pytest.approx(r[None]["losses"], rel=1e-12)
        assert r[None]["losses"] == pytest.approx([2 * x for x in r["plain_losses"]])
        assert all(_close(g, w, 1e-10) for g, w in zip(r[True]["grads"], r[None]["grads"],
                                                        strict=True))


def test_modes_a_paired_forward_leaves_behind_do_not_reach_the_next_step() -> None:
    """The partner thread serves every step: a mode its forward entered and never exited,
    and the default device it set (a mode below the carried ones), are gone when the next
    step's forwards run there (before: the next forwards ran under them)."""
    from tests.workers_pairing import modes_left_behind

    for r in mc2.run_local(modes_left_behind, 2, timeout_s=120):
        assert any(name == "mc2-paired-forward" for name, _ in r["depths"]), r
        assert all(depth == 0 for _, depth in r["depths"]), r


def test_a_forward_that_runs_autograd_is_not_paired_where_it_would_hang() -> None:
    """On an accelerator autograd runs the paired backward in its device thread, which stops
    there for the forward beside it: a forward that runs autograd itself (a chunked loss)
    would wait for that thread forever. Autograd's engine entry is watched during the step
    (emulated here as where an accelerator is present): a first forward that runs it makes
    ``overlap=True`` refuse on every rank and ``"auto"`` run the step unpaired (no forward in
    the partner thread), said once, with the sequential loop's gradients; a paired forward
    that runs it (a later micro-batch only), where the backward beside it runs in a thread
    of its own (emulated), is refused instead of hanging, and the next step pairs."""
    from tests.workers_pairing import autograd_in_the_forward

    for r in mc2.run_local(autograd_in_the_forward, 2, timeout_s=120):
        assert "runs autograd itself" in r["refused"], r["refused"]
        assert "overlap=False" in r["refused"]
        for step in r["steps"]:
            assert "mc2-paired-forward" not in step["threads"], step["threads"]
            assert step["losses"] == pytest.approx(step["want_losses"], rel=1e-12)
            assert all(_close(g, w, 1e-10) for g, w in zip(step["got"], step["want"],
                                                            strict=True))
        said = [w for w in r["warnings"] if "runs autograd itself" in w]
        assert len(said) == 1, r["warnings"]
        assert r["kept_unpairable"]  # later steps run the sequential loop from the start
        # only a later micro-batch's forward runs autograd: paired, refused, not hung
        assert "a paired forward runs autograd itself" in r["refused_later"], r["refused_later"]
        got, want = r["after"]
        assert all(_close(g, w, 1e-10) for g, w in zip(got, want, strict=True))
        # with the device threads off where the paired forward runs autograd (AOTAutograd's
        # trace of a recompile does so): paired, not refused, the sequential loop's gradients
        off = r["threads_off"]
        assert off["refused"] is None and off["threads"] == ["mc2-paired-forward"], off
        got, want = off["grads"]
        assert all(_close(g, w, 1e-10) for g, w in zip(got, want, strict=True))


def test_the_callers_autograd_threading_reaches_the_paired_forwards() -> None:
    """Whether autograd runs a backward in device threads is a thread-local switch: a caller
    that turned it off (TorchTitan's trainer does) has every forward see it off, the three
    paired forwards in the partner thread too (before, they saw a new thread's default),
    with the sequential loop's gradients."""
    from tests.workers_pairing import autograd_threads_carried

    for r in mc2.run_local(autograd_threads_carried, 2, timeout_s=120):
        sequential, paired = r[None], r[True]
        assert [thread for thread, _ in paired["seen"]].count("mc2-paired-forward") == 3
        assert [on for _, on in sequential["seen"]] == [False] * 4
        assert [on for _, on in paired["seen"]] == [False] * 4, paired["seen"]
        assert all(_close(g, w, 1e-10) for g, w in zip(paired["grads"], sequential["grads"],
                                                        strict=True))


def test_a_forward_that_runs_autograd_pairs_where_autograd_has_no_device_threads() -> None:
    """Where the caller turned autograd's device threads off (TorchTitan's trainer does), the
    paired backward runs in the caller's thread and cannot stop a device thread a forward
    would wait for: a forward that runs autograd itself is paired (emulated as where an
    accelerator is present; with the threads on it is watched, and ``overlap=True`` would
    refuse it), with the sequential loop's losses and gradients."""
    from tests.workers_pairing import autograd_in_the_forward_without_autograd_threads as run

    for r in mc2.run_local(run, 2, timeout_s=120):
        assert r["watched_with_threads"] and not r["watched"], r
        assert r["threads"].count("mc2-paired-forward") == 3, r["threads"]
        assert r["losses"] == pytest.approx(r["want_losses"], rel=1e-12)
        assert all(_close(g, w, 1e-10) for g, w in zip(r["got"], r["want"], strict=True))


def test_a_paired_step_reads_the_device_as_often_as_the_sequential_loop() -> None:
    """Counted with the host-sync counter (a ``TorchFunctionMode``, now carried into the
    paired forwards): the paired step of 4 micro-batches through 3 layers makes the
    sequential loop's device reads (one per forward call, 12) and uploads, plus two
    agreements of host numbers (``host_max``: a CPU tensor on a Gloo group, no device in the
    way): the step's count and overlap, and the pairing's decision."""
    from tests.workers_pairing import host_syncs_paired

    for r in mc2.run_local(host_syncs_paired, 2, timeout_s=120):
        sequential, paired = r[None], r[True]
        assert paired["reads"] == sequential["reads"] == 12, r
        extra = paired["where"] - sequential["where"]
        assert sum(extra.values()) == 2 and "host_max" in next(iter(extra)), extra
        assert not sequential["where"] - paired["where"]


def test_a_backward_without_the_context_variable_finds_the_running_pairing() -> None:
    """On an accelerator autograd runs a backward (and a reentrant checkpoint's recompute in
    it) in a device thread of its own, where the pairing's context variable is not set: a
    backward during a paired step still finds the pairing (emulated here by reading it in an
    empty context inside the backward; without the process's record of its pairing this
    finds none), and nothing finds one outside a step."""
    import contextvars

    from mc2.engine.autograd.pairing import current_pairing, run_pairs

    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # noqa: ANN001, ANN205
            return x.clone()

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001, ANN205
            seen.append((current_pairing(), contextvars.Context().run(current_pairing)))
            return grad

    def forward(i: int) -> torch.Tensor:
        current_pairing().calls += 1  # as an mc2 call under it would count itself
        return Probe.apply(torch.ones(2, requires_grad=True)).sum()

    run_pairs(3, forward, lambda loss: loss.backward())
    assert len(seen) == 3 and all(mine is not None and other is mine for mine, other in seen)
    assert contextvars.Context().run(current_pairing) is None


def test_an_interrupted_step_gives_its_partner_up_and_the_next_step_pairs() -> None:
    """Ctrl-C (a ``BaseException`` that is no ``Exception``) in a paired step, in the
    caller's own work and in a hand-over (the turn given to the partner, not handed back):
    either way the partner is given up as after an error (in a hand-over, once it paused at
    its next transfer) and kept, and the next step pairs with it."""
    from mc2.engine.autograd import pairing

    def forward(i: int) -> torch.Tensor:
        here = pairing.current_pairing()
        here.calls += 1  # as an mc2 call under it would count itself
        here.hand_back()  # as a call that issued a transfer
        return (torch.ones(2, requires_grad=True) * (i + 1)).sum()

    def interrupted(loss: torch.Tensor) -> None:
        raise KeyboardInterrupt

    def giving_way(loss: torch.Tensor) -> None:
        pairing.current_pairing().give_way()
        loss.backward()

    real_resume = pairing.Partner.resume

    def interrupted_in_hand_over(self: pairing.Partner) -> None:
        import threading

        pairing.Partner.resume = real_resume  # once
        if self._thread is None:  # as resume starts it
            self._thread = threading.Thread(target=self._main, daemon=True)
            self._thread.start()
        self._turn = True
        self._run.release()  # the partner's turn, then the interrupt before it hands back
        raise KeyboardInterrupt

    kept = max(len(pairing._PROCESS.idle), 1)
    with pytest.raises(KeyboardInterrupt):
        pairing.run_pairs(3, forward, interrupted)
    assert len(pairing._PROCESS.idle) == kept
    pairing.Partner.resume = interrupted_in_hand_over
    try:
        with pytest.raises(KeyboardInterrupt):
            pairing.run_pairs(3, forward, giving_way)
    finally:
        pairing.Partner.resume = real_resume
    assert len(pairing._PROCESS.idle) == kept
    partner = pairing._PROCESS.idle[-1]
    assert partner.done and not partner._turn
    done = []
    pairing.run_pairs(3, forward, lambda loss: done.append(giving_way(loss)))
    assert len(done) == 3 and len(pairing._PROCESS.idle) == kept


def test_a_backward_failing_beside_another_threads_turn_ends_the_step_without_a_hang() -> None:
    """On an accelerator autograd's device thread runs the paired backward's device nodes,
    and so gives the partner its turns, while the step's thread runs the CPU nodes. One of
    those raising ends the backward in the step's thread while the device thread's turn
    still runs (emulated: a thread gives way while the backward raises). The step ends: that
    turn ends at the partner's next transfer and the device thread alone takes it back, the
    partner is given up and kept (the failed step's cleanup ran), and the next step pairs.
    Before, both threads waited for the one hand-over, and one of them waited forever."""
    import threading
    import time

    from mc2.engine.autograd import pairing

    in_turn, failing, device, cleaned = threading.Event(), threading.Event(), [], []

    def forward(i: int) -> torch.Tensor:
        here = pairing.current_pairing()
        here.calls += 1  # as an mc2 call under it would count itself
        if i == 1 and not device[1:]:  # the failing step's paired forward, in its turn
            in_turn.set()
            failing.wait(10)
            time.sleep(0.2)  # the step's thread is ending the step meanwhile
        here.hand_back()  # as a call that issued a transfer
        here.hand_back()  # and another, reached only in a later turn
        return (torch.ones(2, requires_grad=True) * (i + 1)).sum()

    def backward(loss: torch.Tensor) -> None:
        here = pairing.current_pairing()
        if len(device) < 2:  # the failing step
            thread = threading.Thread(target=here.give_way, name="emulated device thread")
            device.append(thread)
            thread.start()
            assert in_turn.wait(10)
            failing.set()
            device.append("failed")
            raise RuntimeError("a CPU node of the backward failed")
        here.give_way()
        loss.backward()

    loop = pairing.PairedLoop(backward, failed=cleaned.append)
    loop.add(lambda: forward(0), last=False)
    with pytest.raises(RuntimeError, match="CPU node"):
        loop.add(lambda: forward(1), last=False)
    device[0].join(10)
    assert not device[0].is_alive(), "the device thread waited forever for the hand-over"
    assert [str(e) for e in cleaned] == ["a CPU node of the backward failed"], cleaned
    partner = pairing._PROCESS.idle[-1]  # given up and kept
    assert partner.done and not partner._turn
    done = []
    pairing.run_pairs(3, forward, lambda loss: done.append(backward(loss)))
    assert len(done) == 3


def test_a_step_under_a_tracing_mode_is_not_paired() -> None:
    """Fake tensors (and ``make_fx``'s, functionalization's modes) keep their state for the
    thread that entered them, so no forward can run beside them in another thread:
    ``overlap=True`` is refused before anything runs, naming the mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = torch.nn.Linear(4, 4)
    with FakeTensorMode(), pytest.raises(ValueError, match="FakeTensorMode, a tracing mode"):
        mc2.forward_backward(model, [1, 2], lambda m, b: m.weight.sum(), overlap=True)


def test_every_paired_loop_refuses_a_tracing_mode() -> None:
    """Megatron's and TorchTitan's paired loops do not go through ``forward_backward``'s
    check: the loop itself refuses a step under a tracing mode, at its first micro-batch,
    before any forward runs, and takes the next step afresh."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mc2.engine.autograd.pairing import PairedLoop

    ran: list[int] = []
    loop = PairedLoop(lambda out: None)
    with FakeTensorMode(), pytest.raises(ValueError, match="FakeTensorMode, a tracing mode"):
        loop.add(lambda: ran.append(0), last=False)
    assert ran == [] and loop.taken == 0


def test_the_engine_watch_lives_beside_another_wrap_of_the_engine_entry() -> None:
    """Autograd's engine entry is wrapped by others too (``torch.compiler``'s tracing saves
    it, wraps it and puts back what it saved). Whatever the order in which such a wrap and
    mc2's watches begin and end, every backward still runs, and a later watch sees the
    calls (a review found a restore of ours could leave a wrap calling nothing, or recurse)."""
    import contextlib

    import torch.autograd.graph as graph

    from mc2.engine.autograd.autograd_watch import EngineWatch

    @contextlib.contextmanager
    def other_wrap():  # as torch.compiler._patch_engine_backward does
        saved = graph._engine_run_backward

        def wrapped(*args, **kwargs):
            return saved(*args, **kwargs)

        graph._engine_run_backward = torch.autograd._engine_run_backward = wrapped
        try:
            yield
        finally:
            graph._engine_run_backward = torch.autograd._engine_run_backward = saved

    def backward_runs() -> bool:
        w = torch.ones(2, requires_grad=True)
        (w * 3).sum().backward()
        return bool(torch.equal(w.grad, torch.full((2,), 3.0)))

    watch, seen = EngineWatch(), []
    original = graph._engine_run_backward
    try:
        for order in ("ours first", "theirs first"):
            with contextlib.ExitStack() as outer:
                first, second = (watch.watching(seen.append), other_wrap()) \
                    if order == "ours first" else (other_wrap(), watch.watching(seen.append))
                outer.enter_context(first)
                inner = contextlib.ExitStack()
                inner.enter_context(second)
                outer.close()  # the first one begun ends first
                assert backward_runs(), order
                inner.close()
            assert backward_runs(), order
            seen.clear()
            with watch.watching(seen.append):
                assert backward_runs()
            assert len(seen) == 1, (order, seen)
    finally:
        graph._engine_run_backward = torch.autograd._engine_run_backward = original


def test_a_compilers_own_differentiation_is_not_the_forwards_autograd(monkeypatch) -> None:
    """AOTAutograd differentiates the graph it traces by calling ``torch.autograd.grad``
    while it compiles a forward: that is no autograd of the forward's own, and a first
    forward that compiles does not make the step refuse (with an accelerator emulated); one
    that calls ``torch.autograd.grad`` itself does."""
    import mc2.engine.autograd.pairing as pairing_module
    from mc2.engine.autograd.pairing import PairedLoop

    monkeypatch.setattr(pairing_module, "watched", lambda: True)
    linear = torch.nn.Linear(4, 4)
    compiled = torch.compile(lambda x: linear(x).pow(2).mean(), backend="aot_eager")

    def own_autograd() -> torch.Tensor:
        w = torch.ones(2, requires_grad=True)
        torch.autograd.grad(w.sum(), w)
        return linear(torch.randn(3, 4)).sum()

    # no mc2 call in either: a forward the watch passes ends in the "no mc2 call" refusal
    for forward, refusal in ((lambda: compiled(torch.randn(3, 4)), "made no mc2 call"),
                             (own_autograd, "runs autograd itself")):
        with pytest.raises(ValueError, match=refusal):
            PairedLoop(lambda out: out.backward()).add(forward, last=False)


@pytest.mark.parametrize("retried", [False, True])
def test_torchtitans_paired_loop_begins_a_new_step_after_one_left_unfinished(
        retried: bool) -> None:
    """TorchTitan's loop calls the paired ``fwd_bwd_fn`` once per micro-batch; where a step
    is left after some of them (its loop raised between two calls, and the caller went on),
    the next step's first call begins that step, by the trainer's step counter or, for a step
    retried under the same count (``train()`` after a checkpoint load), by the token count
    ``train_step`` makes once per step: its gradients equal the sequential loop's over its
    own micro-batches (before: the call was taken for the old step's last micro-batch, paired
    with that step's backward; retried, silently so)."""
    from tests.workers_pairing import torchtitan_step_left_unfinished

    for r in mc2.run_local(torchtitan_step_left_unfinished, 2, args=(retried,),
                           timeout_s=120):
        assert r["taken"] == 0  # the step ended with its last micro-batch
        assert all(_close(g, w, 1e-10) for g, w in zip(r["got"], r["want"], strict=True))


def test_the_callers_autocast_region_reaches_the_paired_forwards() -> None:
    """Autocast is thread-local: a forward run in the partner thread runs in the caller's
    region, its dtype and whether it caches its casts (``cache_enabled=False`` too)."""
    from mc2.engine.autograd.partner import Partner

    def seen() -> tuple:
        return (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                torch.is_autocast_cache_enabled())

    partner = Partner()
    for cache in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
            partner.start(seen)
            assert partner.finish() == (True, torch.bfloat16, cache) == seen()
    partner.start(seen)
    assert partner.finish() == seen() and not seen()[0]


def test_dropout_draws_as_in_the_sequential_loop_with_and_without_checkpoints() -> None:
    """Dropout draws from the process's generator: the paired forwards draw in micro-batch
    order, as the sequential loop's do, because a backward draws nothing outside its
    checkpoints' recomputes, which set the generator to the forward's state and back without
    giving way (a reentrant checkpoint's inner backward, which gives way, runs after it is
    restored). With dropout before and after each MoE layer, plain and under both kinds of
    checkpoint, the paired step's losses and gradients are the sequential loop's."""
    from tests.workers_pairing import dropout_paired

    for r in mc2.run_local(dropout_paired, 2, timeout_s=120):
        for kind, runs in r.items():
            (want_losses, want, _), (losses, got, paired) = runs[None], runs[True]
            assert paired == 3, (kind, paired)  # every forward but the first beside a backward
            assert losses == pytest.approx(want_losses, rel=1e-12), kind
            assert all(_close(g, w, 1e-10) for g, w in zip(got, want, strict=True)), kind

