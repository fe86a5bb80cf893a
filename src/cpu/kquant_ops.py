"""Products and embedding lookups of K-quant weights (Q4_K, Q5_K, Q6_K) on the CPU.

Checked wrappers of :mod:`kvserve.cpu.kquant_kernels`: ``y = x @ W.T (+
bias)`` (PyTorch ``nn.Linear``) for a ``KQuantWeight`` ``W``, or for a
``StackedWeight`` of them (a fused projection whose parts are K-quants of
different types, or blocks of another kind), with ``x`` quantized once to
Q8_K (llama.cpp's ``ggml_vec_dot_q*_K_q8_K`` scheme, at every row count:
prefill included). Products of at least ``PARALLEL_MIN_MACS`` multiply-adds
run on Numba's threads under ``PARALLEL_REGION``, in whole panels of 16
channels. The embedding dequantizes the looked-up rows from the GGUF's own
super-blocks (``KQuantWeight.raw``, mapped: only the rows read are touched).

On a CPU without AVX2 the kernels take the generic four-byte dot product
(``panel_kernels``): correct, several times slower.
"""

from __future__ import annotations

import numba
import numpy as np

from kvserve.cpu import kquant_kernels as kk
from kvserve.cpu.parallel import PARALLEL_REGION, check_array, parallel_chunks
from kvserve.model.ggml_blocks import KQuantWeight, StackedWeight


#: Fewest rows whose Q8_K quantization runs on Numba's threads (a prefill
#: chunk, a large decode batch).
PARALLEL_QUANTIZE_ROWS = 16


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(xq int8[M, K], xd float32[M, K / 256], bsums int32[M, K / 16])``:
    Q8_K of C-contiguous float32[M, K] ``x`` (``kquant_kernels.quantize_q8_k``;
    from ``PARALLEL_QUANTIZE_ROWS`` rows on Numba's threads).
    Raises ValueError for another dtype or layout, or K not a multiple of 256."""
    check_array("x", x, np.float32, 2)
    m, k = x.shape
    if k % kk.QK_K:
        raise ValueError(f"x: K = {k} is not a multiple of {kk.QK_K}")
    xq = np.empty((m, k), np.int8)
    xd = np.empty((m, k // kk.QK_K), np.float32)
    bsums = np.empty((m, k // 16), np.int32)
    threads = numba.get_num_threads()
    if m >= PARALLEL_QUANTIZE_ROWS and threads > 1:
        with PARALLEL_REGION:
            kk.quantize_q8_k_parallel(x, xq, xd, bsums, threads)
    else:
        kk.quantize_q8_k(x, xq, xd, bsums)
    return xq, xd, bsums


def _product(q8: tuple, w: KQuantWeight, num_threads: int | None) -> np.ndarray:
    """float32[M, N] = Q8_K activations ``q8`` times ``w``'s panels."""
    xq, xd, bsums = q8
    if w.codes is None:
        raise ValueError(f"a {w.ggml_type} table loaded as an embedding only has no panels")
    groups = w.codes.shape[0]
    width = groups * kk.KLANES
    out = np.empty((xq.shape[0], width), np.float32)
    kind = kk.KIND_OF[w.ggml_type]
    chunks = min(parallel_chunks(xq.shape, width, num_threads), groups)
    if chunks > 1:
        with PARALLEL_REGION:
            kk.kquant_parallel(xq, xd, bsums, w.codes, w.scales, w.mins, w.dd, out, kind, chunks)
    else:
        kk.kquant_range(xq, xd, bsums, w.codes, w.scales, w.mins, w.dd, out, 0, width, kind,
                        kk.DOT_FAST)
    return out if width == w.n else np.ascontiguousarray(out[:, :w.n])


def linear_kquant(x: np.ndarray, w: KQuantWeight | StackedWeight, bias: np.ndarray | None,
                  num_threads: int | None, other=None) -> np.ndarray:
    """``x @ W.T (+ bias)`` for a K-quant weight or a stack of weights.

    Args:
        x: float32[M, K], C-contiguous.
        w: a ``KQuantWeight`` [N, K] or a ``StackedWeight`` whose parts are
            ``KQuantWeight`` s or any weight ``other`` multiplies.
        bias: float32[N] or None.
        num_threads: Numba threads for the call (None: the current setting).
        other: ``(x, part) -> float32[M, N_i]`` for a part that is not a
            K-quant (the caller's ``linear``).

    Returns:
        A new float32[M, N].

    Raises:
        ValueError: a wrong dtype, layout or width of ``x`` (named), K not a
            multiple of 256, or a table without panels.
    """
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x: K = {x.shape[1]}, but the weight is {w.shape}")
    parts = w.parts if isinstance(w, StackedWeight) else (w,)
    q8 = None
    outs = []
    for part in parts:
        if isinstance(part, KQuantWeight):
            q8 = q8 or quantize_activations(x)
            outs.append(_product(q8, part, num_threads))
        else:
            outs.append(other(x, part))
    out = outs[0] if len(outs) == 1 else np.concatenate(outs, axis=1)
    if bias is not None:
        out += bias
    return out


def scales_of(raw: np.ndarray, ggml_type: str) -> tuple[np.ndarray, np.ndarray]:
    """``(d, dmin)`` float32[R, nsb] of super-blocks ``raw`` uint8[R, nsb,
    bytes] (float16 in the file; Q6_K has no dmin: zeros)."""
    if ggml_type == "Q6_K":
        d = np.ascontiguousarray(raw[:, :, 208:210]).view(np.float16)[..., 0]
        return d.astype(np.float32), np.zeros(d.shape, np.float32)
    both = np.ascontiguousarray(raw[:, :, 0:4]).view(np.float16)
    return both[..., 0].astype(np.float32), both[..., 1].astype(np.float32)


def dequantize_kquant_rows(w: KQuantWeight, rows: np.ndarray) -> np.ndarray:
    """float32[len(rows), K]: rows ``rows`` (int ids in [0, N)) of ``w``'s values,
    from its GGUF super-blocks (``w.raw``). Raises ValueError without them."""
    if w.raw is None:
        raise ValueError(f"this {w.ggml_type} weight keeps no GGUF blocks to read rows from")
    raw = np.ascontiguousarray(w.raw[rows])
    d, dmin = scales_of(raw, w.ggml_type)
    out = np.empty((len(rows), w.k), np.float32)
    kk.dequantize_rows(raw, d, dmin, kk.KIND_OF[w.ggml_type], out)
    return out


def embedding_kquant(token_ids: np.ndarray, table: KQuantWeight) -> np.ndarray:
    """float32[T, K]: the rows of ``token_ids`` (int64[T], in [0, N); the
    caller checks the range), dequantized."""
    return dequantize_kquant_rows(table, np.asarray(token_ids, np.int64))
