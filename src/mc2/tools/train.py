"""``mc2 train``: its options, and where it runs (a local world, torchrun, emulated nodes).

The training loop itself is :mod:`mc2.tools.training`. Under ``torchrun`` this
module is the program: ``torchrun --nproc-per-node 4 -m mc2.tools.train --ep-size 2``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from mc2.engine.decide.config import MC2Config
from mc2.tools.config_args import add_config_arguments, config_from_arguments
from mc2.tools.netns import EmulatedCluster, NetnsError, torchrun_on_nodes
from mc2.tools.training import (TrainConfig, launched, plot_losses, run_launched, run_training,
                                 summarize)

DESCRIPTION = """\
Hugging Face MixtralForCausalLM (4 layers, 8 experts, top-2, built from a local config) switched
to MC2 with enable_mc2 on a ("dp", "ep") mesh, trained on this machine's Python standard library
sources. The experts are split over EP groups of --ep-size ranks and replicated over the
world / ep-size DP groups.

Where it runs:
  mc2 train --world-size 4 --ep-size 2          a local Gloo world of 4 processes
  torchrun --nproc-per-node 4 -m mc2.tools.train --ep-size 2
                                                as it is under torchrun (any launcher that sets
                                                RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
  sudo mc2 train --nodes 2 --ranks-per-node 2 --ep-size 2 --inter-node-bandwidth 1gbit
                                                torchrun --nnodes 2 across two emulated nodes
                                                (network namespaces, tc-shaped link; DP crosses
                                                the slow link, EP stays inside a node)

--compare trains serial and MC2 from the same seed and plots both loss curves."""


def add_train_parser(sub: Any) -> None:
    tr = sub.add_parser("train", help="train a small Mixtral-style model end to end with EP x DP",
                        description=DESCRIPTION,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    tr.add_argument("--steps", type=int, default=50)
    tr.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    tr.add_argument("--seq", type=int, default=128)
    tr.add_argument("--world-size", type=int, default=2,
                    help="local Gloo ranks (ignored under torchrun, which sets it)")
    tr.add_argument("--ep-size", type=int, default=None,
                    help="ranks per expert-parallel group; must divide the world size and the "
                         "8 experts (default: the whole world, no DP)")
    tr.add_argument("--grad-sync", choices=["overlap", "after"], default="overlap",
                    help="overlap: mc2.GradientSync all-reduces buckets during the backward; "
                         "after: mc2.average_gradients once the backward is done")
    tr.add_argument("--fsdp", action="store_true",
                    help="shard everything with mc2.fully_shard (FSDP2): experts over the DP "
                         "ranks of their EP group, the rest over the world; FSDP2 reduces the "
                         "gradients (--grad-sync does not apply)")
    tr.add_argument("--compare", action="store_true", help="train serial and MC2; compare")
    tr.add_argument("--out", type=Path, default=Path("train_out"),
                    help="folder for loss_curve.png and losses.json (default %(default)s)")
    tr.add_argument("--checkpoint-every", type=int, default=0,
                    help="steps between checkpoints (mc2.parallel.checkpoint folders under "
                         "--out/checkpoints; a resume may use another --ep-size)")
    tr.add_argument("--resume", action="store_true", help="continue from --out/checkpoints")
    tr.add_argument("--nodes", type=int, default=None,
                    help="run torchrun --nnodes across this many emulated nodes (network "
                         "namespaces; needs root and iproute2)")
    tr.add_argument("--device", default="cpu",
                    help="cpu (default) or an accelerator type such as cuda: each rank trains on "
                         "its local device (under torchrun, LOCAL_RANK's)")
    tr.add_argument("--backend", default=None,
                    help="process-group backend under torchrun (default: gloo on cpu; PyTorch's "
                         "default, gloo for CPU and nccl for CUDA tensors, on a device)")
    tr.add_argument("--ranks-per-node", type=int, default=2, help="with --nodes (default 2)")
    tr.add_argument("--inter-node-bandwidth", default="1gbit",
                    help="with --nodes: tc rate of each node's link (default %(default)s)")
    add_config_arguments(tr)  # --micro-batches (default here: 2), --serial, --wire-dtype, ...
    tr.set_defaults(run=run_train_command)


def _options(args: argparse.Namespace) -> list[str]:
    """The options to hand to ``-m mc2.tools.train`` on every node (all but the node layout);
    the MC2Config goes as ``--out/mc2_config.json``, which ``--mc2-config`` reads back."""
    config = args.out.resolve() / "mc2_config.json"
    config.write_text(json.dumps(_call_config(args).to_dict()))
    out = ["--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
           "--out", str(args.out.resolve()), "--checkpoint-every", str(args.checkpoint_every),
           "--grad-sync", args.grad_sync, "--device", args.device, "--mc2-config", str(config)]
    if args.ep_size:
        out += ["--ep-size", str(args.ep_size)]
    return out + [f"--{flag}" for flag in ("compare", "resume", "fsdp") if getattr(args, flag)]


def run_train_command(args: argparse.Namespace) -> int:
    """``mc2 train``; a bad value or a cluster that cannot be built is one line and status 2."""
    try:
        return _on_emulated_nodes(args) if args.nodes else _train(args, under_torchrun=launched())
    except (NetnsError, ValueError) as exc:
        print(f"mc2: {exc}", file=sys.stderr)
        return 2


def _on_emulated_nodes(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    with EmulatedCluster(args.nodes, args.ranks_per_node, args.inter_node_bandwidth) as c:
        print(f"mc2 train: torchrun --nnodes {args.nodes} --nproc-per-node "
              f"{args.ranks_per_node} across emulated nodes, links shaped to {c.bandwidth}",
              file=sys.stderr, flush=True)
        torchrun_on_nodes(c, ["-m", "mc2.tools.train", *_options(args)])
    return 0


def _call_config(args: argparse.Namespace) -> MC2Config:
    """The MC2Config of the command line; ``mc2 train``'s K is 2 unless given."""
    return config_from_arguments(args, default=MC2Config(micro_batches=2))


def _train(args: argparse.Namespace, *, under_torchrun: bool) -> int:
    call = _call_config(args)
    base = TrainConfig(steps=args.steps, batch=args.batch, seq=args.seq, ep_size=args.ep_size,
                       grad_sync=args.grad_sync, fsdp=args.fsdp,
                       checkpoint_every=args.checkpoint_every,
                       resume=args.resume, device=args.device, **call.to_dict())
    k, wire = call.micro_batches, call.to_dict()["wire_dtype"]
    mc2_label = f"MC2 K={k}" + ("" if wire == "none" else f" wire {wire}")
    runs = [("serial", False), (mc2_label, True)] if args.compare else \
        [("serial" if not call.overlap else mc2_label, call.overlap)]
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.world_size
    rank0 = not under_torchrun or int(os.environ["RANK"]) == 0
    args.out.mkdir(parents=True, exist_ok=True)
    curves: dict[str, Any] = {}
    for label, overlap in runs:
        cfg = replace(base, overlap=overlap, progress=rank0,
                      checkpoint_dir=str(args.out / "checkpoints" / label.replace(" ", "_")))
        if rank0:
            print(f"mc2 train: {label}, {world} ranks as dp {world // (cfg.ep_size or world)}"
                  f" x ep {cfg.ep_size or world}, {cfg.steps} steps of {cfg.batch} x "
                  f"{cfg.seq} bytes per rank", file=sys.stderr, flush=True)
        backend = args.backend or ("gloo" if args.device == "cpu" else None)
        curves[label] = run_launched(cfg, backend) if under_torchrun else \
            run_training(cfg, world_size=world)
    if not rank0:
        return 0
    text = summarize(curves)
    print(text)
    (args.out / "summary.txt").write_text(text + "\n")
    (args.out / "losses.json").write_text(json.dumps({"config": asdict(base), "runs": curves},
                                                     indent=2))
    path = plot_losses({k: v["losses"] for k, v in curves.items()}, args.out / "loss_curve.png",
                       title=f"tiny Mixtral on Python's standard library, {world} ranks, "
                             f"ep {base.ep_size or world}")
    print(f"wrote {path} and {args.out / 'losses.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m mc2.tools.train [options]``: ``mc2 train`` as one rank of a launcher."""
    parser = argparse.ArgumentParser(prog="python -m mc2.tools.train")
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train", *(sys.argv[1:] if argv is None else argv)])
    return run_train_command(args)


def _exit_now(code: int) -> None:
    """End this rank without the interpreter's finalization, everything written first.

    Under torchrun a rank that returned normally, its process group destroyed, aborted now
    and then in PyTorch's teardown ("terminate called without an active exception", seen
    twice in about ten full test runs): Gloo's worker threads can still hold objects with
    Python references while the interpreter is torn down (pytorch/pytorch#179291). Nothing is
    left to do at that point: the checkpoints and the history are written, so skip it."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":  # torchrun --nproc-per-node N -m mc2.tools.train [mc2 train options]
    try:
        status = main()
    except SystemExit as stop:  # argparse's --help and errors: as Python would end
        status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
    _exit_now(status)
