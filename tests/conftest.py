"""Shared pytest fixtures."""

from __future__ import annotations

import os

# Before numba is first imported: the CUDA backend's tests (tests/cuda, the
# "cuda-sim" backend of the model tests) run on Numba's CUDA simulator unless
# NUMBA_ENABLE_CUDASIM=0 selects a real GPU.
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import sys  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest

from folder_scope import FolderScoped  # noqa: E402
from gemma_fixture import gemma_model_path  # noqa: E402,F401  (a fixture)
from memory import (collect_garbage, grown_since_the_last_collection,  # noqa: E402
                    peak_rss_bytes, release_freed_memory_to_the_os)

from kvserve.thread_env import apply_thread_pool_env  # noqa: E402

# Before NumPy and Numba's OpenMP layer load: the thread pools' spin limits
# that the kvserve command sets (import kvserve no longer does).
apply_thread_pool_env()


def _shared_arrays_without_a_race() -> None:
    """Make Numba's CUDA simulator hand every thread of a block the same
    ``cuda.shared.array``.

    The simulator runs each CUDA thread as a Python thread and makes a
    block's shared array on the first call from a source line, by a
    check-then-set on a dict (``FakeCUDAShared.array``, numba 0.6x
    ``cuda/simulator/kernelapi.py``): two threads switched between the
    check and the set each get an array of their own, so one thread's posts
    never reach the others, and a reduction through shared memory reads
    uninitialized memory. That made the GEMV conformance cases fail about
    once a run in CI (``test_linear_gguf_blocks[cuda-float16-1-Q4_0]``,
    ``...[cuda-float32-5-w8a8]``). Here the same lookup, keyed as the
    simulator keys it (the caller's file and line), runs under a lock.
    """
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        return
    import numpy as np
    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    original = kernelapi.FakeCUDAShared.array
    lock = threading.Lock()

    def array(self, shape, dtype):
        if shape == 0:  # dynamic shared memory: one buffer, no allocation
            return original(self, shape, dtype)
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        with lock:
            res = self._allocations.get(key)
            if res is None:
                if isinstance(dtype, types.Type):
                    dtype = numpy_support.as_dtype(dtype)
                res = self._allocations[key] = np.empty(shape, dtype)
        return res

    kernelapi.FakeCUDAShared.array = array


_shared_arrays_without_a_race()


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """Folder of the default model's HF checkpoint (fetched and converted on first use).

    Honors ``$KVSERVE_CACHE``; tests using it should be marked ``@pytest.mark.model``.
    """
    from kvserve.model.default_model import ensure_default_model

    return ensure_default_model()


def pytest_report_header(config) -> str:
    """Say at the top of every run whether the golden outputs were found."""
    from golden import golden_cases, missing_message

    try:
        cases = golden_cases()
    except (FileNotFoundError, ValueError) as exc:
        return f"golden: REQUIRED AND UNUSABLE -- {exc}"
    if not cases:
        return f"golden: MISSING, the golden tests will skip -- {missing_message()}"
    return f"golden: {len(cases)} cases"


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test's own teardown: stop the engines and servers of a folder
    the run is leaving (``folder_scope``). The innermost wrapper, so that the
    output capture still holds what the stopping engines log."""
    yield
    FolderScoped.leave(item.path, nextitem.path if nextitem is not None else None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    """Before a test starts, when the last test's fixture values are
    dropped (until its teardown ends they still reference its engines):
    collect the garbage if the test is the first of its module, or if the
    process has grown by ``memory.COLLECT_AFTER_GROWTH_BYTES`` since the last
    collection."""
    if item.path != _LAST_PATH["path"] or grown_since_the_last_collection():
        collect_garbage()
    _LAST_PATH["path"] = item.path


_LAST_PATH: dict = {"path": None}

release_freed_memory_to_the_os()


@pytest.fixture(autouse=True, scope="module")
def _note_the_peak_module(request):
    """Remember the last module that raised the process's peak: the peak
    was reached in it."""
    before = peak_rss_bytes()[0]
    yield
    raised = peak_rss_bytes()[0] - before
    if raised > 0:
        _PEAK_MODULE.update(raised=raised, module=request.node.nodeid)


#: The module in which the pytest process reached its peak RSS, and by how
#: much it raised the peak before it.
_PEAK_MODULE: dict = {}


#: The suite's memory bound (issue 33): the pytest process must peak below
#: this many resident bytes. ``KVSERVE_TEST_MAX_RSS`` (bytes) overrides it.
#: The suite peaked at 14,338 MiB before the engines of a module were stopped
#: with it and the heap trimmed, at 7,267 MiB after, at 2,723 MiB in ``make
#: test`` and 4,525 MiB in ``make test-slow`` once the folders' engines
#: stopped with their folders (``folder_scope``), and at 2,732 and 3,420 MiB
#: once stopped engines were collected before the next test
#: (``pytest_runtest_setup``). The largest child's peak is reported beside
#: it, not bounded: Linux counts a forked child's pages before its ``exec``
#: (the parent's).
MAX_RSS_BYTES = int(os.environ.get("KVSERVE_TEST_MAX_RSS", 4 * 2**30))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The peak memory line of the run."""
    own, child = peak_rss_bytes()
    raised = (f"; reached in {_PEAK_MODULE['module']} (+{_PEAK_MODULE['raised'] / 2**20:,.0f}"
              " MiB over the peak before it)" if _PEAK_MODULE else "")
    terminalreporter.write_line(f"peak RSS: pytest {own / 2**20:,.0f} MiB (bound "
                                f"{MAX_RSS_BYTES / 2**20:,.0f} MiB), largest child "
                                f"{child / 2**20:,.0f} MiB{raised}")


def pytest_sessionfinish(session, exitstatus) -> None:
    """Fail the run when the pytest process peaked above ``MAX_RSS_BYTES``
    (only for a run of more than one test file: a single test may load
    what it likes)."""
    own, _ = peak_rss_bytes()
    files = {item.path for item in getattr(session, "items", ())}
    if len(files) > 1 and own > MAX_RSS_BYTES and session.exitstatus == 0:
        sys.stderr.write(f"\nthe suite's memory bound failed: pytest peaked at "
                         f"{own / 2**20:,.0f} MiB, more than {MAX_RSS_BYTES / 2**20:,.0f} MiB "
                         "(KVSERVE_TEST_MAX_RSS)\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
