"""``mc2.checkpoint``: sharded checkpoints that move between meshes (``save``, ``load``).

``import mc2.checkpoint``, ``from mc2 import checkpoint`` and ``mc2.checkpoint.save(...)`` all
give :mod:`mc2.parallel.checkpoint` itself: this module puts that one in its place on import,
so there is one module object, one set of functions, whichever path a user writes.
"""

import sys

from mc2.parallel import checkpoint as _implementation

sys.modules[__name__] = _implementation
