"""mc2 in Megatron-Core 0.16.1: ``MC2MoELayer`` against Megatron's own ``MoELayer`` (alltoall
dispatcher, ``SequentialMLP`` experts) with the same weights (one loaded from the other's
``state_dict``) and the same inputs, on 2 and 4 Gloo ranks, float32: the output, the input's
gradient, the router's and every expert's weight gradient within 1e-5 of Megatron's, the aux /
seq-aux / z losses Megatron logs equal, the expert bias's token counters equal, state-dict keys
identical. One world per size runs every case (tests/workers_megatron.py). Refusals raise
``ValueError`` naming the field on every rank, and the ranks then meet in a collective.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("megatron.core")

import mc2  # noqa: E402
from tests.workers_megatron import CASES, REFUSALS, compare_layers, refusals  # noqa: E402

TOLERANCE = 1e-5


@functools.lru_cache(maxsize=None)
def _layers(world: int) -> tuple[dict, ...]:
    return tuple(mc2.run_local(compare_layers, world, args=(list(CASES),), deadline_s=900))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_mc2_layer_equals_megatrons_moe_layer(world: int, case: str) -> None:
    for rank, results in enumerate(_layers(world)):
        found = results[case]
        errors = found["errors"]
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOLERANCE, f"rank {rank}: {worst} off by {errors[worst]:.2e}"
        # every tensor compared: output, input gradient, router and each local expert's weights
        assert {"out", "x.grad", "grad router.weight"} <= set(errors)
        assert found["expert_grads"] == 2 * CASES[case]["num_moe_experts"] // world
        megatron_losses, mc2_losses = found["losses"]
        assert mc2_losses == pytest.approx(megatron_losses, rel=TOLERANCE, abs=1e-7)
        assert found["keys_equal"], f"rank {rank}: state_dict keys differ from MoELayer's"


@pytest.mark.parametrize("world", [2, 4])
def test_the_cases_exercise_what_they_name(world: int) -> None:
    """The capacity cases drop slots, the aux-loss cases log a nonzero loss, and the
    expert-bias case counts tokens: equality there is not equality of nothing."""
    for results in _layers(world):
        assert results["capacity_drops"]["dropped"] > 0
        assert results["capacity_drops_position"]["dropped"] > 0
        for case, loss in [("top2_aux_loss", "load_balancing_loss"),
                           ("sigmoid_expert_bias", "seq_load_balancing_loss"),
                           ("group_limited_z_loss", "z_loss")]:
            assert results[case]["losses"][0][loss] > 0, (case, loss)
        assert "router tokens_per_expert" in results["sigmoid_expert_bias"]["errors"]


def test_refusals_raise_naming_the_field_on_every_rank() -> None:
    for rank, found in enumerate(mc2.run_local(refusals, 2)):
        assert found.pop("after") == "2", f"rank {rank}: the ranks did not meet afterwards"
        for field in REFUSALS:
            message = found[field]
            assert message.startswith("ValueError: "), f"rank {rank}, {field}: {message}"
            assert field in message, f"rank {rank}: {message} does not name {field}"
