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

from ..engine.comm import initialized
from .expert_shards import ExpertShard, expert_shards

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


def _as_global(tensor: Tensor, shard: ExpertShard, meshes: dict[int, Any]) -> Any:
    """``tensor`` (shaped like this rank's shard) as a DTensor of the full expert tensor."""
    from torch.distributed.tensor import DTensor

    key = id(shard.layout)
    if key not in meshes:
        meshes[key] = _device_mesh(shard)
    mesh, placements = meshes[key]
    return DTensor.from_local(tensor, mesh, placements, run_check=False)


def _to_local(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def model_state_dict(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` with every expert shard as a slice of the full tensor.

    Without ``torch.distributed`` (one process) the shards already are the full tensors.
    """
    state = dict(model.state_dict())
    if not initialized():
        return state
    meshes: dict[int, Any] = {}
    for shard in expert_shards(model):
        state[shard.name] = _as_global(state[shard.name], shard, meshes)
    return state


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, expert moments sharded like the expert.

    Initialises empty state (a step with zero learning rate), so the keys exist to load into.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    state = dict(get_optimizer_state_dict(model, optimizer, options=options))
    if not initialized():
        return state
    meshes: dict[int, Any] = {}
    for shard in expert_shards(model):
        prefix = f"state.{shard.name}."
        for key, value in state.items():
            if (key.startswith(prefix) and isinstance(value, Tensor)
                    and value.shape == shard.param.shape):
                state[key] = _as_global(value, shard, meshes)
    return state


def save(model: nn.Module, path: str | os.PathLike, *,
         optimizer: torch.optim.Optimizer | None = None, extra: Any = None) -> None:
    """Write ``model`` (and ``optimizer``) to the folder ``path``; every rank calls it.

    Args:
        extra: JSON-serialisable values to keep with the checkpoint (a step count, a loss
            history, ``MC2Config.to_dict()``); :func:`load` returns them. Every rank passes the
            same. Tensors belong in the model or optimizer state.

    Raises:
        TypeError: ``extra`` is not JSON-serialisable (it is never pickled).
    """
    state: dict[str, Any] = {MODEL_PREFIX + k: v for k, v in model_state_dict(model).items()}
    if optimizer is not None:
        state.update({OPTIMIZER_PREFIX + k: v
                      for k, v in optimizer_state_dict(model, optimizer).items()})
    state[EXTRA_KEY] = io.BytesIO(_extra_bytes(extra))
    _dcp("save", state, path)


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
        KeyError: the checkpoint lacks optimizer state but ``optimizer`` was passed.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    saved = saved_keys(path)
    model_state = model_state_dict(model)
    state: dict[str, Any] = {MODEL_PREFIX + k: v for k, v in model_state.items()}
    if optimizer is not None:
        if not any(k.startswith(OPTIMIZER_PREFIX) for k in saved):
            raise KeyError(f"{path} holds no optimizer state (it was saved without optimizer=)")
        optim_state = optimizer_state_dict(model, optimizer)
        state.update({OPTIMIZER_PREFIX + k: v for k, v in optim_state.items()})
    state[EXTRA_KEY] = io.BytesIO()
    _dcp("load", state, path)
    model.load_state_dict({k: _to_local(state[MODEL_PREFIX + k]) for k in model_state})
    if optimizer is not None:
        set_optimizer_state_dict(
            model, optimizer,
            {k: _to_local(state[OPTIMIZER_PREFIX + k]) for k in optim_state},
            options=StateDictOptions(flatten_optimizer_state_dict=True))
    return _extra_of(state[EXTRA_KEY].getvalue(), path)


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
