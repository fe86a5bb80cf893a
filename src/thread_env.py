"""The environment that makes the CPU backend's two thread pools sleep soon
after their work, and the function that sets it (``import kvserve`` does not).

kvserve alternates short BLAS calls (NumPy's OpenBLAS) and short Numba
parallel regions (its OpenMP layer, libgomp) on the same cores; a pool still
spinning after its call steals the core the other one needs (measured on 2
cores with ``tools/bench_quant_serving.py``: int8 at 32 clients 195 -> 316
output tokens/s with both variables set and Numba's OpenMP layer; see
``kvserve.cpu.kernels``).

Each library reads its variable once, when it loads, and never again
(measured on the 2-core machine, the CPU a process burnt while its main
thread slept 20 ms after each call, 40 times):

- OpenBLAS reads ``OPENBLAS_THREAD_TIMEOUT`` in its library constructor,
  which runs when NumPy is imported and starts the pool's threads
  (``blas_thread_init`` in its ``driver/others/blas_server.c`` turns it
  into the spin length once, clamped to 4..30, as ``1 << value`` cycles): after a
  256x256 matmul, 0.77 s of CPU in 0.8 s of sleep with the variable unset,
  0.001 s with it set before ``import numpy``, 0.79 s with it set after.
- libgomp reads ``GOMP_SPINCOUNT`` in its constructor, which runs when
  Numba's OpenMP layer is first imported (``numba.np.ufunc.omppool``, which
  ``kvserve.cpu.kernels`` imports to pick the layer): after a parallel
  region, 0.47 s unset, 0.04 s set before that import (after ``import
  numba`` is early enough), 0.37 s set after it.

So the variables must be in the environment before NumPy loads, which
``import kvserve.engine`` does. The ``kvserve`` command sets them first
thing (``kvserve.cli.main``), each Ray replica when it is built (its worker
process has not loaded NumPy yet), and the test suite in its conftest. A
program that runs an engine in-process calls ``apply_thread_pool_env()``
before it imports NumPy (or sets them itself); importing this module
imports nothing else of kvserve's.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

#: Variable -> value (a value already in the environment wins):
#: OpenBLAS's threads spin 2**4 cycles before they sleep (its minimum; the
#: default is 2**28, about 0.1 s); libgomp's threads spin 20,000 rounds.
THREAD_POOL_ENV = {"OPENBLAS_THREAD_TIMEOUT": "4", "GOMP_SPINCOUNT": "20000"}


def apply_thread_pool_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each of ``THREAD_POOL_ENV``'s variables that ``environ`` (default
    ``os.environ``) lacks; returns the values now in it. Effective only
    before NumPy and Numba's OpenMP layer load (see the module docstring)."""
    environ = os.environ if environ is None else environ
    return {name: environ.setdefault(name, value) for name, value in THREAD_POOL_ENV.items()}
