"""``python -m autoaccum_demo``: the demo's own entry point (see :mod:`autoaccum_demo._cli`)."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
