"""The recording of a framework's own layer loop (``mc2.integrations.layer_recording``): the
last layer runs them all; a broken or unfinished recording raises instead of losing the
recorded layers' work."""

from __future__ import annotations

import pytest
import torch

from mc2.integrations.layer_recording import NOT_RECORDED, close_recording, record_layer_call


def _loop(count: int, stop: int | None = None) -> tuple[torch.Tensor, list]:
    """Layers 0..count-1 called as a framework's loop calls them (``stop``: the loop ends
    before that layer); what the loop returns and what the run saw."""
    seen: list = []

    def run(first: torch.Tensor, calls: list) -> torch.Tensor:
        seen.extend(calls)
        return first + len(calls)

    h = torch.zeros(2)
    for index in range(count if stop is None else stop):
        h = record_layer_call(f"layer {index}", index, count, h, (index,), run)
    return h, seen


def test_the_last_layer_runs_the_recorded_calls() -> None:
    out, seen = _loop(3)
    assert seen == [("layer 0", (0,)), ("layer 1", (1,)), ("layer 2", (2,))]
    assert torch.equal(out, torch.full((2,), 3.0))
    out, seen = _loop(3)  # a finished recording leaves nothing open
    assert len(seen) == 3


def test_a_recording_whose_last_layer_never_ran_raises_at_the_next_forward() -> None:
    out, seen = _loop(3, stop=2)  # the loop stopped before its last recording layer
    assert seen == [] and torch.equal(out, torch.zeros(2))  # the input, unchanged
    with pytest.raises(RuntimeError, match="layer 2 was never called.*next forward"):
        _loop(3)
    out, seen = _loop(3)  # raised once; the next forward records afresh
    assert len(seen) == 3


def test_a_broken_recording_raises_and_an_unopened_one_is_not_recorded() -> None:
    def run(first, calls):  # pragma: no cover - never reached
        raise AssertionError

    h = torch.zeros(2)
    record_layer_call("layer 0", 0, 3, h, (), run)
    with pytest.raises(RuntimeError, match="another input"):
        record_layer_call("layer 1", 1, 3, h.clone(), (), run)
    assert record_layer_call("layer 1", 1, 3, h, (), run) is NOT_RECORDED
    record_layer_call("layer 0", 0, 3, h, (), run)
    close_recording()  # a first layer that runs unrecorded
    assert record_layer_call("layer 1", 1, 3, h, (), run) is NOT_RECORDED


class _Recorded(torch.nn.Module):
    """A layer taking part in a recording of ``count`` layers."""

    def __init__(self, index: int, count: int) -> None:
        super().__init__()
        self.index, self.count = index, count

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return record_layer_call(self, self.index, self.count, h, (),
                                 lambda first, calls: first + len(calls))


class _Block(torch.nn.Module):
    """A framework's block: its loop over ``layers``."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.stop: int | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:self.stop]:
            h = layer(h)
        return h


def test_a_recording_still_open_when_its_block_returns_raises_there() -> None:
    block = _Block([_Recorded(i, 3) for i in range(3)])
    assert torch.equal(block(torch.zeros(2)), torch.full((2,), 3.0))  # the block is hooked
    block.stop = 2  # a forward whose loop ends before its last recording layer
    with pytest.raises(RuntimeError, match=r"layer 2 was never called.*\(_Block"):
        block(torch.zeros(2))
    block.stop = None
    assert torch.equal(block(torch.zeros(2)), torch.full((2,), 3.0))  # nothing left open


def test_a_module_run_on_the_handed_back_input_raises() -> None:
    mixed = _Block([_Recorded(0, 2), torch.nn.Identity(), _Recorded(1, 2)])
    with pytest.raises(RuntimeError, match=r"layer 1 was never called.*\(Identity returned"):
        mixed(torch.zeros(2))
    hooks = torch.nn.modules.module._global_forward_hooks
    assert not hooks  # the watch is held only while a recording is open
