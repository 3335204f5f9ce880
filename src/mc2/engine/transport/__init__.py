"""Moving rows: exchanges, waits, backends, host reads, watchdog, wire formats and buffers.

The transport moves bytes and owns no schedule; it imports nothing above ``mc2.device``.
"""
