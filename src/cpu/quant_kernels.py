"""Numba kernels of the CPU backend's int8 matrix products, ``y = x @ W.T``.

PyTorch ``nn.Linear`` convention: ``W`` is ``[N out, K in]`` and is given as
``wq int8[N, K]`` with per-output-channel ``scales float32[N]``
(``W ~ wq * scales[:, None]``, symmetric). Two schemes:

* **int8 weight-only** (LLM.int8's per-channel absmax weights, without its
  outlier path): ``y = (x @ wq.T) * scales`` with float32 activations and
  float32 accumulation; each weight is widened int8 -> int32 -> float32 in
  registers and never stored as float.
* **w8a8** (SmoothQuant's per-token / per-channel symmetric scheme, as in
  vLLM's int8 ``scaled_mm``): activations quantized per row,
  ``xq = rint(x / xs)``, ``xs[m] = max|x[m]| / 127``; then the exact int32
  accumulator ``acc[m, n] = sum_k xq[m, k] * wq[n, k]`` and the epilogue
  ``y = acc * xs[m] * scales[n]``. The int32 sum is exact for
  ``K <= W8A8_MAX_K``.

Tiling.  Every product is built from register tiles of ``MR`` rows times
``NR`` output channels (4 x 4: 16 accumulators, one widened weight vector per
channel and one activation vector per row in flight, 24 of the 32 zmm
registers), each a reduction over all of K that LLVM vectorizes; a 1 x NR
tile serves a lone row.  Tiles at the bottom or right edge clamp their row
and channel indices to the last one, so they recompute a duplicate and store
it again: one code path for any M and N.  Two loop orders use the tiles:

* ``*_gemv_range`` (decode, M <= ``quant_ops.GEMV_MAX_ROWS``): for each
  group of NR channels, all rows; the weights stream from memory once, the
  few activation rows stay in L1.
* ``*_tiled_range`` (prefill): weights in cache tiles of ``CACHE_TILE_N``
  channels (64 x K int8 = 36 KiB at K = 576, within L2 at K = 1536); for
  each tile, all row tiles, so each weight tile is read from memory once and
  reused from cache by every row tile. With a single row tile (M <= MR)
  the two orders run the same tiles in the same sequence.

Parallelism: ``*_parallel`` splits the output channels into ``n_chunks``
contiguous ranges of whole NR-channel groups, one per ``prange`` iteration.
A Numba parallel region costs 50-120 us to enter (measured on the 2-core
machine, even with one thread), more than a whole 576 x 576 x 8 product, so
``kvserve.cpu.quant_ops`` calls the ``*_range`` functions serially for small
products and holds ``kvserve.cpu.parallel.PARALLEL_REGION`` around the parallel
ones.

What the assembly shows (``kernel.inspect_asm(kernel.signatures[0])`` of the
``*_range`` functions, with the tiles inlined; AMD EPYC, "znver5" to LLVM 22
via llvmlite 0.50 / Numba 0.68; ``/proc/cpuinfo`` lists avx512f/bw/vl,
avx512_vnni, avx_vnni and avx512_bf16). Rates are one core, 2 * M * N * K
operations per second:

* int8, 4 x 4 tile, per 16 k: 4 ``vpmovsxbd`` (16 weights loaded and
  sign-extended to int32 in one instruction), 4 ``vcvtdq2ps``, 4 ``vmovups``
  (activations), 16 ``vfmadd231ps`` on zmm: 195-225 GFLOP/s, against 125
  for OpenBLAS sgemm (its DYNAMIC_ARCH build runs a 256-bit Haswell kernel
  here). The 1 x 4 tile (M = 1) converts each weight for one row only: per
  64 k, 16 ``vpmovsxbd``, 16 ``vcvtdq2ps``, 4 ``vmovups``, 16 FMAs.
* w8a8: written ``acc = int32(acc + int32(a) * int32(b))``. Numba types
  ``int32 * int32`` as int64, and without the outer ``int32`` the loop
  vectorizes on 64-bit lanes (``vpmovsxbq`` / ``vpmuldq`` / ``vpaddq``, 4x
  slower). With it, the 4 x 4 tile is, per 16 k, 8 ``vpmovsxbd`` (weights
  and activations), 16 ``vpmulld``, 16 ``vpaddd``: 160-180 GOP/s. A
  one-channel dot product of the same form does get ``vpmovsxbw`` +
  ``vpmaddwd`` + ``vpaddd``, but only on ymm halves (105 GOP/s); no tile
  form makes LLVM emit ``vpdpbusd``, which its loop vectorizer does not form
  from s8 x s8 sums. With unsigned activations (``xq + 128``, corrected by
  ``128 * sum_k wq[n, k]``) it emits the VNNI word form ``vpdpwssd`` on
  zero-extended operands, 10-13% faster; not used, as it wants the weight
  row sums computed once at load time.

Arrays must be C-contiguous with exactly the dtypes documented on each
function (``quant_ops`` checks them), so each kernel compiles once.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

# Imported for its side effect: it selects Numba's threading
# layer, which the parallel kernels below rely on (see its comment).
from kvserve.cpu import kernels as _kernels  # noqa: F401

#: Largest magnitude of a symmetric int8 code (-128 is never produced).
INT8_MAX = 127
#: Rows per register tile (the tiles below are written out for 4 x 4).
MR = 4
#: Output channels per register tile.
NR = 4
#: Output channels per cache tile of the tiled path (a multiple of NR).
CACHE_TILE_N = 64
#: Largest K whose w8a8 int32 accumulator cannot overflow for any int8
#: weights: |xq| <= 127, |wq| <= 128.
W8A8_MAX_K = (2**31 - 1) // (INT8_MAX * 128)
#: Scale of an all-zero activation row (its codes are all 0 whatever it is).
ZERO_ROW_SCALE = 1.0

# Float reductions may be reassociated so that LLVM vectorizes them; the
# error stays within the float32 summation bound (tests/cpu/test_quant_kernels.py).
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
_F0 = np.float32(0.0)
_CODE_MAX = np.float32(INT8_MAX)
_MAGNITUDE_MASK = np.int32(0x7FFFFFFF)  # all bits of a float32 but its sign
_I0 = np.int32(0)
_I32 = np.int32


# --------------------------------------------------------------------------- #
# Activation quantization (w8a8)
# --------------------------------------------------------------------------- #


@njit(nogil=True, cache=True)
def _max_magnitude_bits(bits):
    """Bit pattern of max |v| over the float32 values whose int32 bit
    patterns are ``bits``: non-negative IEEE floats order as their bit
    patterns do, and the int32 max reduction vectorizes (``vpmaxsd``) where
    the float one stayed scalar (15x slower: 89 against 6 us at 128 x 1536)."""
    top = np.int32(0)
    for k in range(bits.shape[0]):
        top = max(top, _I32(bits[k] & _MAGNITUDE_MASK))
    return top


@njit(nogil=True, cache=True)
def quantize_rows_kernel(x, xq, xs):
    """Per-row symmetric int8: ``xs[m] = max|x[m]| / 127``, ``xq = rint(x / xs)``.

    x: float32[M, K]; xq: int8[M, K] and xs: float32[M], written. Round half
    to even, codes clipped to [-127, 127]; an all-zero row gets
    ``ZERO_ROW_SCALE`` and zero codes. Non-finite x gives meaningless codes.
    """
    M, K = x.shape
    x_bits = x.view(np.int32)
    xs_bits = xs.view(np.int32)
    for m in range(M):
        xs_bits[m] = _max_magnitude_bits(x_bits[m])  # xs[m] = max |x[m]|, for now
        absmax = xs[m]
        scale = absmax / _CODE_MAX if absmax > 0 else np.float32(ZERO_ROW_SCALE)
        xs[m] = scale
        for k in range(K):
            q = np.rint(x[m, k] / scale)
            xq[m, k] = np.int8(min(max(q, -_CODE_MAX), _CODE_MAX))


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(xq int8[M, K], xs float32[M])`` of C-contiguous float32[M, K] ``x``,
    ``x[m] ~ xq[m] * xs[m]`` (see :func:`quantize_rows_kernel`).

    Raises ValueError (naming ``x``) for any other ``x``: the kernel reads
    its bits as int32.
    """
    if not (isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim == 2
            and x.flags.c_contiguous):
        raise ValueError(f"x: expected a C-contiguous float32 [M, K] array, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', '')}")
    xq = np.empty(x.shape, dtype=np.int8)
    xs = np.empty(x.shape[0], dtype=np.float32)
    quantize_rows_kernel(x, xq, xs)
    return xq, xs


