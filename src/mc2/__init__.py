"""mc2: hide the All-to-All of Mixture-of-Experts behind expert computation.

``mc2.fused_expert`` runs dispatch All-to-All -> SwiGLU experts -> combine All-to-All as a
micro-batch pipeline on any ``torch.distributed`` backend, forward and backward;
``mc2.MC2Config`` says how a call runs.

The package has four parts: ``mc2.engine`` (the call), ``mc2.observation`` (timelines, traces,
metrics), ``mc2.parallel`` (meshes, gradient sync, FSDP2, checkpoints) and ``mc2.tools`` (the command
line). What a user calls is exported here; ``mc2.checkpoint`` (save and load) is imported on
first use (it pulls in torch.distributed.checkpoint), or with ``import mc2.checkpoint``.
"""

from typing import Any

from mc2.engine.decide.config import MC2Config
from mc2.engine.decide.overflow import CapacityOverflow, check_overflow
from mc2.engine.transport.deadline import CommTimeout
from mc2.engine.transport.env import SyncFallbackWarning
from mc2.engine.autograd.ops import fused_expert, fused_expert_module, fused_expert_packed
from mc2.engine.autograd.recompute import checkpoint_policy
from mc2.engine.decide.planner import Planner, WireFormatWarning
from mc2.engine.transport.workspace import Workspace
from mc2.forward_backward import forward_backward
from mc2.layer import MoELayer, MoEOutput, RouterLosses, load_full_state_dict
from mc2.observation.profiler import Profiler, profile
from mc2.observation.timeline import Span, Timeline
from mc2.observation.traffic import Traffic, count_traffic
from mc2.parallel.fsdp import clip_grad_norm_, fully_shard
from mc2.parallel.grad_sync import average_gradients
from mc2.parallel.gradient_buckets import GradientSync
from mc2.parallel.mesh import ParallelLayout, expert_parallel_mesh
from mc2.tools.launch import run_local

__all__ = ["fused_expert", "fused_expert_packed", "fused_expert_module", "MC2Config", "MoELayer",
           "MoEOutput", "RouterLosses", "Workspace", "Planner", "CommTimeout", "SyncFallbackWarning",
           "WireFormatWarning", "expert_parallel_mesh", "ParallelLayout", "average_gradients",
           "GradientSync", "fully_shard", "clip_grad_norm_", "checkpoint_policy",
           "load_full_state_dict", "profile", "Profiler", "Timeline", "Span", "run_local",
           "count_traffic", "Traffic", "checkpoint", "check_overflow", "CapacityOverflow",
           "forward_backward"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "checkpoint":
        import importlib

        return importlib.import_module(".checkpoint", __name__)
    raise AttributeError(f"module 'mc2' has no attribute {name!r}")
