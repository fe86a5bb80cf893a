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

from gemma_fixture import gemma_model_path  # noqa: E402,F401  (a fixture)

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
