"""The planner: its arithmetic on hand-computable cases, and agreement across ranks."""

from __future__ import annotations

import pytest
import torch

import mc2
from mc2.engine.decide.pipeline_cost import overlapped_pass
from mc2.engine.decide.planner import Calibration, Workload, choose, predict
from mc2.engine.decide.routing import micro_batch_fractions
from tests.workers import auto_choice, auto_decode, auto_trials, auto_widening

# one expert per rank-local set, 1 ms per row (forward+backward), no fixed cost
CAL = Calibration(expert_fixed_s=0.0, expert_row_s=1e-3, link_latency_s=0.0,
                  link_s_per_byte=0.0, interference=0.0)
WORK = Workload(rows_per_rank=120, hidden=10, local_experts=1, world_size=2, element_size=4)


def test_compute_only_step_does_not_depend_on_k() -> None:
    for k in (1, 2, 3, 8):
        p = predict(CAL, WORK, k)
        assert p.step_s == pytest.approx(0.120)
        assert p.exposed_comm_s == 0


def test_comm_only_step() -> None:
    cal = Calibration(0.0, 0.0, link_latency_s=0.5, link_s_per_byte=0.0, interference=0.0)
    # serial: 4 transfers; overlapped K: per pass 2x + (K-1) * 2x (nothing to hide under)
    assert predict(cal, WORK, 1).step_s == pytest.approx(4 * 0.5)
    assert predict(cal, WORK, 3).step_s == pytest.approx(2 * (2 * 0.5 + 2 * 2 * 0.5))


def _transfer_s(rows: float) -> float:
    return rows * 10 * 4 * 0.5 * 1e-6  # 10 channels x 4 B, half off-rank, 1 us per byte


def test_pipeline_of_tapered_stages() -> None:
    # K = 4 splits 120 rows as 20, 40, 40, 20 (tapered ends); compute >> transfers: all hidden
    # but the fill (first dispatch) and the drain (last combine) of each pass
    cal = Calibration(0.0, 1e-3, link_latency_s=0.0, link_s_per_byte=1e-6, interference=0.0)
    assert micro_batch_fractions(4) == pytest.approx([1 / 6, 2 / 6, 2 / 6, 1 / 6])
    fill = drain = _transfer_s(20)
    assert predict(cal, WORK, 4).step_s == pytest.approx(0.120 + 2 * (fill + drain))
    assert predict(cal, WORK, 4).exposed_comm_s == pytest.approx(2 * (fill + drain))
    serial = predict(cal, WORK, 1)
    assert serial.step_s == pytest.approx(0.120 + 4 * _transfer_s(120))
    assert serial.exposed_comm_s == pytest.approx(serial.comm_s)


def test_interference_charges_hidden_transfers() -> None:
    cal = Calibration(0.0, 1e-3, 0.0, 1e-6, interference=0.5)
    free = Calibration(0.0, 1e-3, 0.0, 1e-6, interference=0.0)
    x = [_transfer_s(r) for r in (20, 40, 40, 20)]
    under = x[1] + (x[0] + x[2]) + (x[1] + x[3]) + x[2]  # dispatch i+1 and combine i-1 under c_i
    extra = predict(cal, WORK, 4).step_s - predict(free, WORK, 4).step_s
    assert extra == pytest.approx(2 * 0.5 * under)


def test_tapered_ends_beat_equal_ones_when_transfers_hide() -> None:
    # the same pass with equal micro-batches exposes a quarter of the rows twice, not a sixth
    c, x = [0.3] * 4, [0.1] * 4
    equal = overlapped_pass(c, x)
    tapered = overlapped_pass([0.2, 0.4, 0.4, 0.2], [1 / 15, 2 / 15, 2 / 15, 1 / 15])
    assert equal == pytest.approx((1.4, 0.2))
    assert tapered[1] == pytest.approx(2 / 15) and tapered[0] < equal[0]


