"""Where the CUDA backend's arrays live, and how one is named in an error:
CuPy on a GPU, NumPy under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
from numba import config as numba_config


def simulator_enabled() -> bool:
    """True when ``numba.cuda`` is Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``)."""
    return bool(numba_config.ENABLE_CUDASIM)


def array_module() -> ModuleType:
    """``cupy`` when it is importable, a CUDA device is present and Numba is not
    simulating; ``numpy`` otherwise (the simulator's kernels take NumPy arrays)."""
    if simulator_enabled():
        return np
    try:
        import cupy
    except ImportError:
        return np
    try:
        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else np
    except cupy.cuda.runtime.CUDARuntimeError:
        return np


def describe(a: Any) -> str:
    """``numpy.ndarray (3, 4) float64 non-contiguous`` (for error messages)."""
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        return type(a).__name__
    layout = "C-contiguous" if a.flags.c_contiguous else "non-contiguous"
    kind = f"{type(a).__module__.split('.')[0]}.{type(a).__name__}"
    return f"{kind} {tuple(a.shape)} {a.dtype} {layout}"
