"""``python -m sglang_backend``: the ``sglang-backend`` command line."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