@njit(nogil=True, cache=True)
def scale_accumulator_kernel(acc, xs, scales, out):
    """w8a8 epilogue: ``out[m, n] = float32(acc[m, n]) * xs[m] * scales[n]``.

    acc: int32[M, N]; xs: float32[M]; scales: float32[N]; out: float32[M, N].
    """
    M, N = acc.shape
    for m in range(M):
        s = xs[m]
        for n in range(N):
            out[m, n] = (np.float32(acc[m, n]) * s) * scales[n]


# --------------------------------------------------------------------------- #
# Register tiles. Edge tiles clamp indices to the last row / channel.
# --------------------------------------------------------------------------- #


@njit(nogil=True, cache=True)
def _clamped4(i, last):
    """i, i+1, i+2, i+3, each at most ``last``."""
    return i, min(i + 1, last), min(i + 2, last), min(i + 3, last)


@njit(nogil=True, cache=True, fastmath=_FASTMATH)
def _int8_tile_1x4(x, m, wq, scales, n, out):
    """out[m, n:n+4] = (x[m] @ wq[n:n+4].T) * scales[n:n+4]."""
    K = x.shape[1]
    n0, n1, n2, n3 = _clamped4(n, wq.shape[0] - 1)
    a0 = a1 = a2 = a3 = _F0
    for k in range(K):
        xk = x[m, k]
        a0 += xk * np.float32(wq[n0, k])
        a1 += xk * np.float32(wq[n1, k])
        a2 += xk * np.float32(wq[n2, k])
        a3 += xk * np.float32(wq[n3, k])
    _store4(out, m, n0, n1, n2, n3,
            a0 * scales[n0], a1 * scales[n1], a2 * scales[n2], a3 * scales[n3])


