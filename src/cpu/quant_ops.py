"""Int8 linear layers on the CPU: checked wrappers of :mod:`kvserve.cpu.quant_kernels`.

``y = x @ W.T (+ bias)`` (PyTorch ``nn.Linear``) with ``W ~ wq * scales[:, None]``:

* :func:`quantize_weight`: symmetric per-output-channel int8,
  ``scales[n] = max|W[n]| / 127``, ``wq = rint(W / scales)`` (LLM.int8's
  absmax weights, Dettmers et al. 2022; the weight half of SmoothQuant's
  W8A8, Xiao et al. 2023; vLLM's per-channel int8 weights).
* :func:`linear_int8`: weight-only int8, float32 activations and sums.
* :func:`linear_w8a8`: activations quantized per token (row) at run time,
  exact int32 sums, ``acc * xs[m] * scales[n]`` (SmoothQuant's dynamic
  per-token / per-channel scheme without its smoothing; vLLM's
  ``scaled_int8_quant`` + ``cutlass_scaled_mm`` with per-token and
  per-channel scales).
* :func:`w8a8_accumulate`: the int32 accumulator alone.

Path choice: at most ``GEMV_MAX_ROWS`` rows take the decode loop order,
more the cache-tiled one; at least ``parallel.PARALLEL_MIN_MACS`` multiply-adds
and more than one thread run on Numba's threads under
``kvserve.cpu.parallel.PARALLEL_REGION``, smaller products serially on the
caller's thread (a parallel region costs more than they do).

Operands are checked, never converted: a wrong dtype, shape or layout
raises ``ValueError`` naming the argument, so that each kernel compiles for
one type signature. A read-only array (e.g. memory-mapped weights) is
accepted but compiles a second variant of the kernels.
"""

from __future__ import annotations

import numpy as np

from kvserve.cpu import quant_kernels as qk
from kvserve.cpu.parallel import PARALLEL_REGION, check_array, parallel_chunks
from kvserve.cpu.quant_kernels import INT8_MAX, W8A8_MAX_K, quantize_activations

__all__ = ["GEMV_MAX_ROWS", "linear_int8", "linear_w8a8", "quantize_activations",
           "quantize_weight", "w8a8_accumulate"]

#: Products with at most this many rows (decode batches) take the GEMV loop
#: order, larger ones the cache-tiled one. Up to one row tile (MR rows) the
#: two orders run the same tiles in the same sequence; beyond it, the GEMV
#: order re-reads each group of channels for the next row tile at once, and
#: measured 1.7x slower on the 49152 x 576 LM head (out of cache) at M = 6-8,
#: the same on cache-resident layers.
GEMV_MAX_ROWS = 4
#: Scale of an all-zero weight row (its codes are all 0 whatever it is; the
#: same value as ``kvserve.model.quantization.quantize_int8``).
ZERO_ROW_SCALE = 1.0


