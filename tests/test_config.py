"""``mc2.MC2Config``: one typed configuration for every entry point, validated in one place."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

import mc2
from tests.problems import make_problem


def test_defaults_validation_and_round_trip() -> None:
    c = mc2.MC2Config()
    assert (c.micro_batches, c.overlap, c.hierarchy, c.wire_dtype) == ("auto", True, "flat", None)
    fp8 = mc2.MC2Config(micro_batches=4, wire_dtype="fp8", wire_block=64)
    assert fp8.wire_dtype is torch.float8_e4m3fn  # names become dtypes
    pair = mc2.MC2Config(wire_dtype=("int8", "bf16"))
    assert pair.wire_dtype == ("int8", torch.bfloat16)
    for config in (c, fp8, pair, mc2.MC2Config(timeout=5.0, check_finite=True, gemm="loop"),
                   mc2.MC2Config(dedup=True)):
        text = json.dumps(config.to_dict())
        assert mc2.MC2Config.from_dict(json.loads(text)) == config
    assert mc2.MC2Config.of(fp8, overlap=False) == mc2.MC2Config(
        micro_batches=4, wire_dtype="fp8", wire_block=64, overlap=False)


@pytest.mark.parametrize("bad,message", [
    ({"micro_batches": 0}, "micro_batches must be a positive int"),
    ({"micro_batches": True}, "micro_batches must be a positive int"),
    ({"overlap": 1}, "overlap must be a bool"),
    ({"dedup": "yes"}, "dedup must be a bool"),
    ({"hierarchy": "3d"}, "hierarchy must be"),
    ({"gemm": "fast"}, "gemm must be"),
    ({"timeout": "soon"}, "timeout must be a number"),
    ({"wire_dtype": torch.int32}, "wire_dtype must be None"),
    ({"wire_dtype": "fp8", "wire_block": 0}, "wire_block must be a positive int"),
    ({"wire_dtype": "fp4"}, "unknown wire format"),
    ({"overflow": "dropp"}, "overflow must be"),  # also without capacity
])
def test_bad_values_name_the_field(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mc2.MC2Config(**bad)


def test_unknown_option_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="unknown mc2 option"):
        mc2.MC2Config.of(micro_batch=2)
    p = make_problem(1, "uniform")
    with pytest.raises(TypeError, match="unknown mc2 option"):
        mc2.fused_expert(p.xs[0], *p.local_weights(0), p.ids[0], p.rws[0], microbatches=2)


def test_config_and_keywords_are_the_same_call() -> None:
    p = make_problem(1, "uneven", local_experts=4)
    args = (p.xs[0], *p.local_weights(0), p.ids[0], p.rws[0])
    config = mc2.MC2Config(micro_batches=3, wire_dtype="bf16", wire_block=16)
    by_config = mc2.fused_expert(*args, config=config)
    by_keywords = mc2.fused_expert(*args, micro_batches=3, wire_dtype=torch.bfloat16)
    overridden = mc2.fused_expert(*args, config=config.replace(wire_dtype=None),
                                  wire_dtype="bf16")
    assert torch.equal(by_config, by_keywords) and torch.equal(by_config, overridden)
    layer = mc2.MoELayer(16, 8, 4, 2, config=config).double()
    assert layer.config == config
    assert mc2.MoELayer(16, 8, 4, 2, micro_batches=3, wire_dtype="bf16").config.wire_dtype \
        is torch.bfloat16


def test_moe_layer_returns_a_named_tuple_with_losses() -> None:
    layer = mc2.MoELayer(16, 8, 4, 2, micro_batches=2).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    plain = layer(x)
    with_losses = layer(x, return_losses=True)
    assert isinstance(plain, torch.Tensor)
    assert isinstance(with_losses, mc2.MoEOutput)
    assert torch.equal(with_losses.output, plain)
    assert isinstance(with_losses.losses, mc2.RouterLosses)
    out, losses = with_losses  # unpacks as before
    assert losses.load_balancing.ndim == 0


class _Planted:
    """Unpickling this would create a file: what a malicious checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: D105
        return (Path.touch, (self.marker,))


def test_checkpoint_extra_is_json_and_a_pickle_is_refused(tmp_path: Path) -> None:
    import io

    import torch.distributed.checkpoint as dcp

    layer = mc2.MoELayer(16, 8, 4, 2)
    mc2.checkpoint.save(layer, tmp_path / "ok", extra={"step": 3, "config":
                                                      mc2.MC2Config(wire_dtype="fp8").to_dict()})
    extra = mc2.checkpoint.load(layer, tmp_path / "ok")
    assert extra["step"] == 3 and mc2.MC2Config.from_dict(extra["config"]).wire_dtype \
        is torch.float8_e4m3fn
    with pytest.raises(TypeError, match="JSON-serialisable"):
        mc2.checkpoint.save(layer, tmp_path / "bad", extra={"object": object()})
    marker = tmp_path / "code-ran"
    state = {f"model.{k}": v for k, v in layer.state_dict().items()}
    state["mc2.extra"] = io.BytesIO(pickle.dumps(_Planted(marker)))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(tmp_path / "planted"), no_dist=True)
    with pytest.raises(ValueError, match="refuses to unpickle"):
        mc2.checkpoint.load(layer, tmp_path / "planted")
    assert not marker.exists(), "loading the checkpoint ran the writer's code"


def test_public_names_are_public() -> None:
    internals = {"DispatchHandle", "MicroBatchRoute", "env", "planner", "topology"}
    assert not internals & set(mc2.__all__)
    for name in mc2.__all__:
        assert getattr(mc2, name) is not None