@njit(nogil=True, cache=True, fastmath=_FASTMATH)
def _int8_tile_4x4(x, m, wq, scales, n, out):
    """out[m:m+4, n:n+4] = (x[m:m+4] @ wq[n:n+4].T) * scales[n:n+4]."""
    K = x.shape[1]
    m0, m1, m2, m3 = _clamped4(m, x.shape[0] - 1)
    n0, n1, n2, n3 = _clamped4(n, wq.shape[0] - 1)
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = _F0
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = _F0
    for k in range(K):
        w0 = np.float32(wq[n0, k])
        w1 = np.float32(wq[n1, k])
        w2 = np.float32(wq[n2, k])
        w3 = np.float32(wq[n3, k])
        x0, x1, x2, x3 = x[m0, k], x[m1, k], x[m2, k], x[m3, k]
        a00 += x0 * w0; a01 += x0 * w1; a02 += x0 * w2; a03 += x0 * w3  # noqa: E702
        a10 += x1 * w0; a11 += x1 * w1; a12 += x1 * w2; a13 += x1 * w3  # noqa: E702
        a20 += x2 * w0; a21 += x2 * w1; a22 += x2 * w2; a23 += x2 * w3  # noqa: E702
        a30 += x3 * w0; a31 += x3 * w1; a32 += x3 * w2; a33 += x3 * w3  # noqa: E702
    s0, s1, s2, s3 = scales[n0], scales[n1], scales[n2], scales[n3]
    _store4(out, m0, n0, n1, n2, n3, a00 * s0, a01 * s1, a02 * s2, a03 * s3)
    _store4(out, m1, n0, n1, n2, n3, a10 * s0, a11 * s1, a12 * s2, a13 * s3)
    _store4(out, m2, n0, n1, n2, n3, a20 * s0, a21 * s1, a22 * s2, a23 * s3)
    _store4(out, m3, n0, n1, n2, n3, a30 * s0, a31 * s1, a32 * s2, a33 * s3)


