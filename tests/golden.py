"""The shared golden reference outputs (``shared/golden/``), found once for all tests.

Looked up in ``$KVSERVE_GOLDEN``, ``<repo>/shared/golden``, then
``<repo>/../shared/golden`` (where CI lays the shared folder).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
_GOLDEN_CANDIDATES = [
    Path(os.environ.get("KVSERVE_GOLDEN", "/nonexistent")),
    _REPO / "shared" / "golden",
    _REPO.parent / "shared" / "golden",
]


def golden_cases() -> list[dict]:
    """The golden reference cases, or [] when the golden folder is not available."""
    for folder in _GOLDEN_CANDIDATES:
        file = folder / "smollm2_greedy.json"
        if file.is_file():
            return json.loads(file.read_text(encoding="utf-8"))
    return []
