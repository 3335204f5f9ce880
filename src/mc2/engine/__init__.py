"""The engine: one ``fused_expert`` call, in five floors that import only downwards:
``transport`` (moving rows) < ``compute`` (the experts) < ``decide`` (config, validation,
routing, planner, the plan) < ``passes`` (the schedule, one pass over named state) <
``autograd`` (the adapters and the public call). The map and the path of a call:
``docs/engine.md``.
"""