def test_fixed_cost_per_micro_batch_makes_splitting_lose() -> None:
    cal = Calibration(expert_fixed_s=0.010, expert_row_s=1e-5, link_latency_s=1e-4,
                      link_s_per_byte=1e-9, interference=0.0)
    assert choose(cal, WORK, (1, 2, 4, 8), min_gain=0.02, max_tokens=60) == 1


def test_choose_needs_a_real_gain() -> None:
    cal = Calibration(0.0, 1e-3, 0.0, 2e-5, interference=0.0)  # comm ~ compute: overlap pays
    assert choose(cal, WORK, (1, 2, 4), min_gain=0.02, max_tokens=60) > 1
    assert choose(cal, WORK, (1, 2, 4), min_gain=0.9, max_tokens=60) == 1
    assert choose(cal, WORK, (1, 2, 4), min_gain=0.02, max_tokens=1) == 1


def test_auto_agrees_across_ranks_with_different_token_counts() -> None:
    results = mc2.run_local(auto_choice, 2, args=([300, 37], 64, 128))
    assert results[0]["used"] == results[1]["used"]
    assert results[0]["calibration"] == results[1]["calibration"], "reduced to the same values"


# quick calibrations measured on a 2-core machine, idle (docs/measurements.md's machine); the
# model put K = 2 at 1.55x and 1.45x of K = 1 on them, beyond its 1.40x margin. Given, not
# measured, so that a loaded machine (whose expert rows slow down more than its fixed costs)
# cannot move the test across the margin; test_auto_agrees_across_ranks... measures.
DECODE_CALIBRATIONS = {
    512: Calibration(expert_fixed_s=3.48e-3, expert_row_s=8.21e-5, link_latency_s=3.38e-4,
                     link_s_per_byte=9.89e-10, interference=0.0, row_overhead_s=8.44e-7),
    1024: Calibration(expert_fixed_s=1.37e-2, expert_row_s=4.22e-4, link_latency_s=3.16e-3,
                      link_s_per_byte=0.0, interference=0.0, row_overhead_s=1.95e-6),
}


@pytest.mark.parametrize("hidden, ffn", [(512, 1024), (1024, 2048)])
def test_auto_runs_no_split_of_a_decode_sized_batch(hidden: int, ffn: int) -> None:
    # the article's trap: a decode-sized batch; each extra micro-batch re-runs every expert's
    # GEMMs and pays two more latencies a pass, and nothing is there to hide: the model rules
    # every split out before any trial, so not one of 40 no-grad and 40 training calls splits.
    # 24 tokens of top-2, above what the handshake carries (4 tokens: the next test)
    calls = 40
    results = mc2.run_local(auto_decode, 2, args=(24, calls, hidden, ffn, True,
                                                  DECODE_CALIBRATIONS[hidden]))
    for r in results:
        assert r["used"] == [1] * (2 * calls), r["used"]
        assert not any(m.startswith("auto trial") for marks in r["marks"] for m in marks)
        assert r["equal"], "every call equals a fixed K = 1 call"
        decision = r["decision"]
        assert decision["locked"] == 1 and decision["times"] == {1: []}
        assert decision["settle_calls"] == 0 and "without trials" in decision["why"]
    # the decision is said once per kind (forwards alone, then training calls: each
    # decides on its own), on its first call, where it was made
    assert [i for i, m in enumerate(results[0]["marks"]) if m] == [0, calls]
    assert "locked without trials" in results[0]["marks"][0][0]


def test_a_call_whose_ids_travel_in_the_handshake_runs_one_micro_batch_unplanned() -> None:
    """4 tokens of top-2 per rank: every rank's ids fit its block of the handshake, so the
    call counts its routes there and runs K = 1 without asking the planner (no trial, no
    decision), equal to a fixed K = 1 call in every one of 10 no-grad and 10 training calls."""
    for r in mc2.run_local(auto_decode, 2, args=(4, 10, 512, 1024, False)):
        assert r["used"] == [1] * 20 and r["equal"], r
        assert not any(r["marks"]) and r["decision"] is None


