"""The command line's view of :class:`mc2.MC2Config`: one flag per field, one parser for all.

``mc2 train`` takes every field; ``mc2 bench`` sweeps some of them (several K, layouts and wire
formats in one run) and takes the rest from here. Names follow the fields: ``--micro-batches``,
``--serial`` (``overlap=False``), ``--hierarchy``, ``--wire-dtype``, ``--wire-block``, ``--gemm``,
``--timeout``, ``--check-finite``; ``--mc2-config FILE`` reads a JSON file of fields
(``MC2Config.to_dict()``), which the flags given on the command line then override.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from mc2.engine.decide.config import GEMMS, HIERARCHIES, MC2Config

FIELDS = tuple(f.name for f in dataclasses.fields(MC2Config))


def _micro_batches(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int or 'auto', got {text!r}") \
            from None


def _wire(text: str) -> Any:
    parts = tuple(p.strip() for p in text.split(","))
    return parts[0] if len(parts) == 1 else parts


def add_config_arguments(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """Add a flag for every :class:`MC2Config` field not in ``skip`` (defaults: unset, so that
    only what the user gives overrides ``--mc2-config`` and the defaults)."""
    group = parser.add_argument_group(
        "how each fused call runs (mc2.MC2Config; unset flags keep its defaults)")
    group.add_argument("--mc2-config", type=Path, default=None, metavar="FILE",
                       help="a JSON file of MC2Config fields (as MC2Config.to_dict() writes)")
    flags: dict[str, dict[str, Any]] = {  # by field; the flag is its name, but --serial
        "micro_batches": {"type": _micro_batches, "metavar": "K",
                          "help": "K, or 'auto' (the planner's choice)"},
        "overlap": {"action": "store_const", "const": False,
                    "help": "overlap=False: the serial path (the baseline)"},
        "hierarchy": {"choices": HIERARCHIES, "help": "All-to-All layout across nodes"},
        "wire_dtype": {"type": _wire, "metavar": "FORMAT",
                       "help": "rows on the wire: none, bf16, fp16, fp8, int8, or dispatch,combine"},
        "wire_block": {"type": int, "metavar": "N", "help": "channels per scale of fp8/int8 (128)"},
        "gemm": {"choices": GEMMS, "help": "expert GEMM strategy (auto)"},
        "timeout": {"type": float, "metavar": "SECONDS",
                    "help": "seconds any wait may take (300; 0: none)"},
        "check_finite": {"action": "store_const", "const": True,
                         "help": "reject NaN/Inf tokens on every rank"},
        "dedup": {"action": "store_const", "const": True,
                  "help": "rows once per destination rank, reduced there"},
        "capacity": {"type": int, "metavar": "N",
                     "help": "fixed slabs of N rows per rank: no host read"},
        "overflow": {"choices": ("raise", "drop"), "help": "with --capacity: rows that do not fit"},
    }
    for field, options in flags.items():
        if field not in skip:
            flag = "--serial" if field == "overlap" else "--" + field.replace("_", "-")
            group.add_argument(flag, dest=f"mc2_{field}", default=None, **options)


def config_from_arguments(args: argparse.Namespace, *, default: MC2Config | None = None,
                          **overrides: Any) -> MC2Config:
    """The :class:`MC2Config` the command line asks for: ``--mc2-config`` (else ``default``,
    else the defaults), then the flags given, then ``overrides``.

    Raises:
        ValueError: a bad value (the message names the field).
    """
    base = default or MC2Config()
    if getattr(args, "mc2_config", None) is not None:
        base = MC2Config.from_dict(json.loads(Path(args.mc2_config).read_text()))
    given = {f: getattr(args, f"mc2_{f}") for f in FIELDS
             if getattr(args, f"mc2_{f}", None) is not None}
    return MC2Config.of(base, **{**given, **overrides})

