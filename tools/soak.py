#!/usr/bin/env python3
"""Thin wrapper: the code is `kvserve.testing.soak` (see tools/README.md).

    python tools/soak.py --help
"""

import sys

from kvserve.testing.soak import main

if __name__ == "__main__":
    sys.exit(main())