def test_a_split_the_model_gives_a_chance_is_tried() -> None:
    # the rule itself: within the margin a split is tried, beyond it not
    from mc2.engine.decide.chance import PRIOR_MARGIN, SAFETY, ModelError, with_a_chance
    predicted = {1: 1.0, 2: 1.15, 4: 1.6, 8: 3.0}
    assert with_a_chance(predicted, PRIOR_MARGIN) == [2]
    error = ModelError()
    assert error.margin() == PRIOR_MARGIN
    error.learn({1: 1.0, 2: 1.2, 4: 1.6}, {1: 1.0, 2: 1.2, 4: 1.6})  # the model was right
    assert error.margin() == pytest.approx(SAFETY) and error.observations == 2
    assert with_a_chance(predicted, error.margin()) == [2]
    error.learn({1: 1.0, 4: 2.0}, {1: 1.0, 4: 1.0})  # it over-predicted K = 4 twice over
    assert error.margin() == pytest.approx(2 * SAFETY)
    assert with_a_chance(predicted, error.margin()) == [2, 4]


def test_auto_tries_a_bounded_set_of_k_then_locks_the_fastest_on_every_rank() -> None:
    calls = 40  # above the most trial calls this planner can make (its budget, 24)
    results = mc2.run_local(auto_trials, 2, args=([300, 37], calls))
    a, b = results
    assert a["used"] == b["used"], "every rank must run the same K on every call"
    decision = a["decision"]
    tried, locked, widened = decision["tried"], decision["locked"], decision["widened"]
    assert 1 in tried and len(tried) == 3 + len(widened) and len(widened) <= 2
    per_k = {k: len(v) for k, v in decision["times"].items()}
    n_timed = sum(per_k.values())
    # 2 timed calls each, candidate by candidate; an untried neighbour of the best adds its 2;
    # each re-check inside the noise (2 at most) adds 2 per close candidate
    first = 6 + 2 * len(widened)
    assert first <= n_timed <= first + 2 * len(tried) * decision["rechecked"]
    assert (n_timed - first) % 2 == 0, (per_k, decision)
    n_trials = n_timed + decision["settle_calls"]
    bound = mc2.Planner(candidates=(1, 2, 4, 8), explore=3, trials=2).most_trial_calls(False)
    assert n_trials <= bound == 24 < calls
    assert sum(1 for marks in a["trials"] if marks) == n_trials  # bounded, and visible
    assert all(not marks for marks in a["trials"][n_trials:])
    order = [abs(k) for k in sorted(per_k, key=lambda c: (c < 0, abs(c)))][:3]
    assert a["used"][:9] == [k for k in order for _ in range(3)]  # settle, timed, timed
    # one settling call per run of a candidate's calls, not one per timed call
    assert decision["settle_calls"] == 1 + sum(a["used"][i] != a["used"][i - 1]
                                               for i in range(1, n_trials))
    # a timed call always follows a call of its own K; a settling call only a switch of K
    for i, (marks, k) in enumerate(zip(a["trials"][:n_trials], a["used"])):
        settling = "(settling, untimed)" in marks[0]
        assert settling == (i == 0 or a["used"][i - 1] != k), (i, a["trials"][:n_trials])
    assert a["used"][n_trials:] == [locked] * (calls - n_trials)
    assert locked == b["decision"]["locked"] and decision["why"].startswith(f"locked K={locked}")
    # every call, trial or not, computes the same function
    for out in a["outs"][1:]:
        torch.testing.assert_close(out, a["outs"][0], rtol=0, atol=1e-5)


def _c(*ks: int) -> tuple:
    """Candidates from signed shorthand: ``-4`` is K = 4 with plain rows (tests only: the
    planner keeps the two as two fields, :class:`~mc2.engine.decide.trials.Candidate`)."""
    from mc2.engine.decide.trials import Candidate

    return tuple(Candidate.of(abs(k), plain_rows=k < 0) for k in ks)