@njit(nogil=True, cache=True)
def _w8a8_tile_1x4(xq, m, wq, n, acc):
    """acc[m, n:n+4] = xq[m] @ wq[n:n+4].T in exact int32."""
    K = xq.shape[1]
    n0, n1, n2, n3 = _clamped4(n, wq.shape[0] - 1)
    a0 = a1 = a2 = a3 = _I0
    for k in range(K):
        xk = _I32(xq[m, k])
        a0 = _I32(a0 + xk * _I32(wq[n0, k]))
        a1 = _I32(a1 + xk * _I32(wq[n1, k]))
        a2 = _I32(a2 + xk * _I32(wq[n2, k]))
        a3 = _I32(a3 + xk * _I32(wq[n3, k]))
    _store4(acc, m, n0, n1, n2, n3, a0, a1, a2, a3)


@njit(nogil=True, cache=True)
def _w8a8_tile_4x4(xq, m, wq, n, acc):
    """acc[m:m+4, n:n+4] = xq[m:m+4] @ wq[n:n+4].T in exact int32."""
    K = xq.shape[1]
    m0, m1, m2, m3 = _clamped4(m, xq.shape[0] - 1)
    n0, n1, n2, n3 = _clamped4(n, wq.shape[0] - 1)
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = _I0
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = _I0
    for k in range(K):
        w0 = _I32(wq[n0, k])
        w1 = _I32(wq[n1, k])
        w2 = _I32(wq[n2, k])
        w3 = _I32(wq[n3, k])
        x0, x1, x2, x3 = _I32(xq[m0, k]), _I32(xq[m1, k]), _I32(xq[m2, k]), _I32(xq[m3, k])
        a00 = _I32(a00 + x0 * w0); a01 = _I32(a01 + x0 * w1)  # noqa: E702
        a02 = _I32(a02 + x0 * w2); a03 = _I32(a03 + x0 * w3)  # noqa: E702
        a10 = _I32(a10 + x1 * w0); a11 = _I32(a11 + x1 * w1)  # noqa: E702
        a12 = _I32(a12 + x1 * w2); a13 = _I32(a13 + x1 * w3)  # noqa: E702
        a20 = _I32(a20 + x2 * w0); a21 = _I32(a21 + x2 * w1)  # noqa: E702
        a22 = _I32(a22 + x2 * w2); a23 = _I32(a23 + x2 * w3)  # noqa: E702
        a30 = _I32(a30 + x3 * w0); a31 = _I32(a31 + x3 * w1)  # noqa: E702
        a32 = _I32(a32 + x3 * w2); a33 = _I32(a33 + x3 * w3)  # noqa: E702
    _store4(acc, m0, n0, n1, n2, n3, a00, a01, a02, a03)
    _store4(acc, m1, n0, n1, n2, n3, a10, a11, a12, a13)
    _store4(acc, m2, n0, n1, n2, n3, a20, a21, a22, a23)
    _store4(acc, m3, n0, n1, n2, n3, a30, a31, a32, a33)


@njit(nogil=True, cache=True)
def _store4(out, m, n0, n1, n2, n3, v0, v1, v2, v3):
    """One row of a tile: out[m, n_j] = v_j (a clamped duplicate stores twice)."""
    out[m, n0] = v0
    out[m, n1] = v1
    out[m, n2] = v2
    out[m, n3] = v3


# --------------------------------------------------------------------------- #
# Loop orders over the output channels [lo, hi). Rows go by MR-row tiles; a
# lone last row takes the 1 x NR tile, 2 or 3 leftover rows a clamped MR x NR
# one. The choice is made here, not in a helper: a helper that calls both
# tiles is not inlined, and the per-tile call cost 40% (measured).
# --------------------------------------------------------------------------- #


@njit(nogil=True, cache=True)
def _rows_in_mr_tiles(M):
    """Rows covered by MR x NR tiles: all but a lone last row."""
    return M - 1 if M % MR == 1 else M


@njit(nogil=True, cache=True)
def int8_gemv_range(x, wq, scales, out, lo, hi):
    """Weight-only int8, decode order: channels [lo, hi) of ``out``.

    x: float32[M, K]; wq: int8[N, K]; scales: float32[N]; out: float32[M, N].
    lo must be a multiple of NR. For each NR channels, every row.
    """
    M = x.shape[0]
    m_tiles = _rows_in_mr_tiles(M)
    for n in range(lo, hi, NR):
        for m in range(0, m_tiles, MR):
            _int8_tile_4x4(x, m, wq, scales, n, out)
        if m_tiles < M:
            _int8_tile_1x4(x, M - 1, wq, scales, n, out)


