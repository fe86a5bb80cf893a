"""One stream for a replayed decode step (issue 46, item 2): the captured
graph replays on CuPy's current stream, the one the step's input copy and
the sampler use, never on its non-blocking capture stream, which CuPy
documents does not synchronise with the legacy stream; and capture waits
for the device first (the weights' uploads ran on the legacy stream).

No GPU here: a stand-in for the ``cupy`` module records which stream each
action ran on (what CuPy's ``get_current_stream`` would say at each).
"""

from __future__ import annotations

from contextlib import contextmanager

from kvserve.cuda import numpy_compat
from kvserve.cuda.graphs import CupyCapture


class _Stream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def __enter__(self):
        FakeCupy.current.append(self)
        return self

    def __exit__(self, *exc):
        FakeCupy.current.pop()

    def synchronize(self):
        self.log.append(("sync", self.name))

    def begin_capture(self):
        self.log.append(("begin_capture", self.name))

    def end_capture(self):
        self.log.append(("end_capture", self.name))
        return _Graph(self.log)


class _Graph:
    def __init__(self, log: list) -> None:
        self.log = log

    def launch(self, stream=None):
        self.log.append(("graph_launch", getattr(stream, "name", None)))


class FakeCupy:
    """``cupy`` as far as ``CupyCapture`` uses it."""

    current: list = []

    def __init__(self) -> None:
        self.log: list = []
        legacy = _Stream("legacy", self.log)
        FakeCupy.current[:] = [legacy]
        log = self.log

        class cuda:  # noqa: N801 - the module's name
            @staticmethod
            def Stream(non_blocking=False):  # noqa: N802
                return _Stream("capture" if non_blocking else "other", log)

            @staticmethod
            def MemoryPool():  # noqa: N802
                return type("Pool", (), {"malloc": None, "total_bytes": lambda self: 0})()

            @staticmethod
            def get_current_stream():
                return FakeCupy.current[-1]

            @staticmethod
            @contextmanager
            def using_allocator(_):
                yield

            @staticmethod
            def Device():  # noqa: N802
                return type("Device", (), {"synchronize": lambda self: log.append(
                    ("device_sync", None))})()

        self.cuda = cuda


def test_replay_runs_on_the_current_stream_not_the_capture_stream():
    cupy = FakeCupy()
    ran_on = []

    def work():
        ran_on.append(cupy.cuda.get_current_stream().name)

    replay = CupyCapture(None, cupy)(work)
    assert cupy.log[0] == ("device_sync", None)  # uploads done before capture
    assert ran_on == ["capture", "capture"]  # the eager run and the captured one
    cupy.log.clear()
    replay.launch()  # the step: copy in (current stream), replay, sampler reads
    assert cupy.log == [("graph_launch", "legacy")]
    engine_stream = _Stream("engine", cupy.log)
    with engine_stream:  # an engine that runs its steps on a stream of its own
        replay.launch()
    assert cupy.log[-1] == ("graph_launch", "engine")


def test_numpy_2_5_gets_row_stack_back(monkeypatch):
    """numba-cuda compiles through ``np.row_stack``, which NumPy 2.5 removed:
    ``import kvserve.cuda`` restores it as the ``vstack`` alias it was."""
    import numpy as np

    assert numpy_compat() is False and np.row_stack is not None  # restored, or never gone
    monkeypatch.delattr(np, "row_stack")
    assert numpy_compat() is True
    assert np.row_stack is np.vstack
