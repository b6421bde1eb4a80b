"""``python -m fxpipe``: the same command line as the ``fxpipe`` console script."""

from __future__ import annotations

import sys

from fxpipe.command.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
