"""The engine: one ``fused_expert`` call, in four floors that import only downwards.

``transport``  moving rows: collectives, waits, backends, host reads, watchdog, deadlines,
               the 2-D exchange, wire formats, buffers. Owns no schedule.
``compute``    the expert math (SwiGLU forward and backward, grouped or looped GEMMs).
``decide``     everything settled before a row moves: config, validation and the handshake,
               routing into micro-batches, the planner and its cost model, the call's plan.
``passes``     one forward or backward pass over a plan: the pipeline orders dispatch,
               experts and combine of the micro-batches; :mod:`.passes.run` names the state
               a forward leaves for its backward.
``autograd``   thin adapters over one pass: the autograd Function (eager), the staged
               Functions (batch overlap), the custom op (compile/export), the recompute
               records (selective checkpointing), and the public call that picks among them.
"""
