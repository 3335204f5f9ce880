"""Below everything: device clocks and streams.

Both the engine (which times its passes and orders its transfers on streams) and
``mc2.observation`` (which files spans on those clocks) stand on this floor, so observation
records without reaching into the engine.
"""
