"""The limits every CUDA kernel module shares, and the scalar device helpers
that read no thread state (:func:`_max`, :func:`_min`, :func:`_window_start`).

Only those: under Numba's CUDA simulator a device function swaps its own
module's ``cuda`` global for the launch's fake module while it runs and puts
the real one back when it returns. A kernel's module is swapped for its whole
launch, so the device functions beside it are safe; a helper of another
module that reads ``cuda`` (``threadIdx``, ``syncthreads``) races when the
threads of a block call it, one thread putting the real module back while
another is still inside. So the block reductions (``_block_sum``,
``_block_max``) and the helpers that call them live in the module of the
kernels that use them (:mod:`kvserve.cuda.row_kernels` and
:mod:`kvserve.cuda.decode_kernels` each keep a copy), and this module holds
only helpers whose bodies never read ``cuda``.
"""

from __future__ import annotations

import math

from numba import cuda, float32

#: Largest 1-D block a launch may use: sizes the shared reduction buffers.
MAX_BLOCK_THREADS = 256
#: Largest head_dim of the attention kernels (per-thread q/acc rows, shared K/V tiles).
MAX_HEAD_DIM = 256
#: Largest split-K partition (keys) of decode attention: the shared logits buffer.
MAX_PARTITION_SIZE = 512
#: Keys per shared-memory K/V tile of prefill attention
#: (K + V tiles: 2 * 16 * 256 * 4 B = 32 KiB of static shared memory).
PREFILL_KV_TILE = 16
#: Most activation rows of the GEMV kernels (``kvserve.cuda.gemv_kernels``:
#: int8, W8A8, ggml blocks; their per-lane accumulators).
GEMV_MAX_ROWS = 8
#: Largest tile edge of the tiled int8 matmuls: (16, 16) threads, 16x16 outputs.
MATMUL_TILE = 16
#: Input channels per activation scale of the W8A8 matmul (a K that it does
#: not divide gets one group per row); equal to ``kvserve.cpu.int8.GROUP``,
#: a multiple of every tile edge up to MATMUL_TILE.
W8A8_GROUP = 64
#: Largest magnitude of a symmetric int8 code.
INT8_MAX = 127

_NEG_INF = float32(-math.inf)
_ZERO = float32(0.0)
_ONE = float32(1.0)
_HALF = float32(0.5)


# --------------------------------------------------------------------------- #
# Scalar helpers
# --------------------------------------------------------------------------- #


# Plain comparisons instead of the builtins min / max: Numba types those
# through generic overloads that its built-in CUDA target fails to compile
# (seen with ``cuda.compile_ptx``, numba 0.68).
@cuda.jit(device=True)
def _max(a, b):
    return a if a > b else b  # noqa: FURB136 (see above)


@cuda.jit(device=True)
def _min(a, b):
    return a if a < b else b  # noqa: FURB136 (see above)


@cuda.jit(device=True)
def _window_start(ctx, window):
    """First key position a query with ``ctx`` keys of context (its own
    position + 1) may see: ``ctx - window`` with a window (``window`` > 0),
    clamped at 0; 0 without (full causal attention)."""
    if window > 0 and ctx > window:
        return ctx - window
    return 0
