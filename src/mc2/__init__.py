"""mc2: hide the All-to-All of Mixture-of-Experts behind expert computation.

``mc2.fused_expert`` runs dispatch All-to-All -> SwiGLU experts -> combine All-to-All as a
micro-batch pipeline on any ``torch.distributed`` backend, forward and backward.
"""

from . import env, planner, profiler, topology
from .deadline import CommTimeout
from .grad_sync import average_gradients
from .gradient_buckets import GradientSync
from .launch import run_local
from .layer import MoELayer, RouterLosses, load_full_state_dict
from .mesh import ParallelLayout, expert_parallel_mesh
from .ops import fused_expert, fused_expert_packed
from .planner import Planner
from .profiler import Profiler, profile
from .routing import DispatchHandle, MicroBatchRoute
from .timeline import Span, Timeline
from .workspace import Workspace

__all__ = ["fused_expert", "fused_expert_packed", "Workspace", "MoELayer", "RouterLosses",
           "CommTimeout", "expert_parallel_mesh", "ParallelLayout", "average_gradients",
           "GradientSync",
           "load_full_state_dict", "profile", "Profiler", "Planner",
           "run_local", "Timeline", "Span",
           "DispatchHandle", "MicroBatchRoute", "env", "planner", "profiler", "topology"]
__version__ = "0.1.0"
