"""Hardware and model presets: TOML files, validated into frozen dataclasses.

The shipped presets live in ``presets/hardware/*.toml`` and ``presets/models/*.toml`` beside this
file, each number with its source in a comment. A user's own file is loaded by path
(``--hardware my-cluster.toml``). A missing or wrong field raises ``PresetError`` naming the
file and the field.
"""

from __future__ import annotations

import tomllib
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

PRESETS = Path(__file__).parent / "presets"


class PresetError(ValueError):
    """A preset file is missing, malformed, or has a bad field."""


@dataclass(frozen=True)
class Link:
    """One link class (inside a node or between nodes), per device and direction."""

    bandwidth_gbps: float  # GB/s a device can send
    latency_us: float  # per message
    async_: bool  # asynchronous communication available (False: synchronous fallback)


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    devices_per_node: int
    peak_tflops: float
    gemm_efficiency: float
    memory_gbps: float
    intra_node: Link
    inter_node: Link
    chunk_overhead_us: float = 20.0  # per micro-batch launch/bookkeeping cost

    @property
    def flops(self) -> float:
        """Achievable FLOP/s on large GEMMs."""
        return self.peak_tflops * 1e12 * self.gemm_efficiency


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    ffn: int
    experts: int
    topk: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dense_layers: int = 0
    dense_ffn: int = 0
    shared_experts: int = 0
    shared_ffn: int = 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers


def _require(data: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in data:
        raise PresetError(f"{where}: missing field '{key}'")
    value = data[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise PresetError(f"{where}: field '{key}' must be {kind.__name__}, got {value!r}")
    if kind in (int, float) and value <= 0 and key not in ("latency_us",):
        raise PresetError(f"{where}: field '{key}' must be positive, got {value!r}")
    return value


def _read(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise PresetError(f"{path}: no such preset file") from None
    except tomllib.TOMLDecodeError as exc:
        raise PresetError(f"{path}: not valid TOML ({exc})") from None


def _resolve(name_or_path: str, kind: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        return path
    candidate = PRESETS / kind / f"{name_or_path}.toml"
    if not candidate.exists():
        raise PresetError(f"unknown {kind} preset '{name_or_path}'; shipped: "
                          f"{', '.join(available(kind))}, or pass a .toml file")
    return candidate


def available(kind: str) -> list[str]:
    """Names of the shipped presets of ``kind`` ("hardware" or "models")."""
    return sorted(p.stem for p in (PRESETS / kind).glob("*.toml"))


def _section(data: dict[str, Any], section: str, where: str) -> tuple[dict[str, Any], str]:
    """A ``[section]`` table and the name errors give it."""
    if not isinstance(data.get(section), dict):
        raise PresetError(f"{where}: missing section [{section}]")
    return data[section], f"{where} [{section}]"


def _link(data: dict[str, Any], section: str, where: str) -> Link:
    sub, w = _section(data, section, where)
    return Link(bandwidth_gbps=_require(sub, "bandwidth_gbps", float, w),
                latency_us=_require(sub, "latency_us", float, w),
                async_=_require(sub, "async", bool, w))


def hardware_from_dict(data: dict[str, Any], where: str) -> Hardware:
    comp, cw = _section(data, "compute", where)
    eff = _require(comp, "gemm_efficiency", float, cw)
    if eff > 1:
        raise PresetError(f"{cw}: field 'gemm_efficiency' must be in (0, 1], got {eff}")
    return Hardware(
        name=_require(data, "name", str, where),
        description=data.get("description", ""),
        devices_per_node=_require(data, "devices_per_node", int, where),
        peak_tflops=_require(comp, "peak_tflops", float, cw),
        gemm_efficiency=eff,
        memory_gbps=_require(comp, "memory_gbps", float, cw),
        intra_node=_link(data, "intra_node", where),
        inter_node=_link(data, "inter_node", where),
        chunk_overhead_us=float(data.get("chunk_overhead_us", 20.0)),
    )


def load_hardware(name_or_path: str) -> Hardware:
    path = _resolve(name_or_path, "hardware")
    return hardware_from_dict(_read(path), str(path))


def load_model(name_or_path: str) -> Model:
    path = _resolve(name_or_path, "models")
    data = _read(path)
    where = str(path)
    values: dict[str, Any] = {}
    for f in fields(Model):
        if f.default is MISSING:  # required
            values[f.name] = _require(data, f.name, str if f.name == "name" else int, where)
        elif f.name in data:  # optional counts (dense layers, shared experts): 0 allowed
            value = data[f.name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PresetError(f"{where}: field '{f.name}' must be a non-negative int, "
                                  f"got {value!r}")
            values[f.name] = value
    model = Model(**values)
    if model.topk > model.experts:
        raise PresetError(f"{where}: topk ({model.topk}) exceeds experts ({model.experts})")
    if model.dense_layers >= model.layers:
        raise PresetError(f"{where}: dense_layers ({model.dense_layers}) must be < layers")
    return model
