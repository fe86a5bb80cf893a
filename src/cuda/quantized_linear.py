"""The quantized matmuls of :class:`kvserve.cuda.ops.CudaOps`: int8
weight-only, W8A8 and ggml blocks (``--quantization q4``), on the kernels of
:mod:`kvserve.cuda.gemv_kernels` (and W8A8's activation quantization,
``kernels.quantize_groups_kernel``); a block table's embedding rows too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvserve.cuda import gemv_kernels, kernels
from kvserve.cuda.arrays import describe
from kvserve.model.ggml_blocks import QK, BlockQuantizedWeight


def _block_min(weight: BlockQuantizedWeight) -> Any:
    """The ``m`` argument of a block kernel: Q4's minimums, or for Q8_0 (none)
    its ``d`` again, which the Q8 kernels ignore."""
    return weight.m if weight.m is not None else weight.d


class QuantizedLinearOps:
    """:class:`kvserve.cuda.ops.CudaOps`' methods for quantized weights (a
    mixin: it uses ``CudaOps``' array module ``xp``, ``dtype``,
    ``max_threads``, ``simulator`` and its checking and launching methods
    ``_float``, ``_index``, ``_check_range``, ``_launch``, ``_threads``,
    ``_matmul``)."""

    def linear_int8(self, x: Any, weight_q: Any, scales: Any, bias: Any | None = None) -> Any:
        """Weight-only int8 matmul: ``(x @ weight_q.T) * scales (+ bias)``.

        x: C-contiguous float16/float32 [T, in]; weight_q: C-contiguous
        int8 [out, in]; scales: float32[out] (per output channel); bias:
        float16/float32[out] or None.  Returns a new [T, out] array of x's
        dtype.  The int8 weights enter as exact float32 integers, products
        are summed in float32 and each sum is scaled once at the end.  T <=
        ``kernels.GEMV_MAX_ROWS`` with ``in`` a multiple of 4 takes the warp
        GEMV (``gemv_kernels.int8_gemv_kernel``: the weight read as int32
        words), other products the shared-memory tiled kernel.  Raises
        ValueError on a bad array or a shape mismatch.
        """
        x, bias = self._int8_operands("linear_int8", x, weight_q, scales, bias)
        n_out = weight_q.shape[0]
        T, K = x.shape
        out = self.xp.empty((T, n_out), x.dtype)
        if T <= kernels.GEMV_MAX_ROWS and K % 4 == 0:
            self._launch_gemv(gemv_kernels.int8_gemv_kernel, K // 4, n_out,
                              x, weight_q.view(np.int32), scales, scales, bias, out)
        else:
            tile = self._matmul_tile()
            grid = (-(-n_out // tile), -(-T // tile))
            self._launch(gemv_kernels.int8_matmul_tiled_kernel, grid, (tile, tile),
                         x, weight_q, scales, bias, out)
        return out

    def linear_w8a8(self, x: Any, weight_q: Any, scales: Any, bias: Any | None = None) -> Any:
        """W8A8 matmul: ``x`` quantized to int8 per token and group of input
        channels, exact int32 products with ``weight_q``, both scales applied.

        SmoothQuant's dynamic per-token activations with per-channel int8
        weights (Xiao et al. 2023), with one activation scale per group of
        ``kernels.W8A8_GROUP`` consecutive input channels (K gets one group
        per row when the group does not divide it), as ``kvserve.cpu.int8``:
        ``x_scales[t, g] = max|x[t, group g]| / 127`` (1 for a zero group),
        ``xq = clip(rint(x / x_scales), -127, 127)``, and
        ``y[t, n] = scales[n] * sum_g x_scales[t, g] * acc[t, n, g] (+ bias[n])``
        with ``acc`` the exact int32 sum over group g of ``xq * weight_q``
        (exact in float32 below 2**24: a group of 64 is at most 64 * 127**2),
        the groups summed in float32.

        x: C-contiguous float16/float32 [T, in]; weight_q: C-contiguous
        int8 [out, in]; scales: float32[out] (per output channel); bias:
        float16/float32[out] or None.  Returns a new [T, out] array of x's
        dtype.  One kernel quantizes x (grid: rows x groups); then T <=
        ``kernels.GEMV_MAX_ROWS`` with ``in`` a multiple of 4 takes the warp
        GEMV (``gemv_kernels.w8a8_gemv_kernel``: codes and weights read as
        int32 words, one lane per group), other products the shared-memory
        tiled kernel.  Raises ValueError on a bad array or a shape mismatch.
        """
        x, bias = self._int8_operands("linear_w8a8", x, weight_q, scales, bias)
        (T, K), n_out = x.shape, weight_q.shape[0]
        group = kernels.W8A8_GROUP if K % kernels.W8A8_GROUP == 0 else K
        n_groups = K // group
        xq = self.xp.empty((T, K), np.int8)
        x_scales = self.xp.empty((T, n_groups), np.float32)
        self._launch(kernels.quantize_groups_kernel, (T, n_groups), (self._threads(group),),
                     x, group, xq, x_scales)
        out = self.xp.empty((T, n_out), x.dtype)
        if T <= kernels.GEMV_MAX_ROWS and K % 4 == 0:
            self._launch_gemv(gemv_kernels.w8a8_gemv_kernel, n_groups, n_out,
                              xq.view(np.int32), x_scales, group // 4,
                              weight_q.view(np.int32), scales, bias, out)
        else:
            tile = self._matmul_tile()  # a power of two <= 16: divides W8A8_GROUP
            grid = (-(-n_out // tile), -(-T // tile))
            self._launch(gemv_kernels.w8a8_matmul_tiled_kernel, grid, (tile, tile),
                         xq, x_scales, group, weight_q, scales, bias, out)
        return out

    def _int8_operands(self, what: str, x: Any, weight_q: Any, scales: Any,
                       bias: Any | None) -> tuple[Any, Any]:
        """Check the operands of an int8 matmul (see :meth:`linear_int8`);
        returns ``(x, bias)``, a None bias as zeros.  Raises ValueError
        naming ``what`` and the argument."""
        x = self._float(x, f"{what}: x", "[T, in]", 2)
        if (not isinstance(weight_q, self.xp.ndarray) or weight_q.dtype != np.int8
                or weight_q.ndim != 2 or not weight_q.flags.c_contiguous
                or weight_q.shape[1] != x.shape[1]):
            raise ValueError(f"{what}: weight_q must be a C-contiguous [out, {x.shape[1]}] "
                             f"int8 {self.xp.__name__} array, got {describe(weight_q)}")
        n_out = weight_q.shape[0]
        self._float(scales, f"{what}: scales", f"[{n_out}]", 1, dtype=np.float32)
        if scales.shape != (n_out,):
            raise ValueError(f"{what}: scales shape {scales.shape}, expected ({n_out},)")
        return x, self._bias(what, bias, n_out)

    def _bias(self, what: str, bias: Any | None, n_out: int) -> Any:
        """A matmul kernel's bias: checked float16/float32[n_out] (the backend
        dtype, as the model stores it, or float32), or zeros for None."""
        if bias is None:
            return self.xp.zeros(n_out, np.float32)
        self._float(bias, f"{what}: bias", f"[{n_out}]", 1)
        if bias.shape != (n_out,):
            raise ValueError(f"{what}: bias shape {bias.shape}, expected ({n_out},)")
        return bias

    def _launch_gemv(self, kernel: Any, work: int, n_out: int, *args: Any) -> None:
        """Launch a warp GEMV of :mod:`kvserve.cuda.gemv_kernels` over ``n_out``
        output channels of ``work`` words (or groups) each: grid
        (ceil(n_out / rows),), block (lanes, rows) of ``gemv_kernels.gemv_block``."""
        lanes, rows = gemv_kernels.gemv_block(work, n_out, self.max_threads, self.simulator)
        self._launch(kernel, (-(-n_out // rows),), (lanes, rows), *args)

    def linear_q4(self, x: Any, weight: BlockQuantizedWeight, bias: Any | None = None) -> Any:
        """``x @ W.T (+ bias)`` for a weight in ggml blocks (``--quantization q4``).

        x: C-contiguous float16/float32 [T, in]; weight: a
        ``BlockQuantizedWeight`` [out, in] of backend arrays, as
        ``quantize_weight(w, "q4", to_device)`` gives it: kind ``q4`` (Q4_0 /
        Q4_1: codes uint8[out, in / 2], ``d`` and ``m`` float32[out, in / 32])
        or ``q8`` (Q8_0: codes int8[out, in], ``d``); bias: float16/float32
        [out] or None.  Returns a new [T, out] array of x's dtype: ``x @
        ggml_blocks.dequantize(W).T`` up to float32 summation order.

        T <= ``kernels.GEMV_MAX_ROWS`` (decode) takes the warp GEMV
        (``gemv_kernels.q4_gemv_kernel`` / ``q8_gemv_kernel``): the codes
        read once as int32 words, dequantized in registers, float32 sums.
        More rows (prefill chunks) dequantize W to x's dtype in panels of
        ``gemv_kernels.DEQUANT_PANEL_ELEMS`` values (``q4_rows_kernel`` /
        ``q8_rows_kernel``) and multiply each with ``xp.matmul`` (cuBLAS,
        float16 tensor cores on a GPU): T rows cost 2 T N K flops on N K
        weights, so past a few rows the product is compute-bound and
        cuBLAS's tiles win, while the dequantization (one read of the blocks,
        one write and one read of the panel) is paid once for all T rows.
        Panels bound the scratch (64 MiB at float32) where a cache of
        dequantized weights would undo q4's memory saving.  For float16 x a
        panel rounds each weight to float16 (2**-11 relative).

        Raises ValueError on a bad array or a shape mismatch.
        """
        x = self._float(x, "linear_q4: x", "[T, in]", 2)
        words = self._block_words("linear_q4", weight)
        (n_out, K), T = weight.shape, x.shape[0]
        if x.shape[1] != K:
            raise ValueError(f"linear_q4: x {x.shape} does not match the weight [{n_out}, {K}]")
        checked_bias = self._bias("linear_q4", bias, n_out)
        out = self.xp.empty((T, n_out), x.dtype)
        if T > kernels.GEMV_MAX_ROWS:
            step = max(1, gemv_kernels.DEQUANT_PANEL_ELEMS // K)
            for lo in range(0, n_out, step):
                rows = self.xp.arange(lo, min(lo + step, n_out), dtype=np.int64)
                panel = self._dequantize_rows(weight, rows, x.dtype)
                out[:, lo:lo + step] = self._matmul(x, panel)
            if bias is not None:
                out += checked_bias
            return out
        gemv, _ = gemv_kernels.BLOCK_KERNELS[weight.kind]
        self._launch_gemv(gemv, words.shape[1], n_out, x, words, weight.d, _block_min(weight),
                          checked_bias, out)
        return out

    def _block_words(self, what: str, weight: Any) -> Any:
        """Check a ``BlockQuantizedWeight`` of backend arrays (see
        :meth:`linear_q4`); returns its codes viewed as int32 words
        ([out, in / 8] for q4, [out, in / 4] for q8: ``in`` is a multiple
        of 32).  Raises ValueError naming ``what`` and the array."""
        if not isinstance(weight, BlockQuantizedWeight) or weight.kind not in ("q4", "q8"):
            raise ValueError(f"{what}: weight must be a q4 or q8 BlockQuantizedWeight, "
                             f"got {type(weight).__name__}")
        d = weight.d
        if not isinstance(d, self.xp.ndarray) or d.ndim != 2:
            raise ValueError(f"{what}: weight.d must be a [out, in / {QK}] {self.xp.__name__} "
                             f"array, got {describe(d)}")
        n, blocks = d.shape
        expected = {"d": (d, np.float32, blocks)}
        if weight.kind == "q4":
            expected.update(qs=(weight.qs, np.uint8, blocks * QK // 2),
                            m=(weight.m, np.float32, blocks))
        else:
            expected.update(qs=(weight.qs, np.int8, blocks * QK))
        for name, (a, dtype, width) in expected.items():
            if (not isinstance(a, self.xp.ndarray) or a.dtype != dtype or a.shape != (n, width)
                    or not a.flags.c_contiguous):
                raise ValueError(f"{what}: weight.{name} must be a C-contiguous [{n}, {width}] "
                                 f"{np.dtype(dtype).name} {self.xp.__name__} array, "
                                 f"got {describe(a)}")
        return weight.qs.view(np.int32)

    def _dequantize_rows(self, weight: BlockQuantizedWeight, rows: Any, dtype: Any) -> Any:
        """New [len(rows), in] array of ``dtype``: rows ``rows`` (int64, in range)
        of a checked block weight, dequantized (``q4_rows_kernel`` /
        ``q8_rows_kernel``, launched as the GEMVs over len(rows) rows)."""
        words = weight.qs.view(np.int32)
        out = self.xp.empty((rows.shape[0], weight.shape[1]), dtype)
        _, gather = gemv_kernels.BLOCK_KERNELS[weight.kind]
        self._launch_gemv(gather, words.shape[1], rows.shape[0], rows, words, weight.d,
                          _block_min(weight), out)
        return out

    def _embedding_blocks(self, token_ids: Any, table: BlockQuantizedWeight) -> Any:
        """:meth:`embedding` of a block table: the rows dequantized in the backend dtype."""
        self._block_words("embedding", table)
        ids = self._index(token_ids, "embedding: token_ids", 1, np.int64)
        self._check_range(ids, table.shape[0], "embedding: token id")
        return self._dequantize_rows(table, ids, self.dtype)

    def _matmul_tile(self) -> int:
        """Edge of the tiled matmul's square block: the largest power of two
        with edge**2 <= max_threads, at most ``kernels.MATMUL_TILE``."""
        tile = 1
        while tile * 2 <= kernels.MATMUL_TILE and (tile * 2) ** 2 <= self.max_threads:
            tile *= 2
        return tile