def test_untried_neighbours_of_the_best_are_the_next_k_either_side() -> None:
    from mc2.engine.decide.trials import untried_neighbours

    ladder = (1, 2, 4, 8, 16)

    def near(tried: tuple, best: int) -> list:
        return untried_neighbours(ladder, _c(*tried), _c(best)[0])

    assert near((1, 4, 8), 4) == list(_c(2))  # the run that locked K=4 over K=2
    assert near((1, 2, 4), 2) == []  # bracketed: nothing to add
    assert near((1, 4, 16), 4) == list(_c(2, 8))
    assert near((1, 8, 16), 16) == []  # the ladder's end, 8 tried
    assert near((1, 4, 8), 1) == list(_c(2))
    assert near((1, 2, 4, -1, -4), -4) == list(_c(-2, -8))  # plain rows' own K
    assert untried_neighbours((1, 2), _c(1, 2), _c(2)[0]) == []


def test_auto_tries_the_neighbours_the_prior_left_out_then_locks_on_all_calls() -> None:
    """A prior ranking K = 4 and 16 first: K = 1, 4 and 16 run first, then the untried
    neighbours of whichever measured fastest (the group's slowest rank's median), beside
    more calls of it, and the lock is the fastest of all on every rank."""
    from mc2.engine.decide.trials import trial_stats, trial_winner, untried_neighbours

    order = [4, 16, 1, 2, 8, 32]
    calls = 40  # above the most trial calls (the budget, 24)
    a, b = mc2.run_local(auto_widening, 2, args=(order, calls))
    assert a["used"] == b["used"], "every rank must run the same K on every call"
    da, db = a["decision"], b["decision"]

    def slowest(k: int, calls: slice) -> list[float]:
        return [max(sum(t.values()) for t in pair)
                for pair in zip(da["times"][k][calls], db["times"][k][calls])]

    # candidate by candidate: a settling call, then 2 timed calls each
    assert a["used"][:9] == [1, 1, 1, 4, 4, 4, 16, 16, 16]
    first = trial_stats(_c(1, 4, 16), [slowest(k, slice(0, 2)) for k in (1, 4, 16)])
    best = min(first, key=lambda s: s.median_s).candidate.k
    expected = [c.k for c in untried_neighbours((1, 2, 4, 8, 16, 32), _c(1, 4, 16),
                                                _c(best)[0])]
    assert expected and da["widened"] == tuple(expected) == db["widened"]
    assert sorted(da["tried"]) == sorted([1, 4, 16, *expected])
    # then each neighbour the same way
    assert a["used"][9:9 + 3 * len(expected)] == [k for k in expected for _ in range(3)]
    assert all(len(da["times"][k]) >= 2 for k in expected)
    ks = sorted(da["times"])
    final = trial_stats(_c(*ks), [slowest(k, slice(None)) for k in ks])
    locked = trial_winner(_c(*ks), [s.median_s for s in final], 0.02).k
    assert da["locked"] == db["locked"] == locked
    n_trials = sum(len(v) for v in da["times"].values()) + da["settle_calls"]
    assert a["used"][n_trials:] == [locked] * (calls - n_trials)
    assert "tried beside the first round's best" in da["why"]
    assert n_trials <= 24


def test_a_lucky_call_does_not_decide_and_a_lead_inside_the_noise_is_rechecked() -> None:
    """The median of a candidate's timed calls counts, not its best call; where the best
    lead is within the spread, the close candidates are measured again."""
    from mc2.engine.decide.trials import contenders, margin, trial_stats

    stats = trial_stats(_c(1, 2, 4), [[1.00, 1.02], [0.60, 1.40], [1.50, 1.52]])
    assert [s.median_s for s in stats] == pytest.approx([1.01, 1.00, 1.51])
    assert stats[1].spread_s == pytest.approx(0.40) and stats[1].calls == 2
    assert contenders(stats) == list(_c(1, 2))  # K=2's lead of 1% is inside its spread
    clear = trial_stats(_c(1, 2, 4), [[1.00, 1.01], [0.80, 0.81], [1.3, 1.3]])
    assert contenders(clear) == list(_c(2)) == contenders(clear, 0.1)  # a 24% lead is clear
    # two calls each that happen to agree: a 5% lead is inside the floor, not their spread
    tight = trial_stats(_c(1, 2), [[1.00, 1.00], [0.95, 0.95]])
    assert contenders(tight) == list(_c(2)) and contenders(tight, 0.1) == list(_c(1, 2))
    assert margin(clear, _c(2)[0]) == pytest.approx(1.005 / 0.805 - 1)


