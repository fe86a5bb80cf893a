"""W8A8 matrix products on the CPU, with grouped activation scales, as Numba kernels.

(Weight-only int8 is ``kvserve.cpu.quant_ops.linear_int8``.)

``y = x @ W.T`` (PyTorch nn.Linear) with ``W ~ qweight * scales[:, None]``
(``kvserve.model.quantization``). ``linear_w8a8``: activations quantized dynamically to int8 per token and
  per group of ``GROUP`` consecutive input channels, each group with its own
  absmax scale (SmoothQuant's dynamic per-token scheme, refined to groups as
  in per-group activation quantization: one scale per token alone cost the
  default model 9.9% of perplexity, outlier channels flattening the rest),
  then per group an exact int32 accumulation ``sum_k xq[m, k] * qweight[n, k]``,
  scaled by the group's activation scale and summed in float32, then times
  ``scales[n]``.

Decode-sized batches (fewer than ``DENSE_MIN_ROWS`` rows) run the kernel
below. Larger ones (prefill chunks) dequantize the quantized activations and
weights to float32 and use BLAS sgemm: the same values up to float32
rounding, at sgemm speed; a tiled int8 prefill kernel is still to be written.

Mapping: output channels are split across Numba threads (``prange`` over n);
each thread reads a weight row once and takes its dot product with every
activation row while the row is in L1. The integer inner loop is exact in
any order.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

#: Largest magnitude of a symmetric int8 code.
INT8_MAX = 127
#: Input channels per activation scale of ``linear_w8a8`` (a K that it does
#: not divide gets one group per row).
GROUP = 64
#: From this many rows on, products dequantize and run BLAS sgemm (measured
#: on the default model: the int8 kernels win for decode batches and lose
#: from prefill-chunk sizes on).
DENSE_MIN_ROWS = 16


@njit(nogil=True, cache=True)
def _quantize_groups(x, group, xq, x_scales):  # pragma: no cover - compiled
    """Symmetric int8 per (row, group): x_scales[m, g] = max|x[m, group g]| / 127
    (1 for a zero group)."""
    M, K = x.shape
    for m in range(M):
        for g in range(K // group):
            absmax = np.float32(0.0)
            for k in range(g * group, (g + 1) * group):
                absmax = max(absmax, abs(x[m, k]))
            scale = absmax / np.float32(INT8_MAX) if absmax > 0 else np.float32(1.0)
            x_scales[m, g] = scale
            inv = np.float32(1.0) / scale
            for k in range(g * group, (g + 1) * group):
                q = np.rint(x[m, k] * inv)
                xq[m, k] = np.int8(min(max(q, -INT8_MAX), INT8_MAX))


@njit(nogil=True, cache=True, parallel=True)
def _w8a8_kernel(xq, x_scales, qweight, group, acc_out):  # pragma: no cover - compiled
    """acc_out[m, n] = sum_g x_scales[m, g] * (exact int32 sum over group g of
    xq[m, k] * qweight[n, k])."""
    M, K = xq.shape
    for n in prange(qweight.shape[0]):
        w = qweight[n]
        for m in range(M):
            total = np.float32(0.0)
            for g in range(K // group):
                acc = np.int32(0)
                for k in range(g * group, (g + 1) * group):
                    # int32(...) keeps the sum in int32 (Numba types int32 *
                    # int32 as int64, which LLVM then widens to 64-bit lanes).
                    acc = np.int32(acc + np.int32(xq[m, k]) * np.int32(w[k]))
                total += np.float32(acc) * x_scales[m, g]
            acc_out[m, n] = total


def _check(x: np.ndarray, qweight: np.ndarray, scales: np.ndarray, what: str) -> None:
    if x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous:
        raise ValueError(f"{what}: x must be C-contiguous float32 [M, K], got {x.dtype} {x.shape}")
    if qweight.dtype != np.int8 or qweight.ndim != 2 or not qweight.flags.c_contiguous:
        raise ValueError(f"{what}: qweight must be C-contiguous int8 [N, K], got "
                         f"{qweight.dtype} {qweight.shape}")
    if qweight.shape[1] != x.shape[1]:
        raise ValueError(f"{what}: x {x.shape} and qweight {qweight.shape} do not match")
    if scales.dtype != np.float32 or scales.shape != (qweight.shape[0],):
        raise ValueError(f"{what}: scales must be float32 [{qweight.shape[0]}], got "
                         f"{scales.dtype} {scales.shape}")


def _bias(y: np.ndarray, bias: np.ndarray | None, what: str) -> np.ndarray:
    if bias is not None:
        if bias.shape != (y.shape[1],):
            raise ValueError(f"{what}: bias shape {bias.shape}, expected ({y.shape[1]},)")
        y += bias
    return y


def group_size(k: int) -> int:
    """Input channels per activation scale for rows of ``k`` channels."""
    return GROUP if k % GROUP == 0 else k


def quantize_activations(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-token, per-group int8 of float32[M, K] ``x``: ``(xq int8[M, K],
    x_scales float32[M, K // group])``, ``x[m, k] ~ xq[m, k] * x_scales[m, k // group]``,
    round half to even, codes in [-127, 127]."""
    xq = np.empty(x.shape, dtype=np.int8)
    x_scales = np.empty((x.shape[0], x.shape[1] // group), dtype=np.float32)
    _quantize_groups(x, group, xq, x_scales)
    return xq, x_scales


def w8a8_accumulate(xq: np.ndarray, x_scales: np.ndarray, qweight: np.ndarray,
                    group: int) -> np.ndarray:
    """float32[M, N]: per group the exact int32 product of the int8 operands,
    times the group's activation scale, summed over groups."""
    out = np.empty((xq.shape[0], qweight.shape[0]), dtype=np.float32)
    _w8a8_kernel(xq, x_scales, qweight, group, out)
    return out


def linear_w8a8(x: np.ndarray, qweight: np.ndarray, scales: np.ndarray,
                bias: np.ndarray | None = None) -> np.ndarray:
    """float32[M, N]: ``x`` quantized per token and group, int32 products
    with ``qweight`` per group, scaled by both scales (+ bias). Same
    arguments and errors as ``quant_ops.linear_int8``: x float32[M, K]
    C-contiguous, qweight int8[N, K], scales float32[N], bias float32[N] or
    None; ``ValueError`` naming the argument."""
    _check(x, qweight, scales, "linear_w8a8")
    group = group_size(x.shape[1])
    xq, x_scales = quantize_activations(x, group)
    if x.shape[0] >= DENSE_MIN_ROWS:
        x_deq = xq.astype(np.float32) * np.repeat(x_scales, group, axis=1)
        out = x_deq @ qweight.T.astype(np.float32)
    else:
        out = w8a8_accumulate(xq, x_scales, qweight, group)
    out *= scales[None, :]
    return _bias(out, bias, "linear_w8a8")
