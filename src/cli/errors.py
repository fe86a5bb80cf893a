"""How the ``kvserve`` command fails on a user's mistake: one line on
standard error and exit status 2, never a traceback."""

from __future__ import annotations

import sys
from typing import NoReturn


class StartupError(Exception):
    """A setting, file or environment that the start cannot serve, found
    before or while loading: one line on stderr and exit status 2."""


def die(message: str) -> NoReturn:
    """Print ``kvserve: error: message`` on stderr and exit with status 2."""
    print(f"kvserve: error: {message}", file=sys.stderr)
    raise SystemExit(2)
