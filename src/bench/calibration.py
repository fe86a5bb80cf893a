"""Machine calibration: what this machine does per second, recorded with a benchmark.

Figures from different machines (or the same machine on a busy hour) can
only be read side by side with the machine's own limits next to them. Three
fixed measurements, best of ``repeats``, each a few hundred milliseconds:

- ``gemm_gflops``: NumPy float32 ``x @ w.T`` at ``x [32, 576]``,
  ``w [3072, 576]`` (the default model's MLP at 32 decode rows), with the BLAS
  pool as the process has it; 2 * M * N * K / seconds.
- ``read_gbs``: one thread summing ``READ_BYTES`` of int64 (NumPy's
  ``sum``), bytes / seconds: the rate at which one core streams memory,
  which bounds a decode step that reads every weight once.
- ``copy_gbs``: ``np.copyto`` of the same array, bytes read + written /
  seconds.
- ``read2_gbs``: two threads each summing half of that array at once (NumPy
  releases the GIL in ``sum``): the rate two cores stream memory, the floor
  of a decode step on two threads (the bytes of the weights over it).

Plus the load average before and after, so a noisy run shows.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import numpy as np

#: Bytes streamed by the read and copy measurements (beyond any cache: one
#: machine here reported a 480 MiB L3).
READ_BYTES = 1024 * 2**20
GEMM_SHAPE = (32, 3072, 576)  # M, N, K


def _best(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn``, in seconds (after one warm-up)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _two_threads(fn: Callable[[int], object]) -> None:
    """``fn(0)`` and ``fn(1)`` on two threads at once."""
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def calibrate(repeats: int = 5) -> dict:
    """The machine's GEMM rate and memory read and copy rates (see the module
    docstring), with the load averages around the measurement:
    ``{"gemm_gflops", "read_gbs", "read2_gbs", "copy_gbs", "repeats", "loadavg":
    [before, after]}``."""
    before = [round(x, 2) for x in os.getloadavg()]
    rng = np.random.default_rng(0)
    m, n, k = GEMM_SHAPE
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    gemm = _best(lambda: x @ w.T, repeats * 20)
    data = np.ones(READ_BYTES // 8, dtype=np.int64)
    read = _best(data.sum, repeats)
    halves = (data[:data.size // 2], data[data.size // 2:])
    read2 = _best(lambda: _two_threads(lambda i: halves[i].sum()), repeats)
    out = np.empty_like(data)
    copy = _best(lambda: np.copyto(out, data), repeats)
    return {"gemm_gflops": round(2 * m * n * k / gemm / 1e9, 1),
            "read_gbs": round(READ_BYTES / read / 1e9, 2),
            "read2_gbs": round(READ_BYTES / read2 / 1e9, 2),
            "copy_gbs": round(2 * READ_BYTES / copy / 1e9, 2),
            "repeats": repeats,
            "loadavg": [before, [round(x, 2) for x in os.getloadavg()]]}
