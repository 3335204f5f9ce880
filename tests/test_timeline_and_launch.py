"""The Timeline records every micro-batch's work; the local world never hangs on failure."""

from __future__ import annotations

import time

import pytest

import mc2
from mc2.tools.launch import LocalWorldError
from tests.workers import (
    gradient_mode_differs, initialised_ranks, peer_leaves_early, raise_on_rank, timeline_spans)


def test_timeline_has_every_micro_batch_step() -> None:
    k = 3
    for rank, spans in enumerate(mc2.run_local(timeline_spans, 2, args=(k, 40))):
        assert all(end >= start for *_, start, end in spans), "negative duration"
        for phase in ("forward", "backward"):
            for i in range(k):
                names = {(kind, name) for kind, name, ph, mb, *_ in spans
                         if ph == phase and mb == i}
                for needed in (("compute", "gather"), ("compute", "experts"),
                               ("compute", "scatter"), ("wait", "dispatch"), ("wait", "combine")):
                    assert needed in names, f"rank {rank} {phase} micro-batch {i} lacks {needed}"
        whole = [s for s in spans if s[3] == -1]
        assert {s[1] for s in whole} >= {"handshake", "counts", "weighted_sum"}
    # a call whose ids ride in the handshake (13 and 16 tokens of top-2) exchanges no counts
    for spans in mc2.run_local(timeline_spans, 2, args=(k, 13)):
        names = {s[1] for s in spans if s[3] == -1}
        assert "handshake" in names and "counts" not in names, names


def test_gradient_mode_must_agree() -> None:
    messages = mc2.run_local(gradient_mode_differs, 2, timeout_s=20, deadline_s=30)
    assert all(m is not None and "gradient mode" in m for m in messages), messages


def test_failing_rank_is_reported_and_world_ends() -> None:
    with pytest.raises(LocalWorldError, match="planted failure on rank 1") as info:
        mc2.run_local(raise_on_rank, 2, args=(1,), deadline_s=60)
    assert 1 in info.value.failures


@pytest.mark.parametrize("world", [2, 4])
def test_no_rank_runs_its_function_before_every_rank_is_initialised(world: int) -> None:
    """A rank whose function returns at once used to be able to exit while a slower peer was
    still connecting its Gloo pairs: the peer then failed in its init, and the world reported
    that instead of what the functions did (once, under load, the test above)."""
    assert mc2.run_local(initialised_ranks, world) == [[True] * world] * world


def test_dead_peer_becomes_an_error_not_a_freeze() -> None:
    start = time.monotonic()
    with pytest.raises(LocalWorldError) as info:
        mc2.run_local(peer_leaves_early, 2, timeout_s=10, deadline_s=60)
    assert 0 in info.value.failures, "rank 0 should fail in its collective"
    assert time.monotonic() - start < 60
