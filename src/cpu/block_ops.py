"""Linear layers and embedding lookups on ggml block weights (``--quantization q4``).

Checked wrappers of :mod:`kvserve.cpu.block_kernels`. ``y = x @ W.T (+ bias)``
(PyTorch ``nn.Linear``) for a ``BlockQuantizedWeight`` ``W`` with float32
activations: equal to ``x @ ggml_blocks.dequantize(W).T`` up to float32
summation order.

Path choice: at most ``GEMV_MAX_ROWS`` rows (decode batches and prefill
chunks up to the CPU's default step budget) take the panel kernel, which
reads each weight byte once per call; more rows dequantize
panels of ``PREFILL_PANEL_FLOATS / K`` channels (4 MiB of float32, in L2/L3)
and multiply each with BLAS sgemm. Products of at least
``kvserve.cpu.parallel.PARALLEL_MIN_MACS`` multiply-adds run on Numba's threads
under ``PARALLEL_REGION``, smaller ones on the caller's thread.
"""

from __future__ import annotations

import numpy as np

from kvserve.cpu import block_kernels as bk
from kvserve.cpu.parallel import PARALLEL_REGION, check_array, parallel_chunks
from kvserve.model.ggml_blocks import QK, BlockQuantizedWeight

#: Rows up to which the panel kernel beats dequantize + sgemm. Measured on
#: the default model's Q4_1 layers with 2 threads (OpenMP layer): at 32 rows
#: 584 against 1256 us (3072 x 576), at 128 rows 1829 against 3013 us; at
#: 256 rows the two are within 10% either way, at 512 sgemm wins.
GEMV_MAX_ROWS = 256
#: Floats per dequantized panel of the prefill path.
PREFILL_PANEL_FLOATS = 1 << 20


def check_weight(w: BlockQuantizedWeight) -> None:
    """ValueError naming the bad array of a block weight (dtype, shape, layout)."""
    if not isinstance(w, BlockQuantizedWeight) or w.kind not in ("q4", "q8"):
        raise ValueError(f"w: expected a q4 or q8 BlockQuantizedWeight, got {w!r:.80}")
    check_array("w.d", w.d, np.float32, 2)
    n, blocks = w.d.shape
    if w.kind == "q4":
        check_array("w.qs", w.qs, np.uint8, 2)
        check_array("w.m", w.m, np.float32, 2)
        expected = {"w.qs": (n, blocks * QK // 2), "w.m": (n, blocks)}
    else:
        check_array("w.qs", w.qs, np.int8, 2)
        expected = {"w.qs": (n, blocks * QK)}
    for name, shape in expected.items():
        got = w.qs.shape if name == "w.qs" else w.m.shape
        if got != shape:
            raise ValueError(f"{name}: shape {got}, expected {shape} for d {w.d.shape}")


def check_operands(x: np.ndarray, w: BlockQuantizedWeight, bias: np.ndarray | None) -> None:
    """ValueError naming the bad argument of ``x @ W.T (+ bias)``: the weight
    (``check_weight``), x float32[M, K] C-contiguous with the weight's K,
    bias float32[N] or None."""
    check_weight(w)
    check_array("x", x, np.float32, 2)
    n, k = w.shape
    if x.shape[1] != k:
        raise ValueError(f"x: {x.shape} does not match the weight's K = {k}")
    if bias is not None:
        check_array("bias", bias, np.float32, 1)
        if bias.shape != (n,):
            raise ValueError(f"bias: shape {bias.shape}, expected ({n},)")


def linear_blocks(x: np.ndarray, w: BlockQuantizedWeight, bias: np.ndarray | None = None,
                  num_threads: int | None = None, per_row: bool = False) -> np.ndarray:
    """``x @ W.T (+ bias)`` for a block weight.

    Args:
        x: float32[M, K], C-contiguous.
        w: ``BlockQuantizedWeight`` ``[N, K]`` of NumPy arrays (``check_weight``).
        bias: float32[N] or None.
        num_threads: Numba threads for this call (None: the current setting).
        per_row: the decode kernels for any row count, so that a row's result
            does not depend on the others (``CpuOps(batch_invariant=True)``).

    Returns:
        A new float32[M, N].

    Raises:
        ValueError: naming the argument, for a wrong dtype, shape or layout.
    """
    check_operands(x, w, bias)
    n = w.shape[0]
    chunks = parallel_chunks(x.shape, n, num_threads)
    if x.shape[0] <= GEMV_MAX_ROWS or per_row:
        out = _gemv(x, w, chunks)
    else:
        out = _dequantized_matmul(x, w, chunks)
    if bias is not None:
        out += bias
    return out


def _gemv(x: np.ndarray, w: BlockQuantizedWeight, chunks: int) -> np.ndarray:
    out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    if chunks:
        with PARALLEL_REGION:
            if w.kind == "q4":
                bk.q4_gemv_parallel(x, w.qs, w.d, w.m, out, chunks)
            else:
                bk.q8_gemv_parallel(x, w.qs, w.d, out, chunks)
    elif w.kind == "q4":
        bk.q4_gemv_range(x, w.qs, w.d, w.m, out, 0, w.shape[0])
    else:
        bk.q8_gemv_range(x, w.qs, w.d, out, 0, w.shape[0])
    return out


def _dequantized_matmul(x: np.ndarray, w: BlockQuantizedWeight, chunks: int) -> np.ndarray:
    n, k = w.shape
    out = np.empty((x.shape[0], n), dtype=np.float32)
    step = max(bk.PANEL, PREFILL_PANEL_FLOATS // k // bk.PANEL * bk.PANEL)
    panel = np.empty((min(step, n), k), dtype=np.float32)
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        dequantize_rows_into(w, lo, hi, panel, chunks)
        np.matmul(x, panel[: hi - lo].T, out=out[:, lo:hi])
    return out


def dequantize_rows_into(w: BlockQuantizedWeight, lo: int, hi: int, out: np.ndarray,
                         chunks: int = 0) -> None:
    """out[: hi - lo] = float32 rows [lo, hi) of ``w`` (the kernel's dequantization)."""
    if chunks:
        with PARALLEL_REGION:
            if w.kind == "q4":
                bk.dequantize_q4_parallel(w.qs, w.d, w.m, out, lo, hi, chunks)
            else:
                bk.dequantize_q8_parallel(w.qs, w.d, out, lo, hi, chunks)
    elif w.kind == "q4":
        bk.dequantize_q4_range(w.qs, w.d, w.m, out, lo, hi)
    else:
        bk.dequantize_q8_range(w.qs, w.d, out, lo, hi)


def embedding_blocks(token_ids: np.ndarray, w: BlockQuantizedWeight) -> np.ndarray:
    """float32[T, K] rows ``token_ids`` (int64[T], each in [0, N)) of a block
    table, dequantized. Raises ValueError for a bad weight or id."""
    check_weight(w)
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.ndim != 1 or (ids.size and (int(ids.min()) < 0 or int(ids.max()) >= w.shape[0])):
        raise ValueError(f"embedding: token ids must be 1-D in [0, {w.shape[0]})")
    rows = w.map(lambda a: np.ascontiguousarray(a[ids]))
    out = np.empty((ids.size, w.shape[1]), dtype=np.float32)
    dequantize_rows_into(rows, 0, ids.size, out)
    return out