def test_trials_keep_k1_unless_a_split_gains_min_gain() -> None:
    from mc2.engine.decide.trials import trial_winner

    def winner(ks: tuple, seconds: list) -> tuple:
        return (trial_winner(_c(*ks), seconds, 0.02),)

    assert winner((1, 2, 4), [1.00, 0.99, 1.20]) == _c(1)  # 1% is within trial noise
    assert winner((1, 2, 4), [1.00, 0.97, 1.20]) == _c(2)
    assert winner((1, 2, 4), [1.00, 1.10, 1.20]) == _c(1)
    assert winner((2, 4), [1.00, 0.99]) == _c(4)  # no K = 1 tried: the fastest
    assert winner((1, 4, -4), [1.00, 0.90, 0.89]) == _c(-4)  # plain rows: on time alone


def test_trials_never_lock_slower_than_serial_plain_rows() -> None:
    """With a wire format, K = 1 with plain rows is a baseline like K = 1: a split must beat
    the faster of the two by ``min_gain``, and no lock measured slower than it."""
    from mc2.engine.decide.trials import trial_winner

    def winner(ks: tuple, seconds: list) -> tuple:
        return (trial_winner(_c(*ks), seconds, 0.02),)

    assert winner((1, 2, -1), [1.00, 0.95, 0.96]) == _c(-1)  # 1% over plain serial
    assert winner((1, 2, -1), [1.00, 0.90, 0.96]) == _c(2)
    assert winner((1, 4, -1, -4), [1.00, 1.10, 0.90, 0.89]) == _c(-1)
    assert winner((1, 4, -1), [0.95, 1.10, 1.00]) == _c(1)  # the wire format pays


@pytest.mark.parametrize("drift", [4.0, 0.0], ids=["guard", "no_guard"])
def test_drift_guard_replans_a_shape_that_got_slower_once(drift: float) -> None:
    """After the lock, a steady state that runs clearly slower than its trials (here the
    experts start taking 200 ms more a forward) re-runs the shape's trials once, on every rank
    at the same call, says so on the planner's logger and in the timeline, and never again;
    a steady state like its trials does not. With ``drift=0`` nothing is watched. The passes
    are timed on a simulated clock that only the experts advance (1 ms a forward, then
    201 ms), so the re-plan's call is exact whatever the machine's load."""
    from tests.workers_drift import drifting_shape

    a, b = mc2.run_local(drifting_shape, 2, args=(drift, 8, 20, 0.2))
    assert a["calls"] == b["calls"], "every rank runs the same K and trials on every call"
    locked_at, calls = a["locked_at"], a["calls"]
    after = calls[locked_at:]
    replans = [i for i, c in enumerate(after) if c["replan"]]
    assert a["max_err"] < 1e-5  # every call, trial or not, the same function
    if drift == 0:
        assert replans == [] and not any(c["trial"] for c in after)
        assert a["decision"]["replanned"] is None
        return
    # windows of 4: the one of the first 4 slow calls (8..11) is judged at call 12
    assert replans == [12], ([(c["k"], c["trial"], c["replan"]) for c in after], a["decision"])
    assert not any(c["trial"] for c in after[:12])
    retried = [c for c in after[12:] if c["trial"]]
    # 2 candidates x 2 timed calls, one after the other, no re-check, and a settling call at
    # each switch of K (the first trial settles only if it is not the K the locked calls ran)
    settled = a["decision"]["settle_calls"]
    assert settled in (1, 2) and len(retried) == 4 + settled
    assert all(not c["trial"] for c in after[12 + len(retried):])  # locked again, for good
    why = a["decision"]["replanned"]
    assert why is not None and "slower than its trials" in why
    assert any("slower than its trials" in line for line in a["lines"])
    assert sum("locked K=" in line for line in a["lines"]) == 2


