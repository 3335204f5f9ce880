"""A checkpoint folder written beside its place and published by a rename.

Why: DCP writes over a folder in place, every rank its shard, rank 0 its ``.metadata`` last.
A save killed on some ranks there left the old ``.metadata`` vouching for a mix of two saves,
which loaded without an error (seen: experts of two steps within one tensor). So a save
writes ``<path>.partial`` and only a complete one is renamed to ``path``, the old folder set
aside as ``<path>.old`` and removed after.

What can go wrong around that, and what is done:

- a step that fails on rank 0 (a rename refused) is agreed, so every rank raises instead of
  its peers waiting for it until the group's timeout;
- ``path`` is resolved first: a symlink names its target (renamed, the link itself was
  replaced and its data orphaned), ``.`` and ``..`` name real folders; a mount point (which
  cannot be renamed) and the working folder or one above it are refused;
- ranks whose nodes see different disks each wrote a ``.partial`` of their own, which only
  rank 0's node renamed: each node's first rank (``LOCAL_RANK`` 0) publishes one that is still
  there after rank 0's (on a shared disk none is);
- a save killed between the two renames left no ``path``, the new checkpoint whole in
  ``.partial`` (its ``.metadata`` is written last): the next save publishes that first
  instead of deleting it.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from mc2.engine.transport.comm import host_max, initialized
from mc2.engine.transport.env import debug_save_delay


def published(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """``write(folder)`` writes the checkpoint into ``folder`` (every rank calls it); this
    publishes it as ``path`` (module docstring). Every rank calls it."""
    target = Path(os.path.abspath(path)).resolve()
    partial, old = _beside(target, ".partial"), _beside(target, ".old")
    _on_each_disk(partial, lambda: _prepare(target, partial, old), "prepare")
    write(partial)
    _agreed(lambda: None, "write")  # every rank's shard on disk before the rename
    if delay := debug_save_delay():  # a test, or a rehearsal, kills the job here
        time.sleep(delay)
    _on_each_disk(partial, lambda: _publish(partial, target, old), "publish")


def _first() -> bool:
    """Rank 0 (the process, without ``torch.distributed``)."""
    return not initialized() or dist.get_rank() == 0


def _on_each_disk(partial: Path, action: Callable[[], None], step: str) -> None:
    """``action()`` on rank 0; then, once it is done, on each node's first rank where
    ``partial`` is still there: a disk rank 0 does not see (on a shared one rank 0 has
    removed or renamed it). Agreed after each: a failure raises on every rank."""
    _agreed(lambda: action() if _first() else None, step)
    _agreed(lambda: None if _first() or os.environ.get("LOCAL_RANK") != "0"
            or not partial.exists() else action(), step)


def _beside(target: Path, suffix: str) -> Path:
    return target.with_name(target.name + suffix)


def _prepare(target: Path, partial: Path, old: Path) -> None:
    """Refuse a place that cannot be renamed; finish a publish a kill interrupted; clear what
    a killed write left."""
    if target.is_mount():
        raise ValueError(f"mc2.checkpoint.save: {target} is a mount point, which cannot be "
                         "replaced by a rename; save to a folder inside it")
    cwd = Path.cwd().resolve()
    if cwd == target or target in cwd.parents:
        raise ValueError(f"mc2.checkpoint.save: {target} is the working folder or holds it; "
                         "save to a folder of its own")
    if not target.exists() and (partial / ".metadata").is_file():
        os.replace(partial, target)  # whole: killed between the renames
    shutil.rmtree(partial, ignore_errors=True)  # a killed write's
    if old.exists() and target.exists():
        shutil.rmtree(old)


def _publish(partial: Path, target: Path, old: Path) -> None:
    """``partial`` renamed to ``target``, an old ``target`` set aside first, then removed."""
    if target.exists():
        os.replace(target, old)
    os.replace(partial, target)
    shutil.rmtree(old, ignore_errors=True)


def _agreed(action: Callable[[], Any], step: str) -> None:
    """``action()`` on every rank, then every rank raises where one failed (host numbers, no
    device in the way), instead of its peers waiting for it until the group's timeout."""
    error = None
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - raised below, after every rank knows
        error = exc
    if initialized():
        (failed,) = host_max([float(error is not None)], None, "checkpoint")
        if failed and error is None:
            raise RuntimeError(f"mc2.checkpoint.save: another rank failed to {step} the "
                               "checkpoint (its error is raised there)")
    if error is not None:
        raise error
