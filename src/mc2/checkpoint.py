"""``mc2.checkpoint``: sharded checkpoints that move between meshes (``save``, ``load``).

``import mc2.checkpoint`` and ``mc2.checkpoint.save(...)`` both work; the implementation is
:mod:`mc2.parallel.checkpoint` (on ``torch.distributed.checkpoint``).
"""

from .parallel.checkpoint import load, model_state_dict, optimizer_state_dict, save, saved_keys

__all__ = ["save", "load", "saved_keys", "model_state_dict", "optimizer_state_dict"]