@pytest.mark.parametrize("delay", [0.2, 0.0], ids=["changed", "unchanged"])
def test_a_lock_without_trials_is_revisited_when_its_step_changes(delay: float) -> None:
    """K = 1 locked without trials (the model gave no split a chance) is watched too: the
    first window of its calls is its baseline, and a later window clearly off it (here the
    experts start taking 200 ms more a forward, on a simulated clock) calibrates the model
    again and decides the shape once more, on every rank at the same call: the new model
    gives K = 2 a chance, so its trials run and lock. A step that stays as it was is left
    alone (one calibration, no trial)."""
    from tests.workers_drift import serial_lock_revisited

    a, b = mc2.run_local(serial_lock_revisited, 2, args=(12, 16, delay))
    assert a["calls"] == b["calls"], "every rank runs the same K and trials on every call"
    replans = [i for i, c in enumerate(a["calls"]) if c["replan"]]
    if delay == 0:
        assert replans == [] and not any(c["trial"] for c in a["calls"])
        assert a["measured"] == 1 and a["decision"]["replanned"] is None
        return
    assert len(replans) == 1 and replans[0] >= 12, a["calls"]  # once, after the change
    assert a["measured"] == 3  # calibrated again: the quick stage, then (a split has a chance) the full
    after = a["calls"][replans[0]:]
    assert any(c["trial"] and c["k"] == 2 for c in after)  # K = 2 now has its trials
    assert "locked without trials" in a["decision"]["replanned"]
    assert a["decision"]["locked"] in (1, 2)


def test_going_from_forwards_alone_to_training_is_no_drift() -> None:
    """A K = 1 lock made on no-grad calls, then training calls whose forward takes longer (it
    keeps what the backward needs; 50 ms more on the simulated clock): each kind of window
    has its own baseline, so the change of kind re-plans nothing (one compared against the
    other read as a machine that changed: seen once in the suite under load)."""
    from tests.workers_drift import serial_lock_revisited

    a, b = mc2.run_local(serial_lock_revisited, 2, args=(12, 16, 0.0, True))
    assert a["calls"] == b["calls"]
    assert not any(c["replan"] or c["trial"] for c in a["calls"]), a["calls"]
    assert a["measured"] == 1 and a["decision"]["replanned"] is None


def test_a_calibration_line_grows_until_it_stands_out_of_the_noise() -> None:
    """Where an expert's step costs the same at 4 and 32 rows (a GPU's GEMM below its
    saturation), the larger point grows until its time stands out of the timings' spread,
    and the line is fitted there: a per-row cost of the large sizes, not zero."""
    from mc2.engine.decide.planner import _Probe

    flat_until = 512

    class FakeProbe(_Probe):
        def timing(self, fn):  # seconds by the rows the last run would take
            fn()
            return (1.0 if self.rows < flat_until else 1.0 + self.rows * 1e-3), 0.01

    probe = FakeProbe(None, "loop", None, 3)
    seen = []

    def run(rows: int) -> None:
        probe.rows = rows
        seen.append(rows)

    fixed, per_row = probe.resolved_line(run, 4, 32, float, agree=False, most=4096)
    assert seen == [4, 32, 128, 512]  # grown fourfold until it stood out
    assert per_row == pytest.approx((0.512) / (512 - 4)) and fixed >= 0
    seen.clear()
    flat_until = 10 ** 9  # flat everywhere: stops at the largest size allowed
    probe.resolved_line(run, 4, 32, float, agree=False, most=2048)
    assert seen == [4, 32, 128, 512, 2048]


def test_the_full_calibration_is_measured_at_the_sizes_it_prices() -> None:
    from types import SimpleNamespace

    from mc2.engine.decide.planner import priced_sizes

    weights = SimpleNamespace(local_experts=4)
    assert priced_sizes(None, weights, None) == (256, 256)
    assert priced_sizes(100, weights, None) == (256, 256)  # at least 256
    assert priced_sizes(8192, weights, None) == (2048, 4096)  # one rank: every row its own
    assert priced_sizes(10 ** 6, weights, None) == (4096, 4096)  # at most 4096


