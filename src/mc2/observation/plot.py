"""Gantt pictures of profiled runs, in the article's style: one lane per engine.

matplotlib is imported only when a picture is drawn (install ``mc2[plot]``); the core stays
torch-only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from mc2.observation.profiler import ENGINES
from mc2.observation.timeline import Span


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or a clear error naming the extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("drawing pictures needs matplotlib: pip install 'mc2[plot]'") from exc
    return plt


def saved(fig: Any, path: str | Path) -> Path:
    """Lay ``fig`` out, write it to ``path`` and close it; the path."""
    fig.tight_layout()
    fig.savefig(Path(path), dpi=110)
    pyplot().close(fig)
    return Path(path)


def plot_gantt(runs: dict[str, Sequence[Sequence[Span]]], path: str | Path,
               title: str = "") -> Path:
    """Draw every run (e.g. serial, MC2) one above the other on one time axis (ms).

    Each rank has two lanes, compute and communication; micro-batches have their own colours,
    waits (communication not hidden) are drawn hatched on the compute lane, whole-call work
    (handshake, counts exchange, weighted sum) in grey.
    """
    plt = pyplot()
    from matplotlib.patches import Patch

    rows = [(label, rank, spans) for label, ranks in runs.items()
            for rank, spans in enumerate(ranks)]
    fig, ax = plt.subplots(figsize=(14, 0.9 * len(rows) * 2 + 1.5))
    cmap = plt.get_cmap("tab10")
    yticks, ylabels = [], []
    for row, (label, rank, spans) in enumerate(rows):
        origin = min((s.start for ranks in [runs[label]] for sp in ranks for s in sp),
                     default=0.0)
        for s in spans:
            if s.kind == "step":
                continue
            lane = ENGINES[s.kind]  # 0: compute, 1: communication
            y = (len(rows) - 1 - row) * 2.6 + (1 - lane) * 1.1
            color = "0.75" if s.micro_batch < 0 else cmap(s.micro_batch % 10)
            ax.broken_barh([((s.start - origin) * 1e3, s.duration * 1e3)], (y, 0.9),
                           facecolors="white" if s.kind == "wait" else color,
                           edgecolors=color if s.kind == "wait" else "none",
                           hatch="////" if s.kind == "wait" else None,
                           alpha=0.55 if s.phase == "backward" else 0.95, linewidth=0.6)
        base = (len(rows) - 1 - row) * 2.6
        yticks += [base + 1.55, base + 0.45]
        ylabels += [f"{label} r{rank} compute", f"{label} r{rank} comm"]
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels, fontsize=8)
    ax.set_xlabel("time since the run's first event (ms)")
    ax.set_title(title or "mc2 timeline: forward (solid) and backward (light), per micro-batch")
    ax.legend(handles=[Patch(facecolor=cmap(i), label=f"micro-batch {i}") for i in range(4)]
              + [Patch(facecolor="white", edgecolor="k", hatch="////", label="wait (exposed)"),
                 Patch(facecolor="0.75", label="whole call")], loc="upper right", fontsize=7,
              ncol=3)
    ax.grid(axis="x", alpha=0.3)
    return saved(fig, path)
