"""``python -m engine``: the ``sieproxy-engine`` command."""

import sys

from engine.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
