"""The suite's folder-scoped resources (issue 33): a folder's engine stops
when the run's next test is outside the folder, and starts again on demand."""

from __future__ import annotations

from pathlib import Path

from folder_scope import FolderScoped


def _resource(folder: Path, events: list[str]) -> FolderScoped[str]:
    count = iter(range(100))
    resource = FolderScoped(folder, lambda: f"engine-{next(count)}",
                            lambda value: events.append(f"stop {value}"))
    return resource


def test_a_resource_stops_when_the_run_leaves_its_folder_and_restarts_on_demand(tmp_path):
    engine_dir, other_dir = tmp_path / "engine", tmp_path / "other"
    events: list[str] = []
    resource = _resource(engine_dir, events)
    try:
        assert resource.get() == "engine-0"
        assert resource.get() == "engine-0"  # one start for the folder
        # The next test is in the same folder (a sub-folder too): it stays.
        FolderScoped.leave(engine_dir / "test_a.py", engine_dir / "test_b.py")
        FolderScoped.leave(engine_dir / "test_b.py", engine_dir / "sub" / "test_c.py")
        assert events == [] and resource.running
        # The next test is elsewhere: it stops, once.
        FolderScoped.leave(engine_dir / "sub" / "test_c.py", other_dir / "test_d.py")
        assert events == ["stop engine-0"] and not resource.running
        FolderScoped.leave(other_dir / "test_d.py", None)
        assert events == ["stop engine-0"]
        # A later test of the folder (a reordered run) gets a fresh one.
        assert resource.get() == "engine-1"
        FolderScoped.leave(engine_dir / "test_a.py", None)  # the run's last test
        assert events == ["stop engine-0", "stop engine-1"]
    finally:
        resource.stop()
        FolderScoped.live.remove(resource)


def test_a_folder_whose_name_prefixes_another_is_not_its_parent(tmp_path):
    events: list[str] = []
    resource = _resource(tmp_path / "e2e", events)
    try:
        resource.get()
        FolderScoped.leave(tmp_path / "e2e" / "test_a.py", tmp_path / "e2e_more" / "test_b.py")
        assert events == ["stop engine-0"]
    finally:
        FolderScoped.live.remove(resource)
