"""The CUDA backend's tests run on a GPU (CuPy + a device) or, anywhere else,
under Numba's CUDA simulator.

The simulator is chosen by ``NUMBA_ENABLE_CUDASIM=1`` in the environment
before Numba is first imported in the process: ``tests/conftest.py`` sets it
(``os.environ.setdefault``, so ``NUMBA_ENABLE_CUDASIM=0`` selects a real GPU).
Without either, every test here fails with the message below instead of
failing obscurely inside Numba.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from numba import config as numba_config
from numba import cuda

from kvserve.cuda.ops import array_module

#: GIL switch interval while these tests run under the simulator.  The
#: simulator runs each CUDA thread as a Python thread and releases a barrier
#: by polling; with Python's default 5 ms interval one ``syncthreads`` of an
#: 8-thread block costs ~11 ms, with 0.2 ms ~2 ms (the file: 43 s -> 9 s on 2 cores).
SIMULATOR_SWITCH_INTERVAL_S = 2e-4


def _backend_problem() -> str | None:
    if numba_config.ENABLE_CUDASIM:
        return None
    if cuda.is_available() and array_module() is not np:
        return None
    return ("tests/cuda need Numba's CUDA simulator or a GPU with CuPy: numba.cuda is not "
            "in simulator mode and no usable GPU was found. Set NUMBA_ENABLE_CUDASIM=1 before "
            "numba is first imported (tests/conftest.py does it; or run "
            "`NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest tests/cuda`).")


@pytest.fixture(autouse=True, scope="module")
def _cuda_backend_available():
    """Fail every CUDA test clearly when there is neither a simulator nor a GPU;
    under the simulator, shorten the GIL switch interval for the module."""
    problem = _backend_problem()
    if problem:
        pytest.fail(problem, pytrace=False)
    if not numba_config.ENABLE_CUDASIM:
        yield
        return
    previous = sys.getswitchinterval()
    sys.setswitchinterval(SIMULATOR_SWITCH_INTERVAL_S)
    yield
    sys.setswitchinterval(previous)
