"""Every Hugging Face architecture with an expert-parallel plan, under ``ep_implementation="mc2"``.

For each model type whose config's ``base_model_ep_plan`` has an ``ep_dispatch_experts`` rule
(:func:`tests.hf_tiny.ep_architectures`): does a tiny model build, does it run under
``DistributedConfig(ep_size=2, ..., ep_implementation="mc2")`` on 2 local ranks in each of
Hugging Face's two layouts (``dp``: ranks hold different batches; ``tp``: the EP group shares
one), and do its logits, loss and every gradient match the unsharded model (float32, relative
1e-5)? One world per layout and batch of architectures (:func:`tests.workers_hf_ep.check`)::

    .venv/bin/python benchmarks/hf_architectures.py --json docs/hf_architectures.json \\
        --markdown docs/hf_architectures.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.hf_tiny import ep_architectures  # noqa: E402
from tests.workers_hf_ep import check  # noqa: E402

TOLERANCE = 1e-5


def verdict(result: dict[str, float] | str) -> tuple[str, str]:
    """``(status, detail)`` of one architecture in one layout."""
    if isinstance(result, str):
        last = result.strip().splitlines()[-1] if result.strip() else "?"
        status = "does not build" if result.startswith("does not build") else "fails"
        return status, last[:160]
    worst = max(result, key=result.get)
    if result[worst] <= TOLERANCE:
        return "matches", f"worst {result[worst]:.1e} ({worst})"
    return "differs", f"{worst} off by {result[worst]:.1e}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated model types (default: all)")
    p.add_argument("--layouts", default="dp,tp")
    p.add_argument("--batch", type=int, default=12, help="architectures per world")
    p.add_argument("--control", default="all_to_all",
                   help="the implementation run where mc2 does not match ('' for none)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    args = p.parse_args()
    types = args.only.split(",") if args.only else ep_architectures()
    rows: dict[str, dict[str, tuple[str, str]]] = {t: {} for t in types}
    started = time.time()
    for layout in args.layouts.split(","):
        for i in range(0, len(types), args.batch):
            part = types[i:i + args.batch]
            print(f"[{time.time() - started:6.0f}s] {layout}: {', '.join(part)}", file=sys.stderr,
                  flush=True)
            try:
                results = check(part, layout)
            except Exception as exc:  # noqa: BLE001 - a world that died: say so for its batch
                results = {t: f"the world failed: {type(exc).__name__}: {exc}" for t in part}
            for model_type, result in results.items():
                rows[model_type][layout] = verdict(result)
                print(f"  {model_type:28s} {layout}: {rows[model_type][layout][0]}",
                      file=sys.stderr, flush=True)
            # where mc2 does not match, the same check with Hugging Face's own all_to_all says
            # whether the architecture or mc2 is the cause
            control = [t for t in part if rows[t][layout][0] in ("fails", "differs")]
            if control and args.control:
                try:
                    controls = check(control, layout, implementation=args.control)
                except Exception as exc:  # noqa: BLE001
                    controls = {t: f"the world failed: {exc}" for t in control}
                for model_type, result in controls.items():
                    status, detail = verdict(result)
                    rows[model_type][f"{layout} {args.control}"] = (status, detail)
    layouts = args.layouts.split(",")
    matching = {layout: sum(rows[t][layout][0] == "matches" for t in types) for layout in layouts}
    lines = [f"{len(types)} architectures with an `ep_dispatch_experts` plan; matching the "
             f"unsharded model within {TOLERANCE:g}: "
             + ", ".join(f"{matching[lay]} in `{lay}`" for lay in layouts) + ".", "",
             "| architecture | " + " | ".join(layouts) + " | detail |",
             "|---|" + "---|" * (len(layouts) + 1)]
    for t in types:
        details = "; ".join(f"{lay}: {rows[t][lay][1]}" for lay in layouts
                            if rows[t][lay][0] != "matches")
        controls = "; ".join(f"HF `{args.control}` in `{lay}`: {rows[t][f'{lay} {args.control}'][0]}"
                             for lay in layouts if f"{lay} {args.control}" in rows[t])
        details = f"{details} ({controls})" if controls else details
        lines.append(f"| {t} | " + " | ".join(rows[t][lay][0] for lay in layouts)
                     + f" | {details or rows[t][layouts[0]][1]} |")
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    if args.json:
        args.json.write_text(json.dumps({t: {lay: list(v) for lay, v in r.items()}
                                         for t, r in rows.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
