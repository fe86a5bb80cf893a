"""What every CPU product shares: the parallel-region lock, the rule that
sends a product to Numba's threads, and the operand check.

The CPU modules form a DAG on top of this one: ``parallel`` <- ``quant_ops``
(int8 weight-only) <- ``int8`` (W8A8) <- ``ops`` (``CpuOps``), and
``parallel`` <- ``block_ops`` (GGUF blocks) <- ``ops``.
"""

from __future__ import annotations

import threading

import numba
import numpy as np

from kvserve.cpu.kernels import CHEAP_PARALLEL_REGIONS

#: Held around every Numba parallel region of the process. The workqueue
#: threading layer aborts the process when two threads (the workers of two
#: engines) enter parallel regions at once; see ``CpuOps._attention_kernel``.
PARALLEL_REGION = threading.Lock()

#: Products of fewer multiply-adds (M * N * K) run serially. Entering a
#: Numba parallel region costs 1.3 us with the OpenMP layer, and 50-120 us
#: with workqueue (the fallback) on the 2-core machine, more when another
#: process holds a core; measured break-even with workqueue: 576 x 1536 x 32
#: (28 M) still lost 10-30% with 2 threads, the 49152 x 576 LM head at M = 1
#: (28 M, memory-bound) gained 35-40%. With OpenMP, a 576 x 576 decode
#: product (0.3 M) already gains.
PARALLEL_MIN_MACS = 1 << 16 if CHEAP_PARALLEL_REGIONS else 1 << 24


def parallel_chunks(x_shape: tuple[int, int], n: int, num_threads: int | None) -> int:
    """Channel ranges to run in parallel, 0 for a serial call: the one rule
    of every CPU product (int8, w8a8, GGUF blocks, the float32 GEMV) for
    ``x_shape`` (M, K) times N channels, by ``PARALLEL_MIN_MACS``.

    Applies ``num_threads`` to the calling thread (Numba's setting is per
    thread, as in ``CpuOps._threads``). Raises ValueError for
    ``num_threads`` outside [1, NUMBA_NUM_THREADS].
    """
    if num_threads is not None:
        limit = numba.config.NUMBA_NUM_THREADS
        if isinstance(num_threads, bool) or not isinstance(num_threads, (int, np.integer)) \
                or not 1 <= num_threads <= limit:
            raise ValueError(f"num_threads: must be an int in [1, {limit}], got {num_threads!r}")
        if numba.get_num_threads() != num_threads:
            numba.set_num_threads(int(num_threads))
    threads = numba.get_num_threads()
    m, k = x_shape
    if threads == 1 or m * n * k < PARALLEL_MIN_MACS:
        return 0
    return threads


def check_array(name: str, a: np.ndarray, dtype: type, ndim: int) -> None:
    """ValueError naming ``name`` unless ``a`` is a C-contiguous NumPy array
    of ``dtype`` with ``ndim`` dimensions (operands are checked, never
    converted, so that each kernel compiles for one type signature)."""
    if isinstance(a, np.ndarray) and a.dtype == dtype and a.ndim == ndim \
            and a.flags.c_contiguous:
        return
    if isinstance(a, np.ndarray):
        got = f"{a.dtype} {a.shape}" + ("" if a.flags.c_contiguous else ", not C-contiguous")
    else:
        got = type(a).__name__
    raise ValueError(f"{name}: expected a C-contiguous {np.dtype(dtype)} array of {ndim} "
                     f"dimensions, got {got}")
