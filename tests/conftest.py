import os
import sys

# spawned ranks import tests.* by module name: make the repository root importable
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Ranks fork from one server that has imported these once (mc2.tools.launch): each world then
# starts in a fraction of a second instead of importing torch (and transformers) per rank.
from mc2.tools.launch import preload  # noqa: E402

preload(*(f"tests.{path.stem}" for path in sorted(__import__("pathlib").Path(__file__).parent.glob(
    "workers*.py"))), "tests.fake_stream_backend", "transformers")
