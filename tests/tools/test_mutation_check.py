"""Every mutant of ``tools/mutation_check.py`` still applies (issue 47, item 12).

``make mutation-check`` stops at the first mutant whose target text is gone
(``_apply`` raises LookupError), so one stale mutant hides every one after
it; CI runs only a subset. Here, without running any mutant's tests: each
edit's text occurs exactly ``count`` times in its file, each edit changes
something, each named test file exists, names are unique and the CI subset
names real mutants.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tools_support import load_tool

ROOT = Path(__file__).resolve().parents[2]


MC = load_tool("mutation_check")


@pytest.mark.parametrize("mutant", MC.MUTANTS, ids=[m.name for m in MC.MUTANTS])
def test_each_mutant_applies(mutant):
    text = (ROOT / "src" / mutant.file).read_text(encoding="utf-8")
    for old, new in mutant.edits:
        assert old != new, mutant.name
        assert text.count(old) == mutant.count, (
            f"{mutant.name}: {old!r} occurs {text.count(old)} times in src/{mutant.file}, "
            f"expected {mutant.count}")
    for test in mutant.tests:
        assert (ROOT / test.split("::")[0]).exists(), f"{mutant.name}: no {test}"


def test_names_are_unique_and_the_ci_subset_is_real():
    names = [m.name for m in MC.MUTANTS]
    assert len(names) == len(set(names))
    assert set(MC.CI_MUTANTS) <= set(names)
