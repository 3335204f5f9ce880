"""Every import path the README, the docs and the docstrings show resolves.

A user copies ``import mc2.checkpoint`` or ``mc2.engine.transport.wire.parse_wire_dtype`` from the text;
when a module moves, the text must move with it (or the old path must keep working). This test
collects every dotted ``mc2.…`` path and every ``from mc2… import …`` line from ``README.md``,
``docs/*.md`` and the package's own sources, and resolves each one.
"""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "src" / "mc2").rglob("*.py"))]
DOTTED = re.compile(r"(?<![\w./-])mc2(?:\.[A-Za-z_]\w*)+")
FROM_IMPORT = re.compile(r"^\s*from (mc2(?:\.\w+)*) import ([\w, ()]+)", re.M)


def _prose(path: Path) -> str:
    """What a reader reads: a markdown file whole; of a Python file its docstrings and
    comments (its code names local variables ``mc2`` too, and imports are checked by running)."""
    text = path.read_text()
    if path.suffix != ".py":
        return text
    tree = ast.parse(text)
    docs = [ast.get_docstring(node, clean=False) or "" for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    comments = [tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                if tok.type == tokenize.COMMENT]
    return "\n".join(docs + comments)


def _paths() -> list[str]:
    found: set[str] = set()
    for path in TEXTS:
        text = _prose(path)
        found.update(m.group(0).rstrip(".") for m in DOTTED.finditer(text))
        for module, names in FROM_IMPORT.findall(text):
            for name in names.replace("(", "").replace(")", "").split(","):
                if name.strip():
                    found.add(f"{module}.{name.strip()}")
    return sorted(found)


def resolve(path: str) -> object:
    """Import the longest importable prefix of ``path``, then get the rest as attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(path)


PATHS = _paths()


def test_texts_show_paths() -> None:
    assert "mc2.checkpoint" in PATHS and len(PATHS) > 40


@pytest.mark.parametrize("path", PATHS)
def test_path_resolves(path: str) -> None:
    resolve(path)


def test_import_mc2_checkpoint_is_a_module() -> None:
    import mc2.checkpoint

    assert callable(mc2.checkpoint.save) and callable(mc2.checkpoint.load)
    assert importlib.import_module("mc2.checkpoint") is mc2.checkpoint
