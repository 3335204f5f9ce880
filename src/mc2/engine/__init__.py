"""The engine: one ``fused_expert`` call, from checking its input to the pipelined exchanges.

``ops`` is the public call; ``call_plan`` validates it, agrees with the other ranks and chooses
K, the routes and the hierarchy; ``function`` is the autograd function that runs the plan;
``pipeline`` orders dispatch, compute and combine of the micro-batches and owns no math;
``routing`` splits tokens into micro-batches and routes; ``experts`` is the SwiGLU math;
``comm``, ``hierarchy`` and ``topology`` move bytes (flat or two-stage) and own no schedule;
``wire`` is the format rows travel in; ``planner`` and ``pipeline_cost`` price a split;
``workspace``, ``validation``, ``deadline`` and ``env`` are the call's buffers, checks,
timeouts and environment switches.
"""
