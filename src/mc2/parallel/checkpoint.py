"""Sharded checkpoints that move between meshes, on ``torch.distributed.checkpoint`` (DCP).

Every rank writes only what it holds. Expert shards are described to DCP as
:class:`~torch.distributed.tensor.DTensor` slices of the full ``[num_experts, ...]`` tensor:
``Shard(0)`` over ``"ep"`` and ``Replicate()`` over ``"dp"``. Everything else is a replicated
plain tensor. DCP writes each piece once, whichever ranks share it, and nothing is gathered to
rank 0. Loading asks for the pieces the new layout needs, so a checkpoint saved at
``dp=2 x ep=2`` loads at ``ep=4``, at ``dp=4 x ep=1``, or in one process without
``torch.distributed``.

The keys are the model's own: an ``enable_mc2`` model keeps Hugging Face's names
(``...mlp.experts.gate_up_proj``). So the unpatched model loads the same files, with full
expert tensors, and a model trained with mc2 goes back to the HF ecosystem with no conversion.

Optimizer state goes through ``torch.distributed.checkpoint.state_dict`` (keyed by parameter
name, so it reshards the same way); an expert's moments are sharded like the expert.

``extra`` (a step count, a loss history, a config) is stored as JSON, never pickled: loading a
checkpoint must not run code its writer chose. A checkpoint whose ``extra`` is a pickle (one
written by an earlier mc2, or crafted) is refused. DCP's own ``.metadata`` file is a pickle,
though (``torch.distributed.checkpoint.FileSystemReader`` unpickles it): load checkpoints only
from sources you trust, whatever the library.
"""

from __future__ import annotations

import io
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mc2.engine.transport.comm import initialized
from mc2.parallel.checkpoint_publish import published
from mc2.parallel.expert_shards import ExpertShard, expert_shards

EXTRA_KEY = "mc2.extra"
MODEL_PREFIX = "model."
OPTIMIZER_PREFIX = "optimizer."


def _device_mesh(shard: ExpertShard) -> tuple[Any, list[Any]]:
    """The mesh and placements that describe ``shard`` as a slice of the full tensor."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard

    layout = shard.layout
    if layout.mesh is not None and layout.mesh.ndim == 2:
        dims = list(layout.mesh.mesh_dim_names)
        placements = [Shard(0) if name == "ep" else Replicate() for name in dims]
        return layout.mesh, placements
    if layout.mesh is not None:
        return layout.mesh, [Shard(0)]
    group = layout.ep_group if layout.ep_group is not None else dist.group.WORLD
    return DeviceMesh.from_group(group, shard.param.device.type), [Shard(0)]


def _dp_sharded_mesh(shard: ExpertShard, dp_mesh: Any) -> tuple[Any, list[Any]]:
    """For an expert block FSDP2 shards over ``dp``: a view of the ``("dp", "ep")`` mesh with
    its dimensions as ``("ep", "dp")`` and ``Shard(0)`` on both: the full tensor is split over
    ``ep`` first (each EP rank's block), then each block over ``dp`` (FSDP's chunks). Only
    coordinates are read from it: no process group is made."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    mesh = shard.layout.mesh
    if mesh is None or mesh.ndim != 2:
        raise ValueError(f"{shard.name}: sharded over {dp_mesh} but built without a "
                         "('dp', 'ep') mesh")
    if dp_mesh.ndim != 1 or dp_mesh.size() != mesh["dp"].size():
        raise ValueError(f"{shard.name}: FSDP shards it over {dp_mesh}, not over the 'dp' "
                         f"dimension of its block's mesh {mesh}")
    names = list(mesh.mesh_dim_names)
    ranks = mesh.mesh.permute(names.index("ep"), names.index("dp")).contiguous()
    swapped = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=("ep", "dp"),
                         _init_backend=False)
    return swapped, [Shard(0), Shard(0)]


def _as_global(tensor: Tensor, shard: ExpertShard, meshes: dict[Any, Any],
               leading: int | None = None) -> Any:
    """``tensor`` (shaped like this rank's shard, plain or FSDP2's DTensor over ``dp``) as a
    DTensor of the full expert tensor, sharing its storage; ``leading``: the full tensor's
    first dimension where it is not the expert count (a block per EP rank)."""
    from torch.distributed.tensor import DTensor, Shard

    full_shape = (leading or shard.num_experts, *tensor.shape[1:])
    fsdp = isinstance(tensor, DTensor)  # fully_shard: this rank holds a dp chunk of its block
    if fsdp and tuple(tensor.placements) != (Shard(0),):
        raise ValueError(f"{shard.name}: expected FSDP's Shard(0) over 'dp', got "
                         f"{tensor.placements}")
    key = (fsdp, id(shard.layout))
    if key not in meshes:
        meshes[key] = _dp_sharded_mesh(shard, tensor.device_mesh) if fsdp else _device_mesh(shard)
    mesh, placements = meshes[key]
    return DTensor.from_local(tensor.to_local() if fsdp else tensor, mesh, placements,
                              run_check=False, shape=full_shape,
                              stride=torch.empty(full_shape, device="meta").stride())


