"""The CUDA backend: Numba CUDA kernels on CuPy buffers (``kvserve.cuda.ops``).

Importing the package first makes NumPy 2.5 acceptable to numba-cuda
(:func:`numpy_compat`), before any module here imports ``numba.cuda``.
"""

from __future__ import annotations


def numpy_compat() -> bool:
    """Give NumPy back ``np.row_stack`` where NumPy 2.5 removed it.

    numba-cuda (0.30.4, what pip resolves for ``.[cuda13]`` on Python 3.12+)
    touches ``np.row_stack`` when it compiles any kernel, so every
    ``@cuda.jit`` compile raised ``AttributeError`` beside NumPy 2.5 (the
    lent GPU image has 2.5.2). ``row_stack`` was an alias of ``vstack``
    (NumPy's 2.0 release notes deprecated it as such), so the alias is
    restored, before ``numba.cuda`` is first imported. Returns True when it
    had to be restored."""
    import numpy as np

    if hasattr(np, "row_stack"):
        return False
    np.row_stack = np.vstack
    return True


numpy_compat()
