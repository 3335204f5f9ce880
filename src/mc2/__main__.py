"""``python -m mc2 ...`` is the ``mc2`` command line (:mod:`mc2.tools.cli`)."""

import sys

from mc2.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
