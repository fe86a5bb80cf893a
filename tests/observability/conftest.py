"""Fixtures of the observability tests (issue 6).

``tests/e2e`` goes on ``sys.path`` so these tests reuse its ``LiveServer``.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
_E2E = str(HERE.parent / "e2e")
if _E2E not in sys.path:
    sys.path.insert(0, _E2E)
