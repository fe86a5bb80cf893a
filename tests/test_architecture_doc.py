"""docs/architecture.md names every package of kvserve and every actor."""

from pathlib import Path

import kvserve
from kvserve.engine import ACTORS

ROOT = Path(__file__).resolve().parents[1]


def test_the_architecture_page_names_every_package_and_actor():
    text = (ROOT / "docs" / "architecture.md").read_text()
    src = Path(kvserve.__file__).parent
    packages = sorted(p.name for p in src.iterdir() if (p / "__init__.py").exists())
    assert len(packages) >= 10
    missing = [p for p in packages if f"  {p}/" not in text]
    assert missing == [], f"docs/architecture.md does not list {missing}"
    for actor in ACTORS:
        assert f"**{actor.name.capitalize()}**" in text, actor.name


def test_the_inbox_table_is_each_actors_accepts():
    rows = {line.split("|")[1].strip(): line.split("|")[2]
            for line in (ROOT / "docs" / "architecture.md").read_text().splitlines()
            if line.startswith("| ") and line.count("|") == 5}
    for actor in ACTORS:
        listed = {name.strip() for name in rows[actor.name.capitalize()].strip(" `").split(",")}
        assert listed == {t.__name__ for t in actor.accepts}, actor.name
