#!/usr/bin/env python3
"""Thin wrapper: the code is `kvserve.bench.compare` (see tools/README.md).

    python tools/compare.py --help
"""

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import sys

from kvserve.bench.compare import main

if __name__ == "__main__":
    sys.exit(main())
