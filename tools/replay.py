#!/usr/bin/env python3
"""Thin wrapper: the code is `kvserve.bench.replay` (see tools/README.md).

    python tools/replay.py --help
"""

import sys

from kvserve.bench.replay import main

if __name__ == "__main__":
    sys.exit(main())
