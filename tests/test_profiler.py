"""Profiler events are well-formed, nest in the step, and export as a valid Chrome trace."""

from __future__ import annotations

import json

import jsonschema
import pytest

import mc2
from mc2.observation.profiler import aggregate, chrome_trace, metrics_of
from tests.workers import profiled_step

# The subset of the Trace Event Format (the Chrome/Perfetto JSON) that we emit: complete ("X")
# events with microsecond timestamps and metadata ("M") events naming processes and threads.
CHROME_TRACE_SCHEMA = {
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "traceEvents": {
            "type": "array",
            "items": {
                "oneOf": [
                    {"type": "object",
                     "required": ["name", "ph", "ts", "dur", "pid", "tid"],
                     "properties": {"name": {"type": "string"}, "ph": {"const": "X"},
                                    "ts": {"type": "number", "minimum": 0},
                                    "dur": {"type": "number", "minimum": 0},
                                    "pid": {"type": "integer"}, "tid": {"type": "integer"},
                                    "cat": {"type": "string"}, "args": {"type": "object"}}},
                    {"type": "object",
                     "required": ["name", "ph", "pid", "args"],
                     "properties": {"ph": {"const": "M"},
                                    "name": {"enum": ["process_name", "thread_name",
                                                      "process_sort_index"]}}},
                ]
            },
        },
    },
}

K = 3


@pytest.fixture(scope="module")
def runs() -> dict[str, list]:
    return {"serial": mc2.run_local(profiled_step, 2, args=(1, False))[0],
            f"mc2 K={K}": mc2.run_local(profiled_step, 2, args=(K, True))[0]}


def test_every_micro_batch_has_dispatch_compute_combine(runs) -> None:
    for label, ranks in runs.items():
        k = 1 if label == "serial" else K
        for rank, spans in enumerate(ranks):
            for phase in ("forward", "backward"):
                for i in range(k):
                    mine = [s for s in spans if s.phase == phase and s.micro_batch == i]
                    names = {(s.kind, s.name) for s in mine}
                    comm = "comm" if label == "serial" else "transfer"
                    for need in ((comm, "dispatch"), ("compute", "experts"), (comm, "combine")):
                        assert need in names, f"{label} rank {rank} {phase} {i}: no {need}"


def test_spans_are_positive_and_nest_in_the_step(runs) -> None:
    for ranks in runs.values():
        for spans in ranks:
            steps = [s for s in spans if s.kind == "step"]
            assert len(steps) == 1, "exactly the marked step; nothing after the block"
            step = steps[0]
            for s in spans:
                assert s.end >= s.start, f"negative duration: {s}"
                assert step.start <= s.start and s.end <= step.end + 1e-3, f"outside step: {s}"


def test_metrics_are_consistent(runs) -> None:
    per_rank = [metrics_of(spans, tokens=13) for spans in runs[f"mc2 K={K}"]]
    for m in per_rank:
        assert 0 < m.compute_s < m.step_s
        assert 0 <= m.exposed_comm_s <= m.step_s
        assert 0 <= m.comm_share <= 1
        assert m.tokens_per_s == pytest.approx(13 / m.step_s)
    assert aggregate(per_rank).step_s == max(m.step_s for m in per_rank)


def test_chrome_trace_validates(runs, tmp_path) -> None:
    trace = chrome_trace(runs)
    jsonschema.validate(trace, CHROME_TRACE_SCHEMA)
    pids = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert pids == {0, 1, 1000, 1001}, "one process row per (run, rank)"
    assert {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}
    path = mc2.observation.profiler.write_chrome_trace(tmp_path / "t.json", runs)
    assert json.loads(path.read_text()) == json.loads(json.dumps(trace))


def test_gantt_png_is_written(runs, tmp_path) -> None:
    from mc2.observation.plot import plot_gantt

    path = plot_gantt(runs, tmp_path / "g.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_metrics_count_what_falls_inside_the_marked_steps_once() -> None:
    """A 2 s wait inside a 10 s step, beside a warm-up's wait outside it and a second
    thread's wait overlapping the first: comm share 0.2 (before: the warm-up's counted over
    the step's window, and overlapping waits twice: 0.70)."""
    from mc2.observation.timeline import Span

    spans = [Span("step", "step", "forward", -1, 10.0, 20.0),
             Span("wait", "dispatch", "forward", 0, 12.0, 14.0),
             Span("wait", "dispatch", "forward", 1, 13.0, 14.0),  # the other thread's
             Span("wait", "warm-up", "forward", 0, 0.0, 3.0),
             Span("compute", "experts", "forward", 0, 14.0, 19.0)]
    m = metrics_of(spans)
    assert m.step_s == 10.0 and m.exposed_comm_s == 2.0 and m.comm_share == 0.2
    assert m.compute_s == 5.0


def test_the_bench_reports_the_slowest_ranks_row_whole() -> None:
    """Step, exposed communication and compute of one rank, the slowest: a maximum field by
    field paired the slow rank's step with the waiting rank's exposed communication."""
    from mc2.tools.bench import slowest_row

    busy, waiting = [127.6, 11.3, 112.7], [114.6, 56.9, 54.0]
    assert slowest_row([busy, waiting]) == busy and slowest_row([waiting, busy]) == busy