def test_the_link_probe_stays_inside_its_byte_budget(monkeypatch) -> None:
    """The link line's rows per peer, where it starts and where it may grow to, never pass
    the priced size nor ``PROBE_BYTES`` of rows to send: a 64-rank group of hidden 7168 in
    bf16 would otherwise allocate gigabytes on a decode-sized first call."""
    from types import SimpleNamespace

    import mc2.engine.decide.planner as planner_module
    from mc2.engine.decide.planner import PROBE_BYTES, _Probe

    seen = []

    class Probe(_Probe):
        def a2a(self, rows_per_peer, async_op=False):
            return SimpleNamespace(wait=lambda: None)

        def resolved_line(self, run, small, large, size, *, agree, most=0):
            seen.append((small, large, most))
            return 0.0, 0.0

    monkeypatch.setattr(planner_module, "group_size", lambda group: 64)
    monkeypatch.setattr(planner_module, "barrier", lambda *args: None)
    probe = Probe(SimpleNamespace(hidden=7168, element_size=2, device=torch.device("cpu")),
                  "loop", None, 3)
    row_bytes = 64 * 7168 * 2
    probe.link(4096, most=4096)  # the full stage of a large shape
    (_, large, most), = seen
    assert large == most == PROBE_BYTES // row_bytes and large * row_bytes <= PROBE_BYTES
    seen.clear()
    probe.link(64, most=256)  # the quick stage: its 64 rows, growing to 4x at the most
    assert seen == [(1, 64, 73)]  # 73 rows: the budget, below 256



def test_calibration_leaves_the_callers_random_numbers_as_they_were() -> None:
    """The planner's calibration draws random rows (and a module stage's own dropout would
    draw), as does the GEMM strategy's trial: on forked generators now. Before, ``"auto"``
    moved the caller's stream by a timing-dependent number of draws, so dropout after a call
    differed from a fixed K's, between runs and between ranks (seen on 2 ranks)."""
    from mc2.engine.compute.experts import ExpertWeights
    from mc2.engine.decide.gemm_strategy import _time_step
    from mc2.engine.decide.planner import Planner

    g = torch.Generator().manual_seed(0)
    weights = ExpertWeights.in_order((torch.randn(2, 16, 8, generator=g),
                                      torch.randn(2, 16, 8, generator=g),
                                      torch.randn(2, 8, 16, generator=g)))
    torch.manual_seed(1234)
    want = torch.rand(4)
    torch.manual_seed(1234)
    Planner(repeats=2)._measure(weights, None, "loop", full=False)
    _time_step(weights, "loop", 32)
    assert torch.equal(torch.rand(4), want)


def test_training_calls_run_trials_of_their_own() -> None:
    """A forward alone is timed without the backward a training call runs: forwards alone of
    a shape (an evaluation before training) locked the K that training then ran, untried
    (found by a review). The training calls of that shape run their own trials."""
    from tests.workers import auto_by_kind

    for r in mc2.run_local(auto_by_kind, 2, args=(3,)):
        assert r["locked_alone"], r
        assert r["training_trials"][0], r  # the first training call is a trial
        assert set(r["kinds"]) == {False, True} and r["kinds"][False] is not None, r


def test_a_recompute_runs_its_training_forwards_k_beside_an_evaluation() -> None:
    """An evaluation's forward of the same shape between a checkpointed training forward and
    its backward: the recompute ran the evaluation's K (its own trials a call ahead), and
    PyTorch refused the recomputed shapes (``CheckpointError``; found by a review). A
    recompute takes the last training forward's K first."""
    from tests.workers import auto_recompute_beside_an_evaluation

    for r in mc2.run_local(auto_recompute_beside_an_evaluation, 2, args=(8,)):
        assert r["error"] is None, r["error"]
