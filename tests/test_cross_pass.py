"""Cross-pass overlap (each micro-batch's forward inside the previous one's backward) changes
nothing but the schedule: the same loss and gradients as ``model(...).loss.backward()``."""

from __future__ import annotations

import pytest
import torch

import mc2
from mc2.engine.fill import fill, filling
from tests.workers_overlap import cross_pass_refusals, cross_pass_step

CASES = [
    {},
    # everything to experts 0 and 1, 4 sequences in 3 micro-batches, checkpointing on
    {"splits": 3, "hostile": True, "checkpointing": True},
    {"dtype": "float32", "sync": True, "options": {"wire_dtype": "bf16"}},
    {"batch": 2, "splits": 3},  # too few sequences: the plain step, on every rank
    {"every": 2},  # the forward's stages at every other stop of the backward (_Pace)
]


def _both(rank: int, world: int) -> tuple[list, list[str]]:
    return cross_pass_step(rank, world, CASES), cross_pass_refusals(rank, world)


@pytest.fixture(scope="module")
def world() -> list[tuple[list, list[str]]]:
    """One 2-rank world for the whole file: the steps of every case, then the refusals."""
    import warnings

    from mc2.integrations.batch_overlap import BatchOverlapWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BatchOverlapWarning)
        return mc2.run_local(_both, 2, timeout_s=180)


def test_train_step_equals_the_plain_backward(world) -> None:
    for steps, _ in world:
        for case, got in zip(CASES, steps):
            # the loss is Hugging Face's, in float32 whatever the model's dtype
            plain, split = got["loss"]
            torch.testing.assert_close(split, plain, rtol=1e-6, atol=0, msg=str(case))
            tol = 1e-6 if case.get("dtype") == "float32" else 1e-12
            for name, want, mine in got["grads"]:
                assert (want is None) == (mine is None), name
                if want is not None:  # relative to the gradient's norm (sums reordered)
                    assert float((mine - want).norm()) <= tol * float(want.norm()), \
                        (case, name)  # zero where no token reached the expert
            if case.get("batch", 4) >= case.get("splits", 2):  # split: every micro-batch traced
                assert set(range(case.get("splits", 2))) <= set(got["labels"]), case
                # every later micro-batch's forward ran inside the backward before it, all
                # but its drain (the last combine and the rest of the last layer): 2 layers,
                # 2 stops each, then the drain
                filled = got["inside"]
                assert len(filled) == 5 * (case.get("splits", 2) - 1), (case, filled)
                inside = 1 if case.get("every") else 3  # spaced: fewer before its end
                assert sum(filled) >= inside * (case.get("splits", 2) - 1), (case, filled)
            else:
                assert got["inside"] == [], case


def test_what_it_refuses_it_refuses_on_every_rank(world) -> None:
    assert world[0][1] == world[1][1]
    aux, not_set_up, cache, no_grad = world[0][1]
    assert "auxiliary loss" in aux
    assert "batch_overlap=True" in not_set_up
    assert "use_cache is train_step's own" in cache
    assert "gradients are disabled" in no_grad


def test_a_fill_runs_once_per_stop_and_never_inside_itself() -> None:
    ran: list[int] = []

    def work() -> None:
        ran.append(1)
        fill()  # a stop of the work's own forward: not filled again

    fill()  # nothing installed: nothing runs
    with filling(work):
        fill()
        fill()
        with pytest.raises(RuntimeError, match="already being filled"):
            with filling(work):
                pass
    fill()
    assert ran == [1, 1]


def test_the_forward_is_spread_over_the_backward_stops_it_learned() -> None:
    from mc2.integrations.cross_pass import _Pace

    layers = torch.nn.Module()
    pace = _Pace.of(layers, 1)
    assert pace.every == 1  # nothing learned yet: a stage at every stop
    ran: list[int] = []
    left = [4]  # a forward of four stages

    def advance() -> bool:
        if not left[0]:
            return False
        left[0] -= 1
        ran.append(pace.stops)
        return True

    at_stop = pace.spaced(advance)
    for _ in range(12):
        at_stop()
    assert ran == [1, 2, 3, 4] and (pace.stops, pace.stages) == (12, 4)
    pace.learn()
    assert pace.every == 3
    again = _Pace.of(layers, 1)  # the next step: the same pace, its counts anew
    assert again is pace and (again.every, again.stops, again.stages) == (3, 0, 0)
    ran.clear()
    left[0] = 4
    at_stop = again.spaced(advance)
    for _ in range(8):
        at_stop()
    assert ran == [1, 4, 7]  # the fourth stage runs after the backward:
    again.finish(advance)
    assert len(ran) == 4 and again.stages == 4 and again.every == 2  # 8 stops, 4 stages
    assert _Pace.of(layers, 2).every == 1  # each micro-batch's own
