"""Every ``kvserve serve`` flag has a row in docs/serving.md (issue 15, item 3;
the table moved there from the README in issue 29), checked against the
argparse definition so that a new flag without a row fails here; and the
README's short table of first flags names only real ones."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from kvserve.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
SERVING = ROOT / "docs" / "serving.md"
README = ROOT / "README.md"


def serve_actions() -> list[argparse.Action]:
    """The options of ``kvserve serve`` (``--help`` aside)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [action for action in sub.choices["serve"]._actions
            if action.option_strings and action.dest != "help"]


def serve_flags() -> list[str]:
    """Each option's longest spelling (``--quantization``, not ``-q``)."""
    return [max(action.option_strings, key=len) for action in serve_actions()]


def flag_rows(path: Path) -> list[str]:
    """The first cells of a page's table rows that start with a flag."""
    return [line.split("|")[1] for line in path.read_text(encoding="utf-8").splitlines()
            if line.startswith("| `-")]


def test_every_serve_flag_has_a_row() -> None:
    cells = flag_rows(SERVING)
    missing = [flag for flag in serve_flags() if not any(f"`{flag}" in cell for cell in cells)]
    assert not missing, f"serve flags without a row in docs/serving.md: {missing}"


def test_every_row_names_a_real_flag() -> None:
    known = {spelling for action in serve_actions() for spelling in action.option_strings}
    for path in (SERVING, README):
        named = {flag for cell in flag_rows(path) for flag in re.findall(r"`(-[-\w]+)", cell)}
        assert named, path
        assert named <= known, f"{path.name} names flags kvserve serve lacks: {named - known}"