@njit(nogil=True, cache=True)
def int8_tiled_range(x, wq, scales, out, lo, hi):
    """Weight-only int8, prefill order: channels [lo, hi) of ``out``.

    Same arguments as :func:`int8_gemv_range`. For each cache tile of
    CACHE_TILE_N channels, for each row tile, the tile's NR-channel groups.
    """
    M = x.shape[0]
    m_tiles = _rows_in_mr_tiles(M)
    for t in range(lo, hi, CACHE_TILE_N):
        t_hi = min(t + CACHE_TILE_N, hi)
        for m in range(0, m_tiles, MR):
            for n in range(t, t_hi, NR):
                _int8_tile_4x4(x, m, wq, scales, n, out)
        if m_tiles < M:
            for n in range(t, t_hi, NR):
                _int8_tile_1x4(x, M - 1, wq, scales, n, out)


@njit(nogil=True, cache=True)
def w8a8_gemv_range(xq, wq, acc, lo, hi):
    """w8a8 int32 accumulator, decode order: channels [lo, hi) of ``acc``.

    xq: int8[M, K]; wq: int8[N, K]; acc: int32[M, N]; lo a multiple of NR.
    """
    M = xq.shape[0]
    m_tiles = _rows_in_mr_tiles(M)
    for n in range(lo, hi, NR):
        for m in range(0, m_tiles, MR):
            _w8a8_tile_4x4(xq, m, wq, n, acc)
        if m_tiles < M:
            _w8a8_tile_1x4(xq, M - 1, wq, n, acc)


@njit(nogil=True, cache=True)
def w8a8_tiled_range(xq, wq, acc, lo, hi):
    """w8a8 int32 accumulator, prefill order (see :func:`int8_tiled_range`)."""
    M = xq.shape[0]
    m_tiles = _rows_in_mr_tiles(M)
    for t in range(lo, hi, CACHE_TILE_N):
        t_hi = min(t + CACHE_TILE_N, hi)
        for m in range(0, m_tiles, MR):
            for n in range(t, t_hi, NR):
                _w8a8_tile_4x4(xq, m, wq, n, acc)
        if m_tiles < M:
            for n in range(t, t_hi, NR):
                _w8a8_tile_1x4(xq, M - 1, wq, n, acc)


# --------------------------------------------------------------------------- #
# Parallel drivers: one prange iteration per contiguous range of channels
# --------------------------------------------------------------------------- #


@njit(nogil=True, cache=True)
def _chunk(c, n_chunks, N):
    """Channels [lo, hi) of chunk c of n_chunks: whole NR-channel groups,
    spread evenly (a cache tile may straddle two chunks)."""
    groups = (N + NR - 1) // NR
    lo = (c * groups) // n_chunks * NR
    hi = min(((c + 1) * groups) // n_chunks * NR, N)
    return lo, hi


@njit(nogil=True, cache=True, parallel=True)
def int8_parallel(x, wq, scales, out, tiled, n_chunks):
    """:func:`int8_tiled_range` (``tiled``) or :func:`int8_gemv_range` over
    all N channels, split in ``n_chunks`` ranges run by Numba's threads."""
    N = wq.shape[0]
    for c in prange(n_chunks):
        lo, hi = _chunk(c, n_chunks, N)
        if tiled:
            int8_tiled_range(x, wq, scales, out, lo, hi)
        else:
            int8_gemv_range(x, wq, scales, out, lo, hi)


@njit(nogil=True, cache=True, parallel=True)
def w8a8_parallel(xq, wq, acc, tiled, n_chunks):
    """:func:`w8a8_tiled_range` or :func:`w8a8_gemv_range` over all N
    channels, split in ``n_chunks`` ranges run by Numba's threads."""
    N = wq.shape[0]
    for c in prange(n_chunks):
        lo, hi = _chunk(c, n_chunks, N)
        if tiled:
            w8a8_tiled_range(xq, wq, acc, lo, hi)
        else:
            w8a8_gemv_range(xq, wq, acc, lo, hi)
