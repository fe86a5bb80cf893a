"""kvserve: a diagnosable LLM inference serving engine.

See DESIGN.md (shared) for the map: actors pass typed messages over asyncio
queues; the pure scheduling and KV-cache logic lives in ``kvserve.core``.
"""

import os as _os

# Thread pools that sleep soon after their work (read by OpenBLAS when NumPy
# loads it, and by libgomp when Numba's OpenMP layer starts, so they are set
# here, before either). kvserve alternates short BLAS calls and short Numba
# parallel regions on the same cores; a pool still spinning after its call
# steals the core the other one needs (measured on 2 cores with
# tools/bench_quant_serving.py: int8 at 32 clients 195 -> 316 output tokens/s
# with both set and Numba's OpenMP layer; see kvserve.cpu.kernels).
# A value already in the environment wins.
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # 2**4 cycles of spinning
_os.environ.setdefault("GOMP_SPINCOUNT", "20000")

__version__ = "0.1.0"
