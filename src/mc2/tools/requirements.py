"""What a command needs beyond torch, checked before it does any work.

A missing optional dependency found at the end of a long run wastes the run; found at the start
it is one line. :func:`missing_for` names what a command with its options needs and lacks;
the command line prints that line (with the install command) and stops, without a traceback.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from mc2.tools.netns import cluster_problem

INSTALL = {"matplotlib": "pip install 'mc2[plot]'", "transformers": "pip install 'mc2[train]'"}


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def needs(args: Any) -> list[tuple[str, str]]:
    """``(requirement, why)`` pairs for a parsed command line."""
    command = getattr(args, "command", None)
    out: list[tuple[str, str]] = []
    if command in ("bench", "demo", "plan") and getattr(args, "trace", None):
        out.append(("matplotlib", "--trace draws gantt.png"))
    if command == "simulate" and getattr(args, "plot", None):
        out.append(("matplotlib", "--plot draws the scale sweep"))
    if command == "train":
        out.append(("transformers", "the model is Hugging Face's Mixtral"))
        out.append(("matplotlib", "the loss curve is drawn at the end"))
    if getattr(args, "nodes", None) and command in ("bench", "demo", "plan", "train"):
        out.append(("cluster", "--nodes builds network namespaces"))
    return out


def missing_for(args: Any) -> str | None:
    """One line naming the first missing requirement and how to get it, or ``None``."""
    for requirement, why in needs(args):
        if requirement == "cluster":
            if (problem := cluster_problem()) is not None:
                return f"{why}: {problem}"
        elif not _has(requirement):
            return f"{why} and needs {requirement}: {INSTALL[requirement]}"
    return None