def _model_state(model: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(state for DCP, the model's own state)``: ``model.state_dict()`` with every expert
    shard as a slice of the full tensor (without ``torch.distributed`` the shards already are
    the full tensors). The expert entries of the first share storage with those of the
    second, so DCP loading into one loads into both."""
    own = dict(model.state_dict())
    state = dict(own)
    if initialized():
        meshes: dict[Any, Any] = {}
        for shard in expert_shards(model):
            state[shard.name] = _as_global(own[shard.name], shard, meshes)
    return state, own


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """As :func:`_model_state`, for the optimizer: its state keyed by parameter name, expert
    moments sharded like the expert. ``get_optimizer_state_dict`` initialises empty state, so
    the keys exist to load into. An expert's state is sharded by expert wherever it leads
    with the rank's expert count, whatever its other dimensions (Adafactor's factored
    moments ``[L, R, 1]``, ``[L, 1, C]``), else kept as one block per EP rank
    (:func:`_leading`): kept as a replicated tensor, one rank's copy was written for all
    (loaded at the same layout, experts 0-3 took 4-7's moments). A scalar (a step count) is
    replicated."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    own = dict(get_optimizer_state_dict(model, optimizer, options=options))
    state = dict(own)
    if initialized():
        meshes: dict[Any, Any] = {}
        for shard in expert_shards(model):
            prefix = f"state.{shard.name}."
            for key, value in own.items():
                if key.startswith(prefix) and isinstance(value, Tensor) and value.dim():
                    state[key] = _as_global(value, shard, meshes, _leading(key, value, shard))
    return state, own


def _leading(key: str, value: Tensor, shard: ExpertShard) -> int | None:
    """The first dimension of the full tensor of ``value``, a non-scalar optimizer state of an
    expert shard: the expert count where it leads with the rank's experts (``None``), else
    one block per EP rank, ``value.shape[0]`` each. Such a block (Adafactor's column moments
    of a 2-D expert tensor ``[L, C]`` are ``[1, C]``, a mean over the rank's experts) is
    the rank's own at the same expert-parallel size; at another, its full tensor's shape
    differs and the load fails, naming it, since its experts cannot be told apart."""
    from torch.distributed.tensor import DTensor

    if value.shape == shard.param.shape:
        return None
    local = shard.param.shape[0]
    if isinstance(value, DTensor):
        raise ValueError(f"mc2.checkpoint: optimizer state {key} of shape {tuple(value.shape)} "
                         f"is sharded by FSDP but not shaped like its parameter "
                         f"{tuple(shard.param.shape)}: which expert each part belongs to is "
                         "unknown")
    return None if value.shape[0] == local else value.shape[0] * (shard.num_experts // local)


def save(model: nn.Module, path: str | os.PathLike, *,
         optimizer: torch.optim.Optimizer | None = None, extra: Any = None) -> None:
    """Write ``model`` (and ``optimizer``) to the folder ``path``; every rank calls it.

    Written to ``<path>.partial`` first (every rank its shard, then DCP's ``.metadata``), then
    published with a rename, replacing what ``path`` held
    (:mod:`mc2.parallel.checkpoint_publish`): a save killed while it writes leaves ``path`` as
    it was; one killed between the renames leaves the new checkpoint whole beside it, which
    the next save publishes first.

    Args:
        extra: JSON-serialisable values to keep with the checkpoint (a step count, a loss
            history, ``MC2Config.to_dict()``); :func:`load` returns them. Every rank passes the
            same. Tensors belong in the model or optimizer state.

    Raises:
        TypeError: ``extra`` is not JSON-serialisable (it is never pickled).
    """
    state: dict[str, Any] = {MODEL_PREFIX + k: v for k, v in _model_state(model)[0].items()}
    if optimizer is not None:
        state.update({OPTIMIZER_PREFIX + k: v
                      for k, v in _optimizer_state(model, optimizer)[0].items()})
    state[EXTRA_KEY] = io.BytesIO(_extra_bytes(extra))
    published(path, lambda folder: _dcp("save", state, folder))


def _extra_bytes(extra: Any) -> bytes:
    try:
        return json.dumps(extra, allow_nan=True).encode()
    except TypeError as exc:
        raise TypeError(f"mc2.checkpoint.save: extra must be JSON-serialisable (numbers, strings, "
                        f"lists, dicts; it is never pickled): {exc}") from None


def _extra_of(data: bytes, path: str | os.PathLike) -> Any:
    """``extra`` back from its bytes; a pickle is refused, never unpickled."""
    try:
        return json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        kind = "a pickle" if data[:1] == b"\x80" else "not JSON"
        raise ValueError(
            f"mc2.checkpoint.load: the extra values of {path} are {kind}; mc2 stores them as JSON "
            "and refuses to unpickle them (that would run code chosen by whoever wrote the "
            "file). Load the model state with an mc2 version that wrote it and save it again."
        ) from None


def load(model: nn.Module, path: str | os.PathLike, *,
         optimizer: torch.optim.Optimizer | None = None) -> Any:
    """Read the checkpoint at ``path`` into ``model`` (and ``optimizer``); returns ``extra``.

    The model may sit on any mesh, or be the unpatched model in one process: each rank reads
    the pieces its own layout needs.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        KeyError: the checkpoint lacks optimizer state but ``optimizer`` was passed, or holds
            model entries the model does not have (a deeper model's layers, a buffer the
            model lacks: silently left out before), or the model has entries it lacks.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    saved = saved_keys(path)
    model_state, model_own = _model_state(model)
    unexpected = _unexpected([k[len(MODEL_PREFIX):] for k in saved
                              if k.startswith(MODEL_PREFIX)], model, model_state)
    if unexpected:
        raise KeyError(f"{path} holds {len(unexpected)} model entries this model does not "
                       f"have, e.g. {unexpected[:3]} (another architecture or depth)")
    state: dict[str, Any] = {MODEL_PREFIX + k: v for k, v in model_state.items()}
    if optimizer is not None:
        if not any(k.startswith(OPTIMIZER_PREFIX) for k in saved):
            raise KeyError(f"{path} holds no optimizer state (it was saved without optimizer=)")
        optim_state, optim_own = _optimizer_state(model, optimizer)
        state.update({OPTIMIZER_PREFIX + k: v for k, v in optim_state.items()})
    state[EXTRA_KEY] = io.BytesIO()
    _dcp("load", state, path)
    model.load_state_dict(_as_loaded(model_state, model_own, state, MODEL_PREFIX))
    if optimizer is not None:
        set_optimizer_state_dict(
            model, optimizer, _as_loaded(optim_state, optim_own, state, OPTIMIZER_PREFIX),
            options=StateDictOptions(flatten_optimizer_state_dict=True))
    return _extra_of(state[EXTRA_KEY].getvalue(), path)


def _unexpected(saved: list[str], model: nn.Module, known: dict[str, Any]) -> list[str]:
    """The saved model entries ``model`` has no place for: neither its entries, nor inside
    one of them (DCP flattens a module's dict ``_extra_state`` to ``..._extra_state.n``), nor
    its non-persistent buffers (a buffer saved while it was persistent)."""
    buffers = {name for name, _ in model.named_buffers()}

    def placed(key: str) -> bool:
        return key in known or key in buffers or any(
            key[:i] in known for i, c in enumerate(key) if c == ".")

    return sorted(k for k in saved if not placed(k))


def _as_loaded(for_dcp: dict[str, Any], own: dict[str, Any], loaded: dict[str, Any],
               prefix: str) -> dict[str, Any]:
    """What to hand back to ``load_state_dict``: the expert entries were loaded in place into
    the model's own tensors (plain, or FSDP2's DTensors), which is what it takes; the rest
    (non-tensor values DCP replaces too) as DCP loaded them."""
    return {k: own[k] if for_dcp[k] is not own[k] else loaded[prefix + k] for k in for_dcp}


def saved_keys(path: str | os.PathLike) -> list[str]:
    """The keys a checkpoint folder holds (reads only its metadata)."""
    import torch.distributed.checkpoint as dcp

    if not (Path(path) / ".metadata").is_file():
        raise FileNotFoundError(f"no mc2 checkpoint at {path} (no .metadata file)")
    return list(dcp.FileSystemReader(os.fspath(path)).read_metadata().state_dict_metadata)


def _dcp(what: str, state: dict[str, Any], path: str | os.PathLike) -> None:
    import torch.distributed.checkpoint as dcp

    fn = dcp.save if what == "save" else dcp.load
    if initialized():
        fn(state, checkpoint_id=os.fspath(path))
        return
    with warnings.catch_warnings():  # one process is the point here, not a mistake
        warnings.simplefilter("ignore", UserWarning)
        fn(state, checkpoint_id=os.fspath(path), no_dist=True)
