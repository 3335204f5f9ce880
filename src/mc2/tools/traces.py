"""What ``--trace`` writes for a bench report: a Chrome trace of every mode, the Gantt picture
of serial against the best MC2 mode, and per-rank metrics (``mc2 bench``, ``mc2 demo``)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from mc2.tools.bench import BenchReport


def write_traces(report: BenchReport, folder: Path) -> list[Path]:
    """Chrome trace of every mode, Gantt of serial vs best MC2, per-rank metrics."""
    from mc2.observation.plot import plot_gantt
    from mc2.observation.profiler import metrics_of, write_chrome_trace

    folder.mkdir(parents=True, exist_ok=True)
    tokens = report.config.tokens_per_rank
    per_mode = {mode: [asdict(metrics_of(spans, tokens=tokens)) for spans in ranks]
                for mode, ranks in report.traces.items()}
    metrics_path = folder / "metrics.json"
    metrics_path.write_text(json.dumps(
        {"per_mode_per_rank": per_mode, "profiler_overhead": report.profiler_overhead}, indent=2))
    pair = {m: report.traces[m] for m in ("serial", report.best.mode)}
    return [write_chrome_trace(folder / "trace.json", report.traces),
            plot_gantt(pair, folder / "gantt.png",
                       title=f"serial vs {report.best.mode}: {report.world_size} ranks x "
                             f"{tokens} tokens, forward + backward"),
            metrics_path]
