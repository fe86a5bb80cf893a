"""Every ``kvserve serve`` flag is in the README's "Serving options" table
(issue 15, item 3): the table is checked against the argparse definition,
so a new flag without a row fails here."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvserve.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def serve_flags() -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    return [max(action.option_strings, key=len) for action in serve._actions
            if action.option_strings and action.dest != "help"]


def serving_section() -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index("## Serving options")
    return text[start:text.index("\n## ", start + 1)]


def test_every_serve_flag_has_a_row() -> None:
    section = serving_section()
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    missing = [flag for flag in serve_flags()
               if not any(f"`{flag}" in row.split("|")[1] for row in rows)]
    assert not missing, f"serve flags without a README row: {missing}"
