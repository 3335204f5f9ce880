"""Run one benchmark command on this tree and on another commit, alternating, in one sitting.

Why: "speed unchanged" is a ratio of two trees measured on the same machine at the same time:
run one after the other, a slow spell of the machine falls on one of them.
This makes a ``git worktree`` of ``--base`` and one of ``--this`` (default ``HEAD``: the
committed tree, so the sources may be edited while it runs; both removed at the end), then
runs the command
``--runs`` times per tree, alternating (this, base, base, this, ...: each tree goes first as
often as last), each with ``PYTHONPATH`` naming that tree's ``src`` first (it takes precedence
over the editable install) and ``{json}`` in the command replaced by a file of its own.

Example (the small-batch capacity benchmark against the commit before a change)::

    python benchmarks/compare_trees.py --base 18c234b --runs 2 --out docs/speed_ -- \\
        python benchmarks/small_batch.py --worlds 2 --sizes 16,128 --rounds 7 --json {json}

writes ``docs/speed_this_0.json``, ``docs/speed_base_0.json``, ...
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--base", required=True, help="the commit to compare with")
    parser.add_argument("--this", default="HEAD", help="the commit measured (default HEAD)")
    parser.add_argument("--runs", type=int, default=2, help="runs per tree (default 2)")
    parser.add_argument("--out", required=True, help="json path prefix: PREFIX{this,base}_N.json")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="after --: the command; {json} is replaced by each run's file")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    trees = {name: Path(tempfile.mkdtemp(prefix=f"mc2-{name}-")) / "tree"
             for name in ("this", "base")}
    for name, rev in (("this", args.this), ("base", args.base)):
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach",
                        str(trees[name]), rev], check=True, capture_output=True)
    prefix = str(Path(args.out).resolve())
    try:
        order = [(n, trees[n]) for n in ("this", "base", "base", "this")]
        runs = {"this": 0, "base": 0}
        for i in range(2 * args.runs):
            name, tree = order[i % 4]
            out = f"{prefix}{name}_{runs[name]}.json"
            runs[name] += 1
            env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}"
                   f"{os.environ.get('PYTHONPATH', '')}"}
            argv = [a.replace("{json}", out) for a in command]
            started = time.monotonic()
            print(f"[{i + 1}/{2 * args.runs}] {name}: {' '.join(argv)}", flush=True)
            subprocess.run(argv, env=env, cwd=tree, check=True)
            print(f"    {time.monotonic() - started:.0f} s -> {out}", flush=True)
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                           capture_output=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], capture_output=True)


if __name__ == "__main__":
    sys.exit(main())
