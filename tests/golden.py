"""The shared golden reference outputs (``shared/golden/``), found once for all tests.

Looked up in ``$KVSERVE_GOLDEN``, ``<repo>/shared/golden``, then
``<repo>/../shared/golden`` (where CI lays the shared folder).

Missing golden files never pass silently. Where they are required (``CI`` is
set, as in ``.ci/run``, or ``KVSERVE_REQUIRE_GOLDEN=1``) the lookup raises,
so every golden test module fails at collection, naming the folders tried.
Elsewhere (a plain clone on a laptop) each golden test is one visible skip
whose reason names the folders, and the test session's header says so too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[1]
_GOLDEN_FILE = "smollm2_greedy.json"


def _candidates() -> list[Path]:
    env = os.environ.get("KVSERVE_GOLDEN")
    return ([Path(env)] if env else []) + [_REPO / "shared" / "golden",
                                           _REPO.parent / "shared" / "golden"]


def golden_required() -> bool:
    """True in CI (``CI`` set and not "false"/"0") or with ``KVSERVE_REQUIRE_GOLDEN=1``."""
    ci = os.environ.get("CI", "").strip().lower()
    return (ci not in ("", "0", "false", "no")
            or os.environ.get("KVSERVE_REQUIRE_GOLDEN", "") == "1")


def missing_message() -> str:
    """What to say when the golden folder is not found."""
    tried = ", ".join(str(p) for p in _candidates())
    return (f"golden reference outputs not found (looked for {_GOLDEN_FILE} in: {tried}); "
            f"put the shared folder beside the repository or set KVSERVE_GOLDEN")


def golden_cases() -> list[dict]:
    """The golden reference cases; [] when the folder is absent and not required.

    Raises:
        FileNotFoundError: absent while required (see ``golden_required``).
        ValueError: the file exists but holds no case.
    """
    for folder in _candidates():
        file = folder / _GOLDEN_FILE
        if file.is_file():
            cases = json.loads(file.read_text(encoding="utf-8"))
            if not cases:
                raise ValueError(f"{file} holds no golden case")
            return cases
    if golden_required():
        raise FileNotFoundError(missing_message())
    return []


def golden_params() -> list:
    """``pytest.param`` per golden case (id: the case name); when the folder is
    absent (and not required), one parameter that skips with the reason, so a
    golden test never collects an empty, silently passing set."""
    cases = golden_cases()
    if not cases:
        return [pytest.param(None, id="golden-missing",
                             marks=pytest.mark.skip(reason=missing_message()))]
    return [pytest.param(case, id=case["case"]["name"]) for case in cases]
