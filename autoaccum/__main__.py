"""``python -m autoaccum``."""

import sys

from .cli._main import main

if __name__ == "__main__":
    sys.exit(main())
