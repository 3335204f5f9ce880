import os
import sys

# spawned ranks import tests.* by module name: make the repository root importable
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Ranks fork from one server that has imported these once (mc2.tools.launch): each world then
# starts in a fraction of a second instead of importing torch (and transformers) per rank.
from mc2.tools.launch import preload  # noqa: E402

# transformers is lazy: its cost is in modeling_utils and the model modules (about 4 s a rank)
HEAVY = ["torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint",
         "transformers.modeling_utils", "transformers.distributed.expert_parallel",
         *(f"transformers.models.{m}.modeling_{m}" for m in (
             "mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss", "deepseek_v3", "olmoe", "glm4_moe",
             "granitemoe", "phimoe", "jamba"))]
# Megatron-Core and TorchTitan, as their tests' ranks import them (about 4 s a rank each;
# the CPU shims patch their modules after the fork, in each rank; the patch import is not
# preloaded: it rewrites Megatron's spec functions when imported)
FRAMEWORKS = ["megatron.core.models.gpt", "megatron.core.distributed",
              "megatron.core.pipeline_parallel.schedules", "mc2.integrations.megatron",
              "torchtitan.models.qwen3", "torchtitan.models.deepseek_v3.model",
              "torchtitan.config", "torchtitan.components.loss", "mc2.integrations.torchtitan"]
preload(*(f"tests.{path.stem}" for path in sorted(__import__("pathlib").Path(__file__).parent.glob(
    "workers*.py"))), "tests.fake_stream_backend", *HEAVY, *FRAMEWORKS)
