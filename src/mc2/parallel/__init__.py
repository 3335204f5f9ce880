"""Expert parallelism in a whole model: meshes, gradient sync and checkpoints.

``mesh`` lays ranks out as data-parallel replicas of expert-parallel groups; ``grad_sync`` and
``gradient_buckets`` average gradients (after, or overlapped with, the backward);
``expert_shards`` says which experts a rank holds; ``checkpoint`` saves and loads them with
torch.distributed.checkpoint, on any EP size.
"""