def quantize_weight(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel int8 of a float ``[N, K]`` weight.

    Returns ``(wq int8[N, K], scales float32[N])``, C-contiguous, with
    ``scales[n] = max_k |w[n, k]| / 127`` computed in float32 and
    ``wq = rint(w / scales[:, None])`` (round half to even), so that
    ``|wq * scales - w| <= scales / 2`` elementwise and the largest entry of
    each row maps to +-127. An all-zero row gets ``ZERO_ROW_SCALE`` and codes 0.

    Raises ValueError (naming ``w``) for a non-2-D, non-floating or
    non-finite ``w``.
    """
    w = np.asarray(w)
    if w.ndim != 2 or w.dtype.kind != "f":
        raise ValueError(f"w: expected a floating [N, K] array, got {w.dtype} {w.shape}")
    w = w.astype(np.float32, copy=False)
    if not np.isfinite(w).all():
        raise ValueError("w: has non-finite values")
    absmax = np.abs(w).max(axis=1, initial=0.0)
    scales = np.where(absmax > 0, absmax / np.float32(INT8_MAX),
                      np.float32(ZERO_ROW_SCALE)).astype(np.float32)
    codes = np.clip(np.rint(w / scales[:, None]), -INT8_MAX, INT8_MAX)
    return np.ascontiguousarray(codes, dtype=np.int8), scales


def linear_int8(x: np.ndarray, wq: np.ndarray, scales: np.ndarray,
                bias: np.ndarray | None = None, num_threads: int | None = None) -> np.ndarray:
    """Weight-only int8 linear layer: ``(x @ wq.T) * scales (+ bias)``.

    Args:
        x: float32[M, K], C-contiguous.
        wq: int8[N, K], C-contiguous (from :func:`quantize_weight`).
        scales: float32[N], per output channel.
        bias: float32[N] or None, added to the result.
        num_threads: Numba threads, set on the calling thread as
            ``CpuOps`` does (None: Numba's current setting).

    Returns a new float32[M, N]; the K-term sums are float32 (in a
    reassociated order: within ``(K + 1) * 2**-24 * (|x| @ |wq|.T) * scales``
    of the exact product).

    Raises ValueError naming the argument on a wrong dtype, shape or layout,
    and for ``num_threads`` outside [1, NUMBA_NUM_THREADS].
    """
    _check_operands(x, wq, scales, bias)
    out = np.empty((x.shape[0], wq.shape[0]), dtype=np.float32)
    tiled = x.shape[0] > GEMV_MAX_ROWS
    n_chunks = parallel_chunks(x.shape, wq.shape[0], num_threads)
    if n_chunks:
        with PARALLEL_REGION:
            qk.int8_parallel(x, wq, scales, out, tiled, n_chunks)
    elif tiled:
        qk.int8_tiled_range(x, wq, scales, out, 0, wq.shape[0])
    else:
        qk.int8_gemv_range(x, wq, scales, out, 0, wq.shape[0])
    return _add_bias(out, bias)


def linear_w8a8(x: np.ndarray, wq: np.ndarray, scales: np.ndarray,
                bias: np.ndarray | None = None, num_threads: int | None = None) -> np.ndarray:
    """W8A8 linear layer: ``x`` quantized per row, exact int32 products.

    ``xq, xs = quantize_activations(x)``; ``acc = w8a8_accumulate(xq, wq)``;
    returns the new float32[M, N] ``acc * xs[:, None] * scales (+ bias)``
    (two float32 products per element after the exact int32 sum).

    Same arguments as :func:`linear_int8`. Also raises ValueError when K
    exceeds ``W8A8_MAX_K`` (an int32 sum could overflow).
    """
    _check_operands(x, wq, scales, bias, max_k=W8A8_MAX_K)
    xq, xs = quantize_activations(x)
    acc = w8a8_accumulate(xq, wq, num_threads)
    out = np.empty(acc.shape, dtype=np.float32)
    qk.scale_accumulator_kernel(acc, xs, scales, out)
    return _add_bias(out, bias)


def w8a8_accumulate(xq: np.ndarray, wq: np.ndarray, num_threads: int | None = None) -> np.ndarray:
    """The exact int32 ``acc[m, n] = sum_k xq[m, k] * wq[n, k]``.

    xq: int8[M, K] and wq: int8[N, K], C-contiguous; returns int32[M, N].
    Raises ValueError naming the argument on a wrong dtype, shape or layout,
    for K > ``W8A8_MAX_K``, or for a bad ``num_threads``.
    """
    _check_operands(xq, wq, x_name="xq", x_dtype=np.int8, max_k=W8A8_MAX_K)
    acc = np.empty((xq.shape[0], wq.shape[0]), dtype=np.int32)
    tiled = xq.shape[0] > GEMV_MAX_ROWS
    n_chunks = parallel_chunks(xq.shape, wq.shape[0], num_threads)
    if n_chunks:
        with PARALLEL_REGION:
            qk.w8a8_parallel(xq, wq, acc, tiled, n_chunks)
    elif tiled:
        qk.w8a8_tiled_range(xq, wq, acc, 0, wq.shape[0])
    else:
        qk.w8a8_gemv_range(xq, wq, acc, 0, wq.shape[0])
    return acc


# --------------------------------------------------------------------------- #


def _check_operands(x: np.ndarray, wq: np.ndarray, scales: np.ndarray | None = None,
                    bias: np.ndarray | None = None, *, x_name: str = "x",
                    x_dtype: type = np.float32, max_k: int | None = None) -> None:
    """ValueError naming the first bad argument (see :func:`linear_int8`)."""
    check_array(x_name, x, x_dtype, 2)
    check_array("wq", wq, np.int8, 2)
    if wq.shape[1] != x.shape[1]:
        raise ValueError(f"wq: {wq.shape} must be [N, K] with the K of {x_name} {x.shape}")
    if max_k is not None and x.shape[1] > max_k:
        raise ValueError(f"{x_name}: K = {x.shape[1]} exceeds {max_k}, beyond which the int32 "
                         "sums could overflow")
    if scales is not None:
        check_array("scales", scales, np.float32, 1)
        if scales.shape != (wq.shape[0],):
            raise ValueError(f"scales: shape {scales.shape}, expected ({wq.shape[0]},)")
    if bias is not None:
        check_array("bias", bias, np.float32, 1)
        if bias.shape != (wq.shape[0],):
            raise ValueError(f"bias: shape {bias.shape}, expected ({wq.shape[0]},)")


def _add_bias(y: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    if bias is not None:
        y += bias
    return y
