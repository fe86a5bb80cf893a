"""Every performance figure the README and docs/ quote comes from a record
(issue 29, item 2), and every local link of those pages resolves.

The rule (docs/benchmarks/README.md says the same for writers):

1. A *figure* is a number followed by a performance unit: ``tok/s``,
   ``tokens/s`` (also ``output tokens/s``, ``decode tokens/s``, ...), ``ms``,
   ``s``, ``x`` (written ``1.49x``, no space), ``GB/s``, ``GFLOP/s``, ``%``.
   Numbers chained by ``-``, ``/``, ``and``, ``or``, ``to``, ``against`` or
   ``vs`` before one unit are a figure each (``55 / 204 tok/s``, ``0.43-0.50 s``,
   ``37.9 against 43.5 tokens/s``). In a table, a
   header cell ending in a unit in parentheses (``1 client (tok/s)``) makes
   every number in its column a figure.
2. Not figures: anything in code (fenced blocks and ``code spans``), numbers
   with other units (``MiB``, ``GiB``, ``tokens``) and units written out
   (``60 seconds``, ``1.5 times``). Settings, defaults and limits are written
   that way, so they need no record.
3. The unit of text is a table row, a list item or a paragraph. One that
   quotes a figure must link a record: a Markdown link to a ``.json`` file
   under ``docs/benchmarks/`` (``[record](benchmarks/2026-12-02-....json)``).
4. Each figure equals a number of one of its linked records at its printed
   precision (within half a unit of its last digit); a time may be recorded
   in the other of s and ms, a percentage as a fraction. Load averages
   (``loadavg``, ``load_before``, ...) are recorded beside the figures and
   are no figure's source.
5. Or, for a ratio or a percentage, it is *derived* from two figures of one
   dimension quoted in the same block (each checked by rule 4): ``a / b`` for
   ``x``; ``100 a / b`` or ``100 |a / b - 1|`` for ``%``, whatever the
   operands' rounding. "1.49x (87.2 against 58.5 tokens/s)" shows its
   operands; a ratio whose operands a page does not quote must be a number
   of the record itself.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "benchmarks"

TOKENS_PER_S = r"(?:(?:output|decode|prefill|prompt|generation|total)\s+)?(?:tokens/s|tok/s)"
UNIT = rf"(?:GFLOP/s|GB/s|{TOKENS_PER_S}|ms|s|%)"
NUMBER = r"(?<![\w.])\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\w])|(?<![\w.,])\d+(?:\.\d+)?"
SEPARATOR = r"\s*(?:-|–|/|\band\b|\bor\b|\bto\b|\bagainst\b|\bvs\b)\s*"
#: A chain of numbers and the unit after its last one.
FIGURE = re.compile(rf"((?:(?:{NUMBER}){SEPARATOR})*(?:{NUMBER}))\s?({UNIT})(?![\w/])")
#: A ratio: ``1.49x`` (no space: ``2 x layers`` is a product).
RATIO = re.compile(rf"((?:(?:{NUMBER}){SEPARATOR})*(?:{NUMBER}))x(?![\w])")
HEADER_UNIT = re.compile(r"\((GFLOP/s|GB/s|tokens/s|tok/s|ms|s|x|%)\)\s*$")
LINK = re.compile(r"\]\(([^)\s]+)\)")
#: Keys of load averages: recorded beside the figures, never a figure's source.
LOAD_AVERAGE = re.compile(r"loadavg\w*|load_average\w*|load_(?:before|after)")


@dataclass
class Block:
    """A unit of text: a table row, a list item, a paragraph or a heading."""

    line: int  # 1-based line of its first line
    text: str
    column_units: list[str | None] = field(default_factory=list)  # table rows only


@dataclass(frozen=True)
class Figure:
    """One quoted number: its text, value, decimals and unit (``x`` for ratios)."""

    text: str
    unit: str

    @property
    def value(self) -> float:
        return float(self.text.replace(",", ""))

    @property
    def half_unit(self) -> float:
        """Half a unit of the last printed digit: the rounding it allows."""
        decimals = len(self.text.split(".")[1]) if "." in self.text else 0
        return 0.5 * 10.0 ** -decimals


def blocks(text: str) -> list[Block]:
    """Split Markdown into blocks, leaving out fenced code."""
    out: list[Block] = []
    current: Block | None = None
    fenced = False
    header_units: list[str | None] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced = not fenced
            current = None
            continue
        if fenced:
            continue
        if not stripped:
            current, header_units = None, None
            continue
        if stripped.startswith("|"):
            cells = [c.strip() for c in stripped.strip("|").split("|")]
            if header_units is None:
                header_units = [m.group(1) if (m := HEADER_UNIT.search(c)) else None for c in cells]
                out.append(Block(number, stripped))  # the header row itself
            elif not set(stripped) <= set("|-: "):
                out.append(Block(number, stripped, header_units))
            current = None
            continue
        header_units = None
        starts_item = re.match(r"(?:[-*]|\d+\.)\s", stripped) is not None
        if stripped.startswith("#") or starts_item or current is None:
            current = Block(number, stripped)
            out.append(current)
            if stripped.startswith("#"):
                current = None
        else:
            current.text += " " + stripped
    return out


def _prose(text: str) -> str:
    """The text without code spans and link targets (numbers there are no figures)."""
    text = re.sub(r"`[^`]*`", " ", text)
    return LINK.sub("]()", text)


def figures(block: Block) -> list[Figure]:
    """The performance figures a block quotes (rule 1 and 2)."""
    found: list[Figure] = []
    if block.column_units:
        cells = block.text.strip("|").split("|")
        for cell, unit in zip(cells, block.column_units):
            if unit is not None:
                found += [Figure(m.group(0), unit)
                          for m in re.finditer(NUMBER, _prose(cell))]
    prose = _prose(block.text)
    for pattern, fixed_unit in ((FIGURE, None), (RATIO, "x")):
        for match in pattern.finditer(prose):
            unit = fixed_unit or match.group(2).split()[-1]
            found += [Figure(m.group(0), unit) for m in re.finditer(NUMBER, match.group(1))]
    return found


def record_links(block: Block, page: Path) -> list[Path]:
    """The records a block links (rule 3): ``.json`` links, resolved from the page."""
    text = re.sub(r"`[^`]*`", "", block.text)  # an example link in code is no citation
    return [(page.parent / target.split("#")[0]).resolve()
            for target in LINK.findall(text) if target.split("#")[0].endswith(".json")]


def record_values(path: Path) -> list[float]:
    """Every number of a record but its load averages."""
    values: list[float] = []

    def walk(node, key: str) -> None:
        if isinstance(node, dict):
            for child_key, child in node.items():
                if not LOAD_AVERAGE.fullmatch(str(child_key)):
                    walk(child, str(child_key))
        elif isinstance(node, list):
            for child in node:
                walk(child, key)
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            values.append(float(node))

    walk(json.loads(path.read_text(encoding="utf-8")), "")
    return values


def _close(a: float, b: float, tolerance: float) -> bool:
    return abs(a - b) <= tolerance + 1e-9 * max(abs(a), abs(b))


def in_record(figure: Figure, values: list[float]) -> bool:
    """Rule 4: a value of the record, at the figure's printed precision (a time
    may be recorded in the other of s and ms, a percentage as a fraction)."""
    scales = {"s": (1.0, 1e-3), "ms": (1.0, 1e3), "%": (1.0, 100.0)}.get(figure.unit, (1.0,))
    return any(_close(v * scale, figure.value, figure.half_unit)
               for v in values for scale in scales)


def _quantity(figure: Figure) -> tuple[str, float, float]:
    """A figure as (dimension, value, half unit), times in seconds."""
    if figure.unit in ("tok/s", "tokens/s"):
        return "tok/s", figure.value, figure.half_unit
    if figure.unit == "ms":
        return "s", figure.value / 1e3, figure.half_unit / 1e3
    return figure.unit, figure.value, figure.half_unit


def derived(figure: Figure, beside: list[Figure]) -> bool:
    """Rule 5: a ratio (``x``) is ``a / b``, a percentage ``100 a / b`` or
    ``100 |a / b - 1|``, for two figures ``a`` and ``b`` of one dimension
    quoted in the same block, whatever their rounding."""
    if figure.unit == "x":
        targets, tolerance = [figure.value], figure.half_unit
    elif figure.unit == "%":
        p, tolerance = figure.value / 100, figure.half_unit / 100
        targets = [p, 1 + p, 1 - p]
    else:
        return False
    operands = [_quantity(f) for f in beside if f.unit not in ("x", "%")]
    for dim_a, a, half_a in operands:
        for dim_b, b, half_b in operands:
            if dim_a != dim_b or (a, half_a) == (b, half_b) or b - half_b <= 0:
                continue
            low, high = (a - half_a) / (b + half_b), (a + half_a) / (b - half_b)
            if any(low - tolerance <= t <= high + tolerance for t in targets):
                return True
    return False


def check_page(page: Path, records: Path = RECORDS) -> list[str]:
    """Every problem of one page under the rule, as ``page:line: what``;
    ``records`` is the folder cited records must lie in."""
    problems = []
    name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
    for block in blocks(page.read_text(encoding="utf-8")):
        quoted = figures(block)
        if not quoted:
            continue
        links = record_links(block, page)
        if not links:
            problems.append(f"{name}:{block.line}: {[f.text + f.unit for f in quoted]} "
                            "cite no record (link a docs/benchmarks/*.json)")
            continue
        outside = [p for p in links if not p.is_relative_to(records.resolve())]
        if outside:
            problems.append(f"{name}:{block.line}: cites records outside {records}: {outside}")
            continue
        missing = [p for p in links if not p.is_file()]
        if missing:
            problems.append(f"{name}:{block.line}: linked records do not exist: {missing}")
            continue
        values = [v for p in links for v in record_values(p)]
        for figure in quoted:
            if not (in_record(figure, values) or derived(figure, quoted)):
                problems.append(f"{name}:{block.line}: {figure.text}{figure.unit} is in none of "
                                f"{[p.name for p in links]}")
    return problems


def pages() -> list[Path]:
    """The README and every Markdown page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_figure_cites_a_record_that_holds_it(page: Path) -> None:
    assert check_page(page) == []


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings (lower case, punctuation
    dropped, spaces to hyphens)."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def broken_links(page: Path) -> list[str]:
    """Links of a page to repository files that do not exist, or to headings
    a Markdown page does not have (URLs and links shown as code aside)."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    broken = []
    for target in LINK.findall(text):
        path, _, anchor = target.partition("#")
        if re.match(r"[a-z]+:", path):
            continue
        file = (page.parent / path) if path else page
        if not file.exists() or (anchor and file.suffix == ".md"
                                 and anchor not in anchors(file)):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_local_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


# --- the checker itself, on a page and a record of our own ---------------------------

RECORD = {"rows": [{"config": "a", "output_throughput": 43.51177, "ttft_ms": {"median": 5309.1}},
                   {"config": "b", "output_throughput": 37.85603, "ttft_ms": {"median": 8184.3}}],
          "hit_rate": 0.809, "loadavg_before": [1.8, 1.7, 1.6], "load_after": 2.5}


def _check(tmp_path: Path, text: str) -> list[str]:
    (tmp_path / "benchmarks").mkdir(exist_ok=True)
    (tmp_path / "benchmarks" / "r.json").write_text(json.dumps(RECORD))
    page = tmp_path / "page.md"
    page.write_text(text)
    return check_page(page, tmp_path / "benchmarks")


def test_the_checker_accepts_values_rounded_converted_and_derived(tmp_path: Path) -> None:
    link = "([record](benchmarks/r.json))"
    assert _check(tmp_path, f"37.9 against 43.5 tok/s, 13% less {link}.\n\n"
                            f"TTFT p50 8.2 s against 5309 ms (1.54x); 81% hit {link}.\n\n"
                            f"| run | out (tok/s) | |\n|---|---|---|\n"
                            f"| b | 37.86 | {link} |\n") == []


def test_the_checker_ignores_code_settings_and_other_units(tmp_path: Path) -> None:
    assert _check(tmp_path, "Every 50 milliseconds; `--max-step-ms 300`; 513 MiB; "
                            "2 x layers; p99; H200.\n\n```\nKV cache: 2.84x 12 ms\n```\n") == []


def test_the_checker_refuses_a_figure_without_a_record(tmp_path: Path) -> None:
    [problem] = _check(tmp_path, "Intro.\n\nITL p99 of 0.70 s (1.13 s with 256).\n")
    assert problem.endswith("['0.70s', '1.13s'] cite no record (link a docs/benchmarks/*.json)")


def test_the_checker_refuses_a_figure_its_record_does_not_hold(tmp_path: Path) -> None:
    problems = _check(tmp_path, "1.59x and 37.9 tok/s, 0.43-0.50 s ([r](benchmarks/r.json)).\n")
    assert [p.split(": ", 1)[1] for p in problems] == [
        "0.43s is in none of ['r.json']", "0.50s is in none of ['r.json']",
        "1.59x is in none of ['r.json']"]


def test_a_load_average_is_no_figures_source(tmp_path: Path) -> None:
    [problem] = _check(tmp_path, "ITL p99 1.8 s ([r](benchmarks/r.json)).\n")
    assert problem.endswith("1.8s is in none of ['r.json']")


def test_the_checker_refuses_a_link_to_a_missing_record(tmp_path: Path) -> None:
    [problem] = _check(tmp_path, "12 ms ([r](benchmarks/gone.json)).\n")
    assert "linked records do not exist" in problem


def test_the_checker_refuses_a_record_outside_the_records_folder(tmp_path: Path) -> None:
    (tmp_path / "elsewhere.json").write_text(json.dumps(RECORD))
    [problem] = _check(tmp_path, "43.5 tok/s ([r](elsewhere.json)).\n")
    assert "cites records outside" in problem


def test_the_checker_reads_a_column_unit_from_the_header(tmp_path: Path) -> None:
    text = "| run | out (tok/s) | |\n|---|---|---|\n| a | 99.0 | [r](benchmarks/r.json) |\n"
    [problem] = _check(tmp_path, text)
    assert problem.endswith("99.0tok/s is in none of ['r.json']")


def test_a_ratio_shows_its_operands_of_one_dimension(tmp_path: Path) -> None:
    """43.5 / 37.9 is 1.15, but a page quoting 1.15x alone, or beside figures of
    two dimensions, shows no quotient a reader can check."""
    link = "[r](benchmarks/r.json)"
    assert _check(tmp_path, f"43.5 against 37.9 tok/s: 1.15x ({link}).\n") == []
    alone = _check(tmp_path, f"Prefix routing was 1.15x faster ({link}).\n")
    mixed = _check(tmp_path, f"43.5 tok/s, 37.9 ms: 1.15x ({link}).\n")
    assert [p.split(": ", 1)[1] for p in alone + mixed] == [
        "1.15x is in none of ['r.json']", "1.15x is in none of ['r.json']"]


def test_a_link_to_a_missing_file_or_heading_is_broken(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## The `plan` command\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[a](other.md#the-plan-command) [b](other.md#gone) "
                    "[c](missing.md) [d](#page) [e](https://example.com) `[f](nothing.md)`\n")
    assert broken_links(page) == ["other.md#gone", "missing.md"]
