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


def _emulated_shfl_down_sync(self, mask, value, delta):
    """``shfl.sync.down`` for the simulator's fake ``cuda`` module (it has none):
    every thread posts its value, barrier, reads lane ``laneid + delta``'s post
    (its own value past the warp or the block), barrier.  Float values only."""
    assert mask == 0xFFFFFFFF
    posts = self.shared.array(256, np.float32)
    tid = self.threadIdx.x + self.blockDim.x * self.threadIdx.y
    self.syncthreads()
    posts[tid] = value
    self.syncthreads()
    src = tid + delta
    if tid % 32 + delta >= 32 or src >= self.blockDim.x * self.blockDim.y:
        return value
    return posts[src]


@pytest.fixture(autouse=True, scope="session")
def _launch_signatures():
    """Under the simulator, note every kernel signature ``CudaOps`` launches
    (``launch_signatures``); at the end fail if one is not in the manifest
    that ``test_cuda_ptx.py`` compiles for real GPUs, or, with
    ``KVSERVE_WRITE_LAUNCH_MANIFEST=1``, add them to it."""
    import os

    from launch_signatures import MANIFEST, Recorder, read_manifest, write_manifest

    from kvserve.cuda.ops import CudaOps

    if not numba_config.ENABLE_CUDASIM:
        yield
        return
    recorder, launch = Recorder(), CudaOps._launch

    def recording_launch(self, kernel, grid, block, *args):
        if min(grid) > 0:
            recorder.record(kernel, args)
        return launch(self, kernel, grid, block, *args)

    CudaOps._launch = recording_launch
    try:
        yield
    finally:
        CudaOps._launch = launch
    known = read_manifest()
    if os.environ.get("KVSERVE_WRITE_LAUNCH_MANIFEST") == "1":
        write_manifest(known | recorder.entries)
        return
    unknown = sorted(recorder.entries - known)
    assert not unknown, (
        f"{len(unknown)} kernel signature(s) launched here are not in {MANIFEST.name}, which "
        "tests/cuda/test_cuda_ptx.py compiles for sm_80 and sm_90; add them with "
        "KVSERVE_WRITE_LAUNCH_MANIFEST=1 .venv/bin/python -m pytest tests/cuda -m 'slow or not "
        "slow':\n" + "\n".join(unknown[:10]))


@pytest.fixture(params=["shared", "shuffle"])
def warp_reduction(request, monkeypatch):
    """Both code paths of the GEMV warp reductions (``gemv_kernels._lane_sums``).

    Under the simulator: ``shared``, the simulator's own path; ``shuffle``, the
    GPU's shuffle tree (``_shuffle_sums``) on an emulated ``cuda.shfl_down_sync``.
    On a GPU the kernels are compiled with the shuffle: ``shared`` is skipped."""
    from kvserve.cuda import gemv_kernels

    if not numba_config.ENABLE_CUDASIM:
        if request.param == "shared":
            pytest.skip("a GPU compiles the shuffle path only")
        return request.param
    if request.param == "shuffle":
        from numba.cuda.simulator.kernelapi import FakeCUDAModule

        monkeypatch.setattr(FakeCUDAModule, "shfl_down_sync", _emulated_shfl_down_sync,
                            raising=False)
        monkeypatch.setattr(gemv_kernels, "_lane_sums", gemv_kernels._shuffle_sums)
    return request.param
