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

Single rows (fewer than ``DENSE_MIN_ROWS``) run the int32 kernel below.
Larger products (decode batches, prefill chunks) rescale the quantized
activations to float32 (``xq * x_scale``, one rounding per value) and run
the register-tiled int8 weight kernel of ``kvserve.cpu.quant_ops`` on them,
summing in float32: the int32 form's result up to float32 rounding, at
the tile kernel's speed (LLVM emits no VNNI ``vpdpbusd`` for the int32
form; see ``kvserve.cpu.quant_kernels``).

Mapping: output channels are split across Numba threads (``prange`` over n)
for products of at least ``parallel.PARALLEL_MIN_MACS`` multiply-adds,
smaller ones run on the caller's thread (a parallel region costs more);
each weight row is read once and dotted with every activation row while it
is in L1. The integer inner loop is exact in any order.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kvserve.cpu.parallel import PARALLEL_REGION, parallel_chunks
from kvserve.cpu.quant_ops import linear_int8

#: Largest magnitude of a symmetric int8 code.
INT8_MAX = 127
#: Input channels per activation scale of ``linear_w8a8`` (a K that it does
#: not divide gets one group per row).
GROUP = 64
#: From this many rows on, products take the quantized activations through
#: the int8 tile kernel. The int32 kernel re-reads each weight row for every
#: activation row and reduces across lanes once per group: measured on the
#: 3072 x 576 gate/up product (one thread busy elsewhere), 80 us at one row
#: against 37 us for the tile kernel, 622 against about 200 us at 8 rows.
#: It serves single-row products (one decode stream) only.
DENSE_MIN_ROWS = 2


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


@njit(nogil=True, cache=True)
def _w8a8_rows(xq, x_scales, qweight, group, acc_out, lo, hi):  # pragma: no cover - compiled
    """acc_out[m, n] = sum_g x_scales[m, g] * (exact int32 sum over group g of
    xq[m, k] * qweight[n, k]), for output channels n in [lo, hi)."""
    M, K = xq.shape
    for n in range(lo, hi):
        for m in range(M):
            total = np.float32(0.0)
            for g in range(K // group):
                acc = np.int32(0)
                base = g * group
                for k in range(group):
                    # int32(...) keeps the sum in int32 (Numba types int32 *
                    # int32 as int64, which LLVM then widens to 64-bit lanes);
                    # 2-D indexing, not a row view w = qweight[n]: indexing
                    # the view made LLVM gather it byte by byte (vpinsrb),
                    # 11x slower. This form: vpmovsxbw + vpmaddwd + vpaddd.
                    acc = np.int32(acc + np.int32(xq[m, base + k]) * np.int32(qweight[n, base + k]))
                total += np.float32(acc) * x_scales[m, g]
            acc_out[m, n] = total


@njit(nogil=True, cache=True, parallel=True)
def _w8a8_parallel(xq, x_scales, qweight, group, acc_out, n_chunks):  # pragma: no cover
    """:func:`_w8a8_rows` over all channels in ``n_chunks`` parallel ranges."""
    N = qweight.shape[0]
    for c in prange(n_chunks):
        _w8a8_rows(xq, x_scales, qweight, group, acc_out, c * N // n_chunks,
                   (c + 1) * N // n_chunks)


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
                    group: int, n_chunks: int = 0) -> np.ndarray:
    """float32[M, N]: per group the exact int32 product of the int8 operands,
    times the group's activation scale, summed over groups; on ``n_chunks``
    Numba threads (the caller holds ``parallel.PARALLEL_REGION``), or serially
    for 0."""
    out = np.empty((xq.shape[0], qweight.shape[0]), dtype=np.float32)
    if n_chunks:
        _w8a8_parallel(xq, x_scales, qweight, group, out, n_chunks)
    else:
        _w8a8_rows(xq, x_scales, qweight, group, out, 0, qweight.shape[0])
    return out


def linear_w8a8(x: np.ndarray, qweight: np.ndarray, scales: np.ndarray,
                bias: np.ndarray | None = None, num_threads: int | None = None) -> np.ndarray:
    """float32[M, N]: ``x`` quantized per token and group, int32 products
    with ``qweight`` per group, scaled by both scales (+ bias). Same
    arguments and errors as ``quant_ops.linear_int8``: x float32[M, K]
    C-contiguous, qweight int8[N, K], scales float32[N], bias float32[N] or
    None, ``num_threads`` Numba threads; ``ValueError`` naming the argument."""
    _check(x, qweight, scales, "linear_w8a8")
    group = group_size(x.shape[1])
    xq, x_scales = quantize_activations(x, group)
    if x.shape[0] >= DENSE_MIN_ROWS:
        # The quantized activations, rescaled to float32, through the int8
        # weight-only tile kernel (see the module docstring).
        x_deq = xq.astype(np.float32) * np.repeat(x_scales, group, axis=1)
        return linear_int8(x_deq, qweight, scales, bias, num_threads)
    n_chunks = parallel_chunks(x.shape, qweight.shape[0], num_threads)
    if n_chunks:
        with PARALLEL_REGION:
            out = w8a8_accumulate(xq, x_scales, qweight, group, n_chunks)
    else:
        out = w8a8_accumulate(xq, x_scales, qweight, group)
    out *= scales[None, :]
    return _bias(out, bias, "linear_w8a8")
