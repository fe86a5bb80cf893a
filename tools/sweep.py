#!/usr/bin/env python3
"""Thin wrapper: the code is `kvserve.bench.sweep` (see tools/README.md).

    python tools/sweep.py --help
"""

import sys

from kvserve.bench.sweep import main

if __name__ == "__main__":
    sys.exit(main())
