#!/usr/bin/env python3
"""Thin wrapper: the code is `kvserve.bench.soak` (see tools/README.md).

    python tools/soak.py --help
"""

import sys

from kvserve.bench.soak import main

if __name__ == "__main__":
    sys.exit(main())
