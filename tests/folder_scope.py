"""Resources that live while the run is inside one test folder (issue 33).

pytest's scopes are the test, the class, the module, the package and the
session, and a folder without ``__init__.py`` is no package: its "package"
fixtures live for the whole session. The engines and servers a folder
shares (``tests/e2e``, ``tests/engine``, ``tests/scheduling``,
``tests/openai``) were session fixtures, so by the time the run reached
``tests/scheduling`` the engines of three folders were alive in one process
(7.3 GiB at peak). A ``FolderScoped`` resource starts on first use and stops
as soon as the next test to run is outside its folder (the root conftest's
``pytest_runtest_teardown``); a test that asks for it again later (a rerun, a
reordered run) starts it anew.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar, Generic, TypeVar

T = TypeVar("T")


class FolderScoped(Generic[T]):
    """One resource of ``folder``: ``start()`` on the first ``get``, ``stop(it)``
    when the run leaves the folder (or the session ends).

    Args:
        folder: the test folder whose tests share it.
        start: makes the resource (an engine, a live server).
        stop: ends it; called at most once per ``start``.
    """

    live: ClassVar[list[FolderScoped]] = []

    def __init__(self, folder: Path, start: Callable[[], T], stop: Callable[[T], None]) -> None:
        self.folder = folder.resolve()
        self._start, self._stop = start, stop
        self._value: T | None = None
        FolderScoped.live.append(self)

    def get(self) -> T:
        """The resource, started now if it is not running."""
        if self._value is None:
            self._value = self._start()
        return self._value

    @property
    def running(self) -> bool:
        return self._value is not None

    def stop(self) -> None:
        """End the resource if it runs (idempotent)."""
        value, self._value = self._value, None
        if value is not None:
            self._stop(value)

    def holds(self, path: Path | None) -> bool:
        """Whether the test file ``path`` is inside this folder."""
        return path is not None and self.folder in Path(path).resolve().parents

    @classmethod
    def leave(cls, path: Path, next_path: Path | None) -> None:
        """Stop every running resource of a folder that holds ``path`` (the test
        that just ended) and not ``next_path`` (the next test; None at the end)."""
        for resource in list(cls.live):
            if resource.running and resource.holds(path) and not resource.holds(next_path):
                resource.stop()


def folder_resource(folder: Path, start: Callable[[], T],
                    stop: Callable[[T], None]) -> Iterator[FolderScoped[T]]:
    """The body of a session fixture holding one ``FolderScoped`` resource
    (``yield from folder_resource(...)``): stopped at the session's end too."""
    resource = FolderScoped(folder, start, stop)
    try:
        yield resource
    finally:
        resource.stop()
        FolderScoped.live.remove(resource)
