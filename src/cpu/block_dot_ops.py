"""Decode products of ggml block weights with Q8 activations (llama.cpp's CPU scheme).

Checked wrapper of :mod:`kvserve.cpu.block_dot_kernels`: ``y = x @ W.T (+ bias)``
(PyTorch ``nn.Linear``) for a ``BlockQuantizedWeight`` ``W`` (Q4_0, Q4_1 or
Q8_0 blocks), where ``x`` is first quantized per block of 32 input channels
to int8 codes and a float32 scale (llama.cpp's ``block_q8_0`` /
``block_q8_1``, ``ggml-quants.c`` ``quantize_row_q8_0`` /
``quantize_row_q8_1``), and each weight block's integer dot product with
the codes is scaled by ``d_w * d_x`` (``ggml_vec_dot_q4_0_q8_0``,
``ggml_vec_dot_q4_1_q8_1``, ``ggml_vec_dot_q8_0_q8_0``). Unlike
``kvserve.cpu.block_ops.linear_blocks`` the result is not dequantize-then-
matmul: the activation codes carry a relative error of up to ``1 / 254`` of
each block's largest magnitude (see ``tests/cpu/test_block_dot.py``).

On a CPU with AVX2 or AVX512-VNNI a q4 weight (N a multiple of
``panel_kernels.LANES``; a Q8_0 one with VNNI) takes the panels of
``kvserve.cpu.panel_kernels`` for every row count,
prefill included, packed once per weight (:func:`panels_of`). Otherwise
every row count takes the per-channel kernels, which read each weight byte
once per ``ROW_TILE`` rows. Products of at least
``kvserve.cpu.parallel.PARALLEL_MIN_MACS`` multiply-adds run on Numba's
threads under ``PARALLEL_REGION``, smaller ones on the caller's thread.
``CpuOps.linear`` takes it for a weight whose ``activations`` is ``q8``
(``--quantization w4a8``) and at most ``Q8_MAX_ROWS`` rows, or when
:func:`uses_panels`; the fused decode step (``kvserve.cpu.decode_layer``)
calls the same kernels.
``tools/bench_block_dot.py`` measures it against the float kernels.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from kvserve.cpu import block_dot_kernels as bdk
from kvserve.cpu import panel_kernels as pk
from kvserve.cpu.block_ops import check_operands
from kvserve.cpu.parallel import PARALLEL_REGION, check_array, parallel_chunks
from kvserve.model.ggml_blocks import QK, BlockQuantizedWeight

#: Most rows of a product that takes Q8 activations (``w4a8``); larger ones
#: (prefill, big decode batches) keep float activations, where the integer
#: kernels stop paying: at 16 rows they measured 1.1-1.2x the float kernels,
#: at 32 rows 0.9-1.05x (docs/benchmarks/2026-12-02-block-dot.json).
Q8_MAX_ROWS = 16
#: Fewest rows of a product that take the panels of
#: ``kvserve.cpu.panel_kernels``: they win from one row, with AVX512-VNNI
#: (16 channels) and with AVX2 alone (8). With VNNI, a layer of the default
#: model (its four products, 2 threads, Zen 5): 0.048 ms against 0.083 for
#: the per-row kernels at 1 row, 0.155 against 0.641 at 16; 0.275 against
#: 1.065 ms for the float kernels at 32 rows, 3.54 against 29.2 (dequantize
#: + sgemm) at 512; the Q8_0 LM head 0.205 against 0.314 ms at 1 row, 2.50
#: against 10.3 (float) at 32 (``tools/bench_block_dot.py``,
#: docs/benchmarks/2026-12-03-vnni-panels.json). With AVX2 alone (the same
#: machine compiling for Zen 2, panels of 8): 0.056 against 0.085 ms at 1
#: row, 0.674 against 1.423 ms (float) at 32, 9.48 against 19.2 (per-row)
#: at 512 (docs/benchmarks/2026-12-03-avx2-panels.json).
PANEL_MIN_ROWS = 1


def uses_panels(w: BlockQuantizedWeight, rows: int) -> bool:
    """Whether a product of ``rows`` rows with ``w`` takes the panels of
    ``panel_kernels``: a CPU with their fast dot product (``HAS_PANELS``; for
    a Q8_0 weight AVX512-VNNI, ``HAS_Q8_PANELS``), a weight whose N is a
    multiple of ``LANES``, and at least ``PANEL_MIN_ROWS`` rows."""
    fast = pk.HAS_Q8_PANELS if w.kind == "q8" else pk.HAS_PANELS
    return fast and rows >= PANEL_MIN_ROWS and w.shape[0] % pk.LANES == 0


#: Packed panels of the weights that took them, by ``id(w.qs)`` (dropped
#: with the codes array).
_PANELS: dict[int, tuple[np.ndarray, np.ndarray]] = {}
_PANELS_LOCK = threading.Lock()


def panels_of(w: BlockQuantizedWeight) -> tuple[np.ndarray, np.ndarray]:
    """``(packed uint8[N / L, K / 32 * 16 L], dpm float32[N / L, K / 32 * 2 L])``
    (L = ``panel_kernels.LANES``): the q4 weight ``w`` packed for
    ``panel_kernels`` (:func:`panel_kernels.pack_panels`; a Q8_0 one: packed
    ``[N / L, K / 32 * 32 L]``), built on first use and kept while ``w.qs``
    lives: as many bytes again as the codes, plus twice the scales. N must
    be a multiple of L."""
    key = id(w.qs)
    found = _PANELS.get(key)
    if found is not None:
        return found
    with _PANELS_LOCK:
        if key not in _PANELS:
            n, k = w.shape
            width = k // QK * pk.PANEL_BLOCK_BYTES * (2 if w.kind == "q8" else 1)
            packed = np.empty((n // pk.LANES, width), np.uint8)
            dpm = np.empty((n // pk.LANES, k // QK * 2 * pk.LANES), np.float32)
            pk.pack_panels(w.qs, w.d, w.d if w.m is None else w.m, packed, dpm)
            _PANELS[key] = (packed, dpm)
            weakref.finalize(w.qs, _PANELS.pop, key, None)
        return _PANELS[key]


def quantize_activations_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(xq int8[M, K], xd float32[M, K / 32], xsum float32[M, K / 32])`` of
    C-contiguous float32[M, K] ``x`` (K a multiple of 32), per
    :func:`kvserve.cpu.block_dot_kernels.quantize_q8_blocks`.

    Raises ValueError (naming ``x``) for another dtype, rank, layout or K.
    """
    check_array("x", x, np.float32, 2)
    if x.shape[1] % QK:
        raise ValueError(f"x: K = {x.shape[1]} is not a multiple of {QK}")
    m, k = x.shape
    xq = np.empty((m, k), dtype=np.int8)
    xd = np.empty((m, k // QK), dtype=np.float32)
    xsum = np.empty((m, k // QK), dtype=np.float32)
    bdk.quantize_q8_blocks(x, xq, xd, xsum)
    return xq, xd, xsum


def linear_blocks_q8(x: np.ndarray, w: BlockQuantizedWeight, bias: np.ndarray | None = None,
                     num_threads: int | None = None) -> np.ndarray:
    """``x @ W.T (+ bias)`` for a block weight, with ``x`` quantized to Q8 blocks.

    Args:
        x: float32[M, K], C-contiguous.
        w: ``BlockQuantizedWeight`` ``[N, K]`` of NumPy arrays
            (``block_ops.check_weight``). ``ggml_type`` ``Q4_0`` takes the
            Q4_0 kernel (offset 8 kept in the integers); any other q4 weight
            (Q4_1, or fused ``Q4_0+Q4_1``) the Q4_1 kernel with its ``m``.
        bias: float32[N] or None.
        num_threads: Numba threads for this call (None: the current setting).

    Returns:
        A new float32[M, N].

    Raises:
        ValueError: naming the argument, for a wrong dtype, shape or layout,
            or ``num_threads`` out of range.
    """
    check_operands(x, w, bias)
    n = w.shape[0]
    chunks = parallel_chunks(x.shape, n, num_threads)
    xq, xd, xsum = quantize_activations_q8(x)
    out = np.empty((x.shape[0], n), dtype=np.float32)
    if chunks:
        with PARALLEL_REGION:
            _run(xq, xd, xsum, w, out, chunks)
    else:
        _run(xq, xd, xsum, w, out, 0)
    if bias is not None:
        out += bias
    return out


def _run(xq, xd, xsum, w: BlockQuantizedWeight, out: np.ndarray, chunks: int) -> None:
    n = w.shape[0]
    if uses_panels(w, xq.shape[0]):
        packed, dpm = panels_of(w)
        if chunks:
            pk.panel_q8_parallel(xq, xd, xsum, packed, dpm, out, chunks)
        else:
            pk.panel_q8_range(xq, xd, xsum, packed, dpm, out, 0, n, pk.DOT_FAST)
    elif w.kind == "q8":
        if chunks:
            bdk.q8_0_q8_gemv_parallel(xq, xd, w.qs, w.d, out, chunks)
        else:
            bdk.q8_0_q8_gemv_range(xq, xd, w.qs, w.d, out, 0, n)
    elif w.ggml_type == "Q4_0":
        if chunks:
            bdk.q4_0_q8_gemv_parallel(xq, xd, w.qs, w.d, out, chunks)
        else:
            bdk.q4_0_q8_gemv_range(xq, xd, w.qs, w.d, out, 0, n)
    elif chunks:
        bdk.q4_1_q8_gemv_parallel(xq, xd, xsum, w.qs, w.d, w.m, out, chunks)
    else:
        bdk.q4_1_q8_gemv_range(xq, xd, xsum, w.qs, w.d, w.m, out, 0, n)
