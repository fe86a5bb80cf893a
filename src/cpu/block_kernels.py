"""Numba kernels for ggml block weights (Q4_0 / Q4_1 / Q8_0), ``y = x @ W.T``.

``W`` is a ``kvserve.model.ggml_blocks.BlockQuantizedWeight`` ``[N, K]``;
activations and sums stay float32, so the result equals dequantize-then-
matmul up to float32 summation order (unlike llama.cpp's CPU path, which
quantizes activations to Q8 blocks first).

Decode (few rows): for each panel of ``PANEL`` output channels, the panel's
blocks are dequantized into four float32 rows of scratch that stay in L1
(9 KiB at K = 576, 24 KiB at K = 1536), then every activation row takes
its dot products with the panel (a 1 x 4 register tile). Dequantizing is an elementwise loop (no
reduction), so it vectorizes whole; each dot product is one long float32
reduction over K, reduced across lanes once. Per 32 weights of a Q4 block:
one 16-byte load, the nibble split, two int -> float conversions and two
FMAs with the block's ``d`` and ``m``; a weight is read from memory once
per step whatever the number of rows.

Prefill (many rows): ``dequantize_range`` fills float32 panels of channels,
and ``kvserve.cpu.block_ops`` multiplies each with BLAS sgemm.

What the assembly shows (``inspect_asm`` of ``q4_gemv_range``; AMD EPYC
"znver5", LLVM via llvmlite 0.50 / Numba 0.68): per 16 bytes of codes,
``vpmovzxbd`` (16 codes to int32 lanes), ``vpand`` for the low nibbles and
``vgf2p8affineqb`` (a GFNI byte shift) for the high ones, two
``vcvtdq2ps`` and two ``vfmadd213ps`` with the broadcast ``d`` and ``m``
on zmm; the dot products are ``vfmadd231ps`` on zmm. One core runs the
576 x 3072 gate/up product at M = 1 in 0.15 ms (12 G weights/s), about 4x
below what its memory bandwidth would allow, so the decode is compute-bound
in the dequantization: no int8 dot-product instruction applies while the
activations stay float.  On a Zen 2 (AVX2, no AVX-512; the 2-core
development machine of 2026-12-02) the same product takes 0.47 ms; the
integer-dot-product alternative with Q8 activations is
``kvserve.cpu.block_dot_kernels``.

Arrays must be C-contiguous with the dtypes documented on each function
(``block_ops`` checks them), so each kernel compiles once.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

# Importing kernels also selects Numba's threading layer, which the
# parallel kernels rely on; _store4 is the tile store the float GEMV uses.
from kvserve.cpu.kernels import _store4

#: Input channels per block (ggml's QK).
QK = 32
#: Output channels dequantized together by the decode kernels.
PANEL = 4

_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
_F0 = np.float32(0.0)
_LOW = np.int32(15)
_SHIFT = np.int32(4)


@njit(nogil=True, cache=True, fastmath=_FASTMATH, inline="always")
def _dequant_q4_row(qs, d, mn, n, w, half):
    """w[:] = row n of a q4 weight: ``d * q + m`` per block (float32[K]).

    ``half`` = 16, the bytes of a block, passed in rather than written as a
    constant: with a constant trip count LLVM unrolls the inner loop fully
    before its loop vectorizer runs and leaves 32 scalar conversions per
    block (4x slower, measured); with a run-time one it vectorizes it.
    """
    for b in range(d.shape[1]):
        db = d[n, b]
        mb = mn[n, b]
        o = 2 * half * b
        i = half * b
        for j in range(half):
            q = np.int32(qs[n, i + j])
            # int32(...) around each int op keeps it on 32-bit lanes (Numba
            # types int32 & int32 as int64: vcvtqq2ps on 8 lanes otherwise).
            w[o + j] = np.float32(np.int32(q & _LOW)) * db + mb
            w[o + half + j] = np.float32(np.int32(q >> _SHIFT)) * db + mb


@njit(nogil=True, cache=True, fastmath=_FASTMATH, inline="always")
def _dequant_q8_row(qs, d, n, w, qk):
    """w[:] = row n of a q8 weight: ``d * q`` per block (float32[K]); ``qk``
    = 32 at run time, as ``half`` above."""
    for b in range(d.shape[1]):
        db = d[n, b]
        o = qk * b
        for j in range(qk):
            w[o + j] = np.float32(qs[n, o + j]) * db


@njit(nogil=True, cache=True, fastmath=_FASTMATH)
def _panel_dots(x, p0, p1, p2, p3, n0, hi, out):
    """out[m, n0 + r] = x[m] . p_r for the r with n0 + r < hi, every m: a
    1 x 4 register tile, four float32 reductions over K sharing each x load."""
    for m in range(x.shape[0]):
        a0 = a1 = a2 = a3 = _F0
        for k in range(x.shape[1]):
            xk = x[m, k]
            a0 += xk * p0[k]
            a1 += xk * p1[k]
            a2 += xk * p2[k]
            a3 += xk * p3[k]
        _store4(out, m, n0, hi, a0, a1, a2, a3)


@njit(nogil=True, cache=True)
def q4_gemv_range(x, qs, d, mn, out, lo, hi):
    """Decode product of a q4 weight, channels [lo, hi) of ``out``.

    x: float32[M, K]; qs: uint8[N, K / 2]; d, mn: float32[N, K / 32];
    out: float32[M, N]. A panel past N repeats row N - 1 (never stored).
    """
    K = x.shape[1]
    last = qs.shape[0] - 1
    half = qs.shape[1] // d.shape[1]
    p0 = np.empty(K, np.float32)
    p1 = np.empty(K, np.float32)
    p2 = np.empty(K, np.float32)
    p3 = np.empty(K, np.float32)
    for n0 in range(lo, hi, PANEL):
        _dequant_q4_row(qs, d, mn, n0, p0, half)
        _dequant_q4_row(qs, d, mn, min(n0 + 1, last), p1, half)
        _dequant_q4_row(qs, d, mn, min(n0 + 2, last), p2, half)
        _dequant_q4_row(qs, d, mn, min(n0 + 3, last), p3, half)
        _panel_dots(x, p0, p1, p2, p3, n0, hi, out)


@njit(nogil=True, cache=True)
def q8_gemv_range(x, qs, d, out, lo, hi):
    """Decode product of a q8 weight, channels [lo, hi) of ``out``.

    x: float32[M, K]; qs: int8[N, K]; d: float32[N, K / 32]; out: float32[M, N].
    """
    K = x.shape[1]
    last = qs.shape[0] - 1
    qk = qs.shape[1] // d.shape[1]
    p0 = np.empty(K, np.float32)
    p1 = np.empty(K, np.float32)
    p2 = np.empty(K, np.float32)
    p3 = np.empty(K, np.float32)
    for n0 in range(lo, hi, PANEL):
        _dequant_q8_row(qs, d, n0, p0, qk)
        _dequant_q8_row(qs, d, min(n0 + 1, last), p1, qk)
        _dequant_q8_row(qs, d, min(n0 + 2, last), p2, qk)
        _dequant_q8_row(qs, d, min(n0 + 3, last), p3, qk)
        _panel_dots(x, p0, p1, p2, p3, n0, hi, out)


@njit(nogil=True, cache=True)
def dequantize_q4_range(qs, d, mn, out, lo, hi):
    """out[n - lo] = dequantized row n of a q4 weight, for n in [lo, hi).

    out: float32[>= hi - lo, K].
    """
    half = qs.shape[1] // d.shape[1]
    for n in range(lo, hi):
        _dequant_q4_row(qs, d, mn, n, out[n - lo], half)


@njit(nogil=True, cache=True)
def dequantize_q8_range(qs, d, out, lo, hi):
    """out[n - lo] = dequantized row n of a q8 weight, for n in [lo, hi)."""
    qk = qs.shape[1] // d.shape[1]
    for n in range(lo, hi):
        _dequant_q8_row(qs, d, n, out[n - lo], qk)


# --------------------------------------------------------------------------- #
# Parallel drivers: one prange iteration per contiguous range of channels
# --------------------------------------------------------------------------- #


@njit(nogil=True, cache=True)
def _chunk(c, n_chunks, lo, hi):
    """Channels of chunk c of [lo, hi) split in n_chunks: whole panels, spread evenly."""
    panels = (hi - lo + PANEL - 1) // PANEL
    a = lo + (c * panels) // n_chunks * PANEL
    b = min(lo + ((c + 1) * panels) // n_chunks * PANEL, hi)
    return a, b


@njit(nogil=True, cache=True, parallel=True)
def q4_gemv_parallel(x, qs, d, mn, out, n_chunks):
    """:func:`q4_gemv_range` over all N channels in ``n_chunks`` parallel ranges."""
    for c in prange(n_chunks):
        a, b = _chunk(c, n_chunks, 0, qs.shape[0])
        q4_gemv_range(x, qs, d, mn, out, a, b)


@njit(nogil=True, cache=True, parallel=True)
def q8_gemv_parallel(x, qs, d, out, n_chunks):
    """:func:`q8_gemv_range` over all N channels in ``n_chunks`` parallel ranges."""
    for c in prange(n_chunks):
        a, b = _chunk(c, n_chunks, 0, qs.shape[0])
        q8_gemv_range(x, qs, d, out, a, b)


@njit(nogil=True, cache=True, parallel=True)
def dequantize_q4_parallel(qs, d, mn, out, lo, hi, n_chunks):
    """:func:`dequantize_q4_range` of rows [lo, hi) in ``n_chunks`` parallel ranges."""
    for c in prange(n_chunks):
        a, b = _chunk(c, n_chunks, lo, hi)
        dequantize_q4_range(qs, d, mn, out[a - lo:], a, b)


@njit(nogil=True, cache=True, parallel=True)
def dequantize_q8_parallel(qs, d, out, lo, hi, n_chunks):
    """:func:`dequantize_q8_range` of rows [lo, hi) in ``n_chunks`` parallel ranges."""
    for c in prange(n_chunks):
        a, b = _chunk(c, n_chunks, lo, hi)
        dequantize_q8_range(qs, d, out[a - lo:], a, b)
