"""`python -m kvfork`: the `kvfork` command (see `kvfork.cli`)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
