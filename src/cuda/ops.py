"""CUDA backend: :class:`CudaOps`, the :class:`kvserve.model.ops.Ops` interface on
CuPy arrays and the Numba kernels of :mod:`kvserve.cuda.kernels`.

Arrays live in the array module :func:`array_module` returns: CuPy on a GPU,
NumPy under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, set before
Numba is first imported), where the same kernels run thread by thread in
Python; that is how ``tests/cuda`` run on machines without a GPU.  Kernels are
launched on the arrays directly (CuPy arrays reach Numba through
``__cuda_array_interface__``) on CuPy's current stream.  Dense float products
are ``xp.matmul`` (cuBLAS through CuPy); int8 weight-only, W8A8 and GGUF
block (``--quantization q4``) products are our kernels
(:mod:`kvserve.cuda.gemv_kernels`; :meth:`CudaOps.linear_int8`,
:meth:`CudaOps.linear_w8a8`, :meth:`CudaOps.linear_q4`).

Every wrapper checks its arguments before a launch (a kernel cannot raise on a
GPU and does no bounds checking): array type, shape, dtype, contiguity, and
index ranges (token ids, positions, slots, block ids, attention metadata).
The index checks read small integer arrays back to the host: one device
synchronisation each on a GPU.  Errors are ``ValueError`` naming the argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
from numba import config as numba_config
from numba import cuda

from kvserve.cuda import gemv_kernels, kernels
from kvserve.cuda.step import (PackedStep, StepGeometry, StepViews, attention_plan,
                               check_attention_metadata, check_step, group_name, pack_step)
from kvserve.model import kv_quant
from kvserve.model.ops import (DecodePath, QKNorm, build_rope_cache,
                               compose_rope_kv_attention)
from kvserve.model.ggml_blocks import QK, BlockQuantizedWeight
from kvserve.model.quantization import QuantizedWeight

__all__ = ["CudaOps", "array_module", "build_rope_cache",
           "check_attention_metadata"]

#: Keys per split-K partition of decode attention (vLLM paged_attention_v2's PARTITION_SIZE).
DEFAULT_PARTITION_SIZE = 512
#: A sequence with at least this many new tokens in a step takes the prefill
#: kernel; the others (decodes) the split-K decode kernels, one work item per token.
PREFILL_MIN_QUERIES = 2
#: Query rows per prefill tile (one thread each), at most.
PREFILL_TILE_Q = 64
WARP_SIZE = 32
#: Row kernels (norms, RoPE, SiLU / GELU, embedding, KV writes) give each thread
#: about this many elements of a row: a 576-wide hidden row gets 96 threads
#: on a GPU, a 64-wide one 8 threads under the simulator.
ROW_ELEMS_PER_THREAD = 8
#: Threads per block, at most, on a GPU.
GPU_MAX_THREADS = kernels.MAX_BLOCK_THREADS
#: Threads per block, at most, under the simulator: each CUDA thread is a
#: Python thread there, and a barrier costs milliseconds.  Small blocks also
#: make every strided loop of the kernels take several turns in the tests.
SIMULATOR_MAX_THREADS = 16

_KERNEL_FLOATS = (np.dtype(np.float16), np.dtype(np.float32))


@dataclass
class Counters:
    """What a backend did since ``reset``: Numba kernel launches
    (``launches``; cuBLAS calls through CuPy are not counted) and copies
    between host and device (``h2d``, ``d2h``; every one goes through
    :meth:`CudaOps.upload` or :meth:`CudaOps.download`)."""

    launches: int = 0
    h2d: int = 0
    d2h: int = 0

    def reset(self) -> None:
        self.launches = self.h2d = self.d2h = 0


def simulator_enabled() -> bool:
    """True when ``numba.cuda`` is Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``)."""
    return bool(numba_config.ENABLE_CUDASIM)


def array_module() -> ModuleType:
    """``cupy`` when it is importable, a CUDA device is present and Numba is not
    simulating; ``numpy`` otherwise (the simulator's kernels take NumPy arrays)."""
    if simulator_enabled():
        return np
    try:
        import cupy
    except ImportError:
        return np
    try:
        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else np
    except cupy.cuda.runtime.CUDARuntimeError:
        return np


def _block_min(weight: BlockQuantizedWeight) -> Any:
    """The ``m`` argument of a block kernel: Q4's minimums, or for Q8_0 (none)
    its ``d`` again, which the Q8 kernels ignore."""
    return weight.m if weight.m is not None else weight.d


def _check_window(window: Any, what: str) -> int:
    """An attention ``window`` as an int >= 0 (0: none). Raises ValueError
    naming ``what`` for a negative or non-integer one."""
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
        raise ValueError(f"{what}: window must be an int >= 0 (0: no window), got {window!r}")
    if window > np.iinfo(np.int32).max:
        raise ValueError(f"{what}: window {window} does not fit int32")
    return int(window)


def _keys_seen(max_context: int, window: int) -> int:
    """Most keys a decode query reads: its context, at most ``window`` (0: none).
    Sizes the split-K grid: ceil(keys / partition_size) partitions."""
    return min(max_context, window) if window else max_context


def _quantized(kv_cache: Any) -> bool:
    """Whether a checked KV cache is the int8 layout (``--kv-cache-dtype int8``)."""
    return kv_cache.dtype == np.int8


def _cache_head_dim(kv_cache: Any) -> int:
    """head_dim of a checked KV cache: its last axis, less the scale's 4
    bytes for an int8 one."""
    width = int(kv_cache.shape[4])
    return width - kv_quant.SCALE_BYTES if _quantized(kv_cache) else width


def _kv_scales(kv_cache: Any) -> Any:
    """The float32 view of a checked int8 KV cache, [num_blocks, 2,
    block_size, nkv, (hd + 4) / 4]: a vector's scale at ``hd // 4``
    (the kernels' second cache argument; no copy)."""
    return kv_cache.view(np.float32)


def _describe(a: Any) -> str:
    """``numpy.ndarray (3, 4) float64 non-contiguous`` (for error messages)."""
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        return type(a).__name__
    layout = "C-contiguous" if a.flags.c_contiguous else "non-contiguous"
    kind = f"{type(a).__module__.split('.')[0]}.{type(a).__name__}"
    return f"{kind} {tuple(a.shape)} {a.dtype} {layout}"


class CudaOps:
    """Numba CUDA implementation of :class:`kvserve.model.ops.Ops`.

    Args:
        dtype: float dtype of :meth:`to_device` and :meth:`allocate_kv_cache`:
            float32 (default) or float16.  Kernels accept either and
            accumulate in float32.
        partition_size: keys per split-K partition of decode attention, in
            [1, ``kernels.MAX_PARTITION_SIZE``].
        prefill_min_queries: a sequence with at least this many new tokens
            takes the prefill kernel; shorter ones the split-K decode kernels.
        max_threads: threads per block, at most (default: 256 on a GPU,
            :data:`SIMULATOR_MAX_THREADS` under the simulator).
        prefill_tile_q: query rows per prefill tile (one thread each), at most;
            rounded up to whole warps on a GPU.

    Raises:
        ValueError: an argument out of its range.
        RuntimeError: neither CuPy with a CUDA device nor the simulator.

    Not thread safe beyond what CuPy's per-thread current stream gives: call
    it from one thread (the worker).
    """

    name = "cuda"

    def __init__(self, dtype: Any = np.float32, partition_size: int = DEFAULT_PARTITION_SIZE,
                 prefill_min_queries: int = PREFILL_MIN_QUERIES, max_threads: int | None = None,
                 prefill_tile_q: int = PREFILL_TILE_Q) -> None:
        self.simulator = simulator_enabled()
        self.xp = array_module()
        self._cupy = None if self.xp is np else self.xp
        if not self.simulator and self._cupy is None:
            raise RuntimeError("CudaOps needs CuPy and a CUDA device, or Numba's simulator "
                               "(NUMBA_ENABLE_CUDASIM=1 before numba is imported)")
        self.dtype = np.dtype(dtype)
        if self.dtype not in _KERNEL_FLOATS:
            raise ValueError(f"CudaOps: dtype must be float32 or float16, got {self.dtype}")
        if not 1 <= partition_size <= kernels.MAX_PARTITION_SIZE:
            raise ValueError(f"CudaOps: partition_size must be in [1, "
                             f"{kernels.MAX_PARTITION_SIZE}], got {partition_size}")
        if prefill_min_queries < 1 or prefill_tile_q < 1:
            raise ValueError("CudaOps: prefill_min_queries and prefill_tile_q must be >= 1, "
                             f"got {prefill_min_queries} and {prefill_tile_q}")
        default = SIMULATOR_MAX_THREADS if self.simulator else GPU_MAX_THREADS
        self.max_threads = default if max_threads is None else int(max_threads)
        if not 1 <= self.max_threads <= kernels.MAX_BLOCK_THREADS:
            raise ValueError(f"CudaOps: max_threads must be in [1, {kernels.MAX_BLOCK_THREADS}], "
                             f"got {max_threads}")
        self.partition_size = int(partition_size)
        self.prefill_min_queries = int(prefill_min_queries)
        self.prefill_tile_q = int(prefill_tile_q)
        self.counters = Counters()
        if self._cupy is not None:
            # Every kernel runs on CuPy's current stream, so a launch need not
            # synchronize the stream of each CuPy array it is given (Numba's
            # default for the CUDA Array Interface, NUMBA_CUDA_ARRAY_INTERFACE_SYNC;
            # a synchronization is also illegal while a CUDA graph is captured).
            numba_config.CUDA_ARRAY_INTERFACE_SYNC = False
        #: The step being run (``prepare_step``): arrays inside its buffer
        #: were checked on the host, so the wrappers do not read them back.
        self._step: StepViews | None = None
        #: The fused decode kernels' 1-element "no q/k norm" weights, per dtype
        #: (made at the first eager step, before any graph is captured).
        self._no_norm: dict = {}

    def reset_counters(self) -> None:
        """Start counting launches and copies from zero (``counters``)."""
        self.counters.reset()

    # ------------------------------------------------------------------ #
    # launching and checking
    # ------------------------------------------------------------------ #

    def _threads(self, work: int, cap: int = kernels.MAX_BLOCK_THREADS) -> int:
        """Threads of a 1-D block for ``work`` parallel items, at most
        ``min(cap, max_threads)``: rounded up to whole warps on a GPU (idle
        lanes are free there), exact under the simulator."""
        limit = min(cap, self.max_threads)
        n = max(1, min(int(work), limit))
        if not self.simulator:
            n = min(-(-n // WARP_SIZE) * WARP_SIZE, limit)
        return n

    def _row_threads(self, n: int) -> int:
        """Threads of a row kernel over rows of ``n`` elements (see ROW_ELEMS_PER_THREAD)."""
        return self._threads(-(-n // ROW_ELEMS_PER_THREAD))

    def _launch(self, kernel: Any, grid: tuple[int, ...], block: tuple[int, ...],
                *args: Any) -> None:
        """``kernel[grid, block](*args)`` on CuPy's current stream (nothing for an empty grid)."""
        if min(grid) <= 0:
            return
        self.counters.launches += 1
        if self._cupy is None:
            kernel[grid, block](*args)
        else:
            stream = cuda.external_stream(self._cupy.cuda.get_current_stream().ptr)
            kernel[grid, block, stream](*args)

    def _host(self, a: Any) -> np.ndarray:
        """Host NumPy values of a small array (no copy under the simulator)."""
        return np.asarray(a) if self._cupy is None else self._cupy.asnumpy(a)

    def _float(self, a: Any, what: str, layout: str, ndim: int | tuple[int, ...],
               dtype: Any = None, contiguous: bool = True, inplace: bool = False) -> Any:
        """Check a float operand: an array of this backend with ``ndim`` (or one
        of ``ndim``) dimensions, float16 or float32 (exactly ``dtype`` when
        given), C-contiguous unless told, writeable if ``inplace``.  Returns
        it.  Raises ValueError naming ``what``."""
        dtypes = _KERNEL_FLOATS if dtype is None else (np.dtype(dtype),)
        ndims = ndim if isinstance(ndim, tuple) else (ndim,)
        ok = (isinstance(a, self.xp.ndarray) and a.ndim in ndims and a.dtype in dtypes
              and (a.flags.c_contiguous or not contiguous)
              and (not inplace or getattr(a.flags, "writeable", True)))
        if not ok:
            want = " or ".join(d.name for d in dtypes)
            prefix = ("writeable " if inplace else "") + ("C-contiguous " if contiguous else "")
            raise ValueError(f"{what} must be a {prefix}{layout} {want} "
                             f"{self.xp.__name__} array, got {_describe(a)}")
        return a

    def _index(self, a: Any, what: str, ndim: int, dtype: Any) -> Any:
        """An integer operand as a C-contiguous ``dtype`` array (copied only if
        needed).  Raises ValueError naming ``what``."""
        if not isinstance(a, self.xp.ndarray) or a.ndim != ndim or a.dtype.kind not in "iu":
            raise ValueError(f"{what} must be a {ndim}-D integer {self.xp.__name__} array, "
                             f"got {_describe(a)}")
        return self.xp.ascontiguousarray(a, dtype=dtype)

    def _check_range(self, a: Any, high: int, what: str) -> None:
        """Raise ValueError unless every entry of ``a`` is in [0, high).

        Reads ``a`` back to the host, except an array of the current step
        (``prepare_step`` checked it there, against the model's geometry)."""
        if self._checked(a):
            return
        if a.size and (int(a.min()) < 0 or int(a.max()) >= high):
            raise ValueError(f"{what} out of range [0, {high})")

    def _checked(self, a: Any) -> bool:
        """Whether ``a`` lies in the current step's buffer (checked on the host)."""
        return self._step is not None and self._step.owns(a, self._pointer)

    def _pointer(self, a: Any) -> int:
        """The device (or, simulated, host) address of ``a``'s first byte."""
        return a.data.ptr if self._cupy is not None else a.__array_interface__["data"][0]

    def _check_cache(self, kv_cache: Any, what: str) -> Any:
        """Check a KV cache: a writeable C-contiguous float16/float32
        [num_blocks, 2, block_size, nkv, hd] array, or an int8 one of
        [num_blocks, 2, block_size, nkv, hd + 4] with hd a positive multiple
        of 4 (``kvserve.model.kv_quant``; told apart by the dtype). Returns
        it; :func:`_cache_head_dim` gives its hd. Raises ValueError naming
        ``what``."""
        if isinstance(kv_cache, self.xp.ndarray) and kv_cache.dtype == np.int8:
            width = kv_cache.shape[-1] if kv_cache.ndim else 0
            if (kv_cache.ndim != 5 or not kv_cache.flags.c_contiguous
                    or not getattr(kv_cache.flags, "writeable", True)
                    or width <= kv_quant.SCALE_BYTES or width % 4):
                raise ValueError(f"{what}: an int8 kv_cache must be a writeable C-contiguous "
                                 "[num_blocks, 2, block_size, num_kv_heads, head_dim + 4] "
                                 f"{self.xp.__name__} array with head_dim a positive multiple "
                                 f"of 4, got {_describe(kv_cache)}")
        else:
            self._float(kv_cache, f"{what}: kv_cache",
                        "[num_blocks, 2, block_size, num_kv_heads, head_dim]", 5, inplace=True)
        if kv_cache.shape[1] != 2:
            raise ValueError(f"{what}: kv_cache axis 1 must be 2 (K, V), got {kv_cache.shape}")
        return kv_cache

    def _kv_args(self, cache: Any) -> tuple[Any, Any]:
        """An int8 kernel's two cache arguments: the checked int8 cache (its
        codes) and its float32 view (its scales, :func:`_kv_scales`), one
        memory. On a GPU, the arrays. Under the simulator, which copies each
        NumPy argument in and back out on its own (the view's copy-back would
        undo the codes written through the cache), both wrapped as simulator
        device arrays over the one buffer, written in place."""
        scales = _kv_scales(cache)
        if not self.simulator:
            return cache, scales
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(cache), FakeCUDAArray(scales)

    @staticmethod
    def _kv_dtype(cache: Any) -> Any:
        """The dtype the float operands of an op on a checked ``cache`` must
        have: the cache's for a float cache; None (float16 or float32) for an
        int8 one."""
        return None if _quantized(cache) else cache.dtype

    # ------------------------------------------------------------------ #
    # dense ops
    # ------------------------------------------------------------------ #

    def embedding(self, token_ids: Any, table: Any) -> Any:
        """``table[token_ids]``: int[T] ids, float[V, H] table -> new [T, H] (table's dtype).

        A ``BlockQuantizedWeight`` table (``--quantization q4``) gives its rows
        dequantized, in the backend dtype (:meth:`_embedding_blocks`).
        Raises ValueError for a bad array or an id outside [0, V).
        """
        if isinstance(table, BlockQuantizedWeight):
            return self._embedding_blocks(token_ids, table)
        table = self._float(table, "embedding: table", "[V, H]", 2)
        ids = self._index(token_ids, "embedding: token_ids", 1, np.int64)
        self._check_range(ids, table.shape[0], "embedding: token id")
        out = self.xp.empty((ids.shape[0], table.shape[1]), table.dtype)
        threads = self._row_threads(table.shape[1])
        self._launch(kernels.embedding_kernel, (ids.shape[0],), (threads,), ids, table, out)
        return out

    def linear(self, x: Any, weight: Any, bias: Any | None = None) -> Any:
        """``x @ weight.T (+ bias)`` (PyTorch nn.Linear) by ``xp.matmul`` (cuBLAS on a GPU).

        x: [T, in]; weight: [out, in], x's dtype (float16/float32, any
        strides), or a ``QuantizedWeight``: scheme ``int8``
        (:meth:`linear_int8`) or ``w8a8`` (:meth:`linear_w8a8`), or a
        ``BlockQuantizedWeight`` (:meth:`linear_q4`); bias: [out]
        or None.  Returns a new [T, out] array of x's dtype.  Under the
        simulator float16 products are computed in float32 and rounded (NumPy
        has no float16 GEMM).  Raises ValueError on a shape or dtype mismatch,
        or an unknown quantization scheme.
        """
        if isinstance(weight, QuantizedWeight):
            if weight.scheme == "int8":
                return self.linear_int8(x, weight.qweight, weight.scales, bias)
            if weight.scheme == "w8a8":
                return self.linear_w8a8(x, weight.qweight, weight.scales, bias)
            raise ValueError(f"linear: unknown quantization scheme {weight.scheme!r}")
        if isinstance(weight, BlockQuantizedWeight):
            return self.linear_q4(x, weight, bias)
        self._float(x, "linear: x", "[T, in]", 2, contiguous=False)
        self._float(weight, "linear: weight", "[out, in]", 2, dtype=x.dtype, contiguous=False)
        if x.shape[1] != weight.shape[1]:
            raise ValueError(f"linear: x {x.shape} and weight {weight.shape} do not match "
                             "(expected x [T, in], weight [out, in])")
        y = self._matmul(x, weight)
        if bias is not None:
            self._float(bias, "linear: bias", f"[{weight.shape[0]}]", 1, contiguous=False)
            if bias.shape != (weight.shape[0],):
                raise ValueError(f"linear: bias shape {bias.shape}, expected ({weight.shape[0]},)")
            y += bias
        return y

    def _matmul(self, x: Any, weight: Any) -> Any:
        """``x @ weight.T`` by ``xp.matmul``; float16 under the simulator in
        float32, rounded once (NumPy has no float16 GEMM)."""
        if self._cupy is None and x.dtype == np.float16:
            return np.matmul(x, weight.T, dtype=np.float32).astype(np.float16)
        return self.xp.matmul(x, weight.T)

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
                             f"int8 {self.xp.__name__} array, got {_describe(weight_q)}")
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
                             f"array, got {_describe(d)}")
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
                                 f"got {_describe(a)}")
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

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        """HF LlamaRMSNorm: [T, H] x, [H] weight (x's dtype) -> new [T, H].

        Sum of squares in float32.  Raises ValueError on a bad array or a
        shape mismatch.
        """
        x = self._float(x, "rms_norm: x", "[T, H]", 2)
        self._float(weight, "rms_norm: weight", f"[{x.shape[1]}]", 1, dtype=x.dtype)
        if weight.shape != (x.shape[1],):
            raise ValueError(f"rms_norm: weight {weight.shape} does not match x {x.shape}")
        out = self.xp.empty_like(x)
        self._launch(kernels.rms_norm_kernel, (x.shape[0],), (self._row_threads(x.shape[1]),),
                     x, weight, np.float32(eps), out)
        return out

    def fused_add_rms_norm(self, x: Any, residual: Any, weight: Any, eps: float,
                           x_weight: Any | None = None) -> None:
        """In place: ``residual += x; x[:] = rms_norm(residual, weight, eps)``.

        vLLM's ``fused_add_rms_norm``.  x, residual: writeable C-contiguous
        [T, H] of one dtype, not overlapping; weight: [H], same dtype.
        ``x_weight`` [H] given: ``x`` is first normed with it, in the same
        launch (``kernels.fused_norm_add_rms_norm_kernel``; Gemma 3's
        sandwich norms, ``Ops.fused_add_rms_norm``).
        Raises ValueError on a bad array, a shape mismatch or overlap.
        """
        x = self._float(x, "fused_add_rms_norm: x", "[T, H]", 2, inplace=True)
        self._float(residual, "fused_add_rms_norm: residual", f"{tuple(x.shape)}", 2,
                    dtype=x.dtype, inplace=True)
        self._float(weight, "fused_add_rms_norm: weight", f"[{x.shape[1]}]", 1, dtype=x.dtype)
        if residual.shape != x.shape or weight.shape != (x.shape[1],):
            raise ValueError(f"fused_add_rms_norm: x {x.shape}, residual {residual.shape} and "
                             f"weight {weight.shape} must be [T, H], [T, H], [H]")
        if self._overlap(x, residual):
            raise ValueError("fused_add_rms_norm: x and residual must not overlap")
        grid, block = (x.shape[0],), (self._row_threads(x.shape[1]),)
        if x_weight is None:
            self._launch(kernels.fused_add_rms_norm_kernel, grid, block, x, residual, weight,
                         np.float32(eps))
            return
        self._float(x_weight, "fused_add_rms_norm: x_weight", f"[{x.shape[1]}]", 1,
                    dtype=x.dtype)
        if x_weight.shape != weight.shape:
            raise ValueError(f"fused_add_rms_norm: x_weight {x_weight.shape} does not match "
                             f"weight {weight.shape}")
        self._launch(kernels.fused_norm_add_rms_norm_kernel, grid, block, x, residual, x_weight,
                     weight, np.float32(eps))

    def _overlap(self, a: Any, b: Any) -> bool:
        """Whether two C-contiguous arrays share bytes."""
        def span(arr: Any) -> tuple[int, int]:
            ptr = self._pointer(arr)
            return ptr, ptr + arr.nbytes
        (a0, a1), (b0, b1) = span(a), span(b)
        return a0 < b1 and b0 < a1 and a.size > 0 and b.size > 0

    def rotary_embedding(self, positions: Any, q: Any, k: Any, cos_sin_cache: Any,
                         head_dim: int) -> None:
        """In-place NeoX / HF ``rotate_half`` RoPE of q and k.

        positions: int[T]; q: writeable C-contiguous [T, nh*hd] or [T, nh, hd];
        k: likewise with nkv heads, q's dtype; cos_sin_cache: C-contiguous
        float16/float32 [max_position, hd] from :func:`build_rope_cache`
        (any table of that layout: Llama 3 scaling is a different table).
        Raises ValueError on a bad array, a shape mismatch, an odd head_dim
        or a position outside [0, max_position).
        """
        pos = self._index(positions, "rotary_embedding: positions", 1, np.int64)
        cache = self._float(cos_sin_cache, "rotary_embedding: cos_sin_cache",
                            f"[max_position, {head_dim}]", 2)
        if head_dim <= 0 or head_dim % 2 or cache.shape[1] != head_dim:
            raise ValueError(f"rotary_embedding: cos_sin_cache {cache.shape} does not match "
                             f"head_dim {head_dim} (must be even)")
        T = pos.shape[0]
        layout = f"[{T}, heads*{head_dim}] or [{T}, heads, {head_dim}]"
        for what, a in (("q", q), ("k", k)):
            self._float(a, f"rotary_embedding: {what}", layout, (2, 3),
                        dtype=None if what == "q" else q.dtype, inplace=True)
            if a.shape[0] != T or math.prod(a.shape[1:]) % head_dim \
                    or (a.ndim == 3 and a.shape[2] != head_dim):
                raise ValueError(f"rotary_embedding: {what} must be {layout}, got {a.shape}")
        self._check_range(pos, cache.shape[0], "rotary_embedding: position")
        for a in (q, k):
            x = a.reshape(T, -1, head_dim)  # a view: a is C-contiguous
            threads = self._row_threads(x.shape[1] * head_dim // 2)
            self._launch(kernels.rotary_kernel, (T,), (threads,), pos, x, cache)

    def silu_and_mul(self, x: Any) -> Any:
        """``silu(x[:, :I]) * x[:, I:]``: C-contiguous [T, 2I] -> new [T, I] (x's dtype).

        Raises ValueError on a bad array or an odd last dimension.
        """
        x = self._float(x, "silu_and_mul: x", "[T, 2*I]", 2)
        if x.shape[1] % 2:
            raise ValueError(f"silu_and_mul: x last dimension must be even, got {x.shape}")
        out = self.xp.empty((x.shape[0], x.shape[1] // 2), x.dtype)
        self._launch(kernels.silu_and_mul_kernel, (x.shape[0],), (self._row_threads(out.shape[1]),),
                     x, out)
        return out

    def gelu_tanh_and_mul(self, x: Any) -> Any:
        """``gelu_tanh(x[:, :I]) * x[:, I:]``: C-contiguous [T, 2I] -> new [T, I] (x's dtype).

        gelu_tanh(a) = 0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3))),
        PyTorch's ``gelu(approximate="tanh")`` (HF ``gelu_pytorch_tanh``,
        Gemma 3's MLP activation), computed in float32
        (``kernels.gelu_tanh_and_mul_kernel``).  Raises ValueError on a bad
        array or an odd last dimension.
        """
        x = self._float(x, "gelu_tanh_and_mul: x", "[T, 2*I]", 2)
        if x.shape[1] % 2:
            raise ValueError(f"gelu_tanh_and_mul: x last dimension must be even, got {x.shape}")
        out = self.xp.empty((x.shape[0], x.shape[1] // 2), x.dtype)
        self._launch(kernels.gelu_tanh_and_mul_kernel, (x.shape[0],),
                     (self._row_threads(out.shape[1]),), x, out)
        return out

    # ------------------------------------------------------------------ #
    # paged KV cache
    # ------------------------------------------------------------------ #

    def write_kv(self, k: Any, v: Any, kv_cache: Any, slot_mapping: Any) -> None:
        """Scatter K/V rows into ``kv_cache`` by slot (vLLM's reshape_and_cache).

        k, v: [T, nkv, hd] of the cache's dtype, each token's [nkv, hd] row
        contiguous; the token stride is free (views of a fused qkv output, as
        vLLM's key.stride(0)).  kv_cache: writeable C-contiguous
        [num_blocks, 2, block_size, nkv, hd]; slot_mapping: int[T], negative
        entries skipped.  Raises ValueError on a bad array, a shape mismatch
        or a slot >= num_blocks * block_size.

        An int8 kv_cache ([num_blocks, 2, block_size, nkv, hd + 4],
        ``kvserve.model.kv_quant``) takes float16 or float32 k and v, and
        stores each (token, head) vector quantized by
        ``kernels.write_kv_int8_kernel``: its codes and float32 scale, bit
        for bit as ``kv_quant.quantize`` of the vector in float32.
        """
        cache = self._check_cache(kv_cache, "write_kv")
        num_blocks, _, block_size, nkv, _ = cache.shape
        hd = _cache_head_dim(cache)
        slots = self._index(slot_mapping, "write_kv: slot_mapping", 1, np.int64)
        T = slots.shape[0]
        for what, a in (("k", k), ("v", v)):
            layout = f"[{T}, {nkv}, {hd}] with contiguous rows"
            self._float(a, f"write_kv: {what}", layout, 3, dtype=self._kv_dtype(cache),
                        contiguous=False)
            item = a.dtype.itemsize
            if a.shape != (T, nkv, hd) or a.strides[2] != item or a.strides[1] != hd * item:
                raise ValueError(f"write_kv: {what} must be {layout}, got {a.shape} "
                                 f"strides {a.strides}")
        if slots.size and not self._checked(slots) \
                and int(slots.max()) >= num_blocks * block_size:
            raise ValueError(f"write_kv: slot out of range (>= {num_blocks * block_size} = "
                             "num_blocks * block_size)")
        if self._cupy is None:  # the simulator transfers only contiguous host buffers
            k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
        if _quantized(cache):
            self._launch(kernels.write_kv_int8_kernel, (T, nkv), (self._threads(hd),),
                         k, v, *self._kv_args(cache), slots)
            return
        self._launch(kernels.write_kv_kernel, (T,), (self._row_threads(nkv * hd),),
                     k, v, cache, slots)

    def paged_attention(self, q: Any, kv_cache: Any, block_tables: Any, seq_lens: Any,
                        query_start_loc: Any, scale: float, plan: StepViews | None = None,
                        window: int = 0) -> Any:
        """Causal attention of every new token over its sequence's paged context.

        q: C-contiguous [T, nh, hd] of the cache's dtype, hd <=
        ``kernels.MAX_HEAD_DIM``; kv_cache: [num_blocks, 2, block_size, nkv,
        hd] (the new tokens' K/V already written); block_tables:
        int[S, max_blocks]; seq_lens: int[S]; query_start_loc: int[S+1];
        scale: usually hd ** -0.5.  GQA: query head h reads KV head
        ``h // (nh // nkv)``.  Returns a new [T, nh, hd] array of q's dtype;
        rows of tokens owned by no sequence are zero.

        Sequences with fewer than ``prefill_min_queries`` new tokens (decodes)
        take vLLM paged_attention_v2's split-K ("flash decoding") route: each
        token's context is cut in partitions of ``partition_size`` keys,
        computed in parallel, then combined by their max logits and exp sums.
        The others (prefill chunks) take the tiled prefill kernel: fully over
        the cached prefix, causally within the chunk.  The metadata are
        validated and turned into work lists on the host (``step.attention_plan``),
        here (reading them back) or, given the step's ``plan`` (``prepare_step``,
        whose arrays these are), once for the whole step before it ran.

        ``window``: 0 (default) for full causal attention; > 0 for a sliding
        window (Gemma 3's local layers): the query at position p attends to
        keys p - window < j <= p only.  The kernels never read a key before
        a query's window (the blocks there may be freed and hold anything,
        NaN included); here, without a plan, only the block ids they read
        are checked.  A decode then costs ceil(min(context, window) /
        partition_size) partitions.

        An int8 kv_cache ([num_blocks, 2, block_size, nkv, hd + 4],
        ``kvserve.model.kv_quant``) takes a float16 or float32 q and runs the
        int8 kernels of the same routes (``decode_partition_int8_kernel``,
        ``prefill_attention_int8_kernel``): codes dequantized inside, a
        key's dot product scaled once by its scale, a value's scale folded
        into its softmax weight; never a float copy of the cache.

        Raises ValueError on a bad array, inconsistent metadata, a block id
        out of range or a negative window.
        """
        cache = self._check_cache(kv_cache, "paged_attention")
        num_blocks, _, block_size, nkv, _ = cache.shape
        hd = _cache_head_dim(cache)
        q = self._float(q, "paged_attention: q", "[T, nh, hd]", 3,
                        dtype=self._kv_dtype(cache))
        T, nh, _ = q.shape
        if q.shape[2] != hd or nh % nkv or hd > kernels.MAX_HEAD_DIM:
            raise ValueError(f"paged_attention: q {q.shape} incompatible with {nkv} kv heads of "
                             f"dim {hd} (nh a multiple of nkv, hd <= {kernels.MAX_HEAD_DIM})")
        bt = self._index(block_tables, "paged_attention: block_tables", 2, np.int32)
        sl = self._index(seq_lens, "paged_attention: seq_lens", 1, np.int32)
        qsl = self._index(query_start_loc, "paged_attention: query_start_loc", 1, np.int32)
        S = sl.shape[0]
        if qsl.shape[0] != S + 1 or bt.shape[0] != S:
            raise ValueError(f"paged_attention: {S} seq_lens need query_start_loc of {S + 1} "
                             f"and block_tables of {S} rows, got {qsl.shape[0]} and {bt.shape[0]}")
        window = _check_window(window, "paged_attention")
        out = self.xp.zeros_like(q)
        if S == 0:
            return out
        if plan is None:
            plan = self._plan_here(bt, sl, qsl, T, num_blocks, block_size, window)
        args = (q, cache, bt)
        scale32, window32 = np.float32(scale), np.int32(window)
        if plan.num_decodes:
            self._decode(*args, plan, scale32, window32, out)
        if plan.num_tiles:
            grid = (plan.num_tiles, nh)
            prefill = kernels.prefill_attention_kernel
            if _quantized(cache):
                prefill = kernels.prefill_attention_int8_kernel
                args = (q, *self._kv_args(cache), bt)
            self._launch(prefill, grid, (plan.tile_q,), *args,
                         plan.tile_seq, plan.tile_t0, plan.tile_nq, plan.tile_pos0, scale32,
                         window32, out)
        return out

    def _plan_here(self, bt: Any, sl: Any, qsl: Any, num_tokens: int, num_blocks: int,
                   block_size: int, window: int = 0) -> StepViews:
        """The work lists of a ``paged_attention`` called without a step plan:
        its metadata read back, checked and planned on the host, and the
        lists uploaded (a call outside a step: tests, warm-up)."""
        h_sl, h_qsl = self._host(sl), self._host(qsl)
        check_attention_metadata(self._host(bt), h_sl, h_qsl, num_tokens, num_blocks, block_size,
                                 window)
        tile_q = self._threads(min(self.prefill_tile_q, int(np.diff(h_qsl).max())))
        lists = attention_plan(h_sl, h_qsl, self.prefill_min_queries, tile_q)
        packed = pack_step(lists, num_tokens, len(h_sl), decode_only=False,
                           max_context=int(h_sl.max()), tile_q=tile_q)
        return self.step_views(packed, self.upload(packed.data))

    def _decode(self, q: Any, cache: Any, bt: Any, plan: StepViews, scale: np.float32,
                window: np.int32, out: Any) -> None:
        """The split-K decode route of :meth:`paged_attention` on ``plan``'s
        tokens (the int8 partition kernel for an int8 cache)."""
        partition, caches = kernels.decode_partition_kernel, (cache,)
        if _quantized(cache):
            partition = kernels.decode_partition_int8_kernel
            caches = self._kv_args(cache)
        xp, P = self.xp, self.partition_size
        N, (nh, hd) = plan.num_decodes, q.shape[1:]
        keys = _keys_seen(plan.max_context, int(window))
        parts = -(-keys // P)
        tmp_out = xp.empty((N, nh, parts, hd), np.float32)
        max_logits = xp.empty((N, nh, parts), np.float32)
        exp_sums = xp.empty((N, nh, parts), np.float32)
        self._launch(partition, (N, nh, parts),
                     (self._threads(max(min(P, keys), hd)),),
                     q, *caches, bt, plan.tokens, plan.token_seq, plan.token_ctx, scale, window, P,
                     tmp_out, max_logits, exp_sums)
        self._launch(kernels.decode_reduce_kernel, (N, nh), (self._threads(hd),),
                     tmp_out, max_logits, exp_sums, plan.tokens, plan.token_ctx, window, P, out)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_kv_heads: int,
                          head_dim: int, kv_cache_dtype: str = "auto") -> Any:
        """One layer's zeroed KV cache (``--kv-cache-dtype``).

        ``auto``: [num_blocks, 2, block_size, num_kv_heads, head_dim] of the
        backend dtype. ``int8``: int8 [num_blocks, 2, block_size,
        num_kv_heads, head_dim + 4], codes then a float32 scale per vector
        (``kvserve.model.kv_quant``; zero bytes read as zero vectors).
        Raises ValueError for a non-positive dimension, another
        ``kv_cache_dtype`` (``kv_quant.check_kv_cache_dtype``'s message), or
        an int8 head_dim that is not a multiple of 4.
        """
        dims = (num_blocks, block_size, num_kv_heads, head_dim)
        if any(int(d) <= 0 for d in dims):
            raise ValueError(f"allocate_kv_cache: all dimensions must be positive, got {dims}")
        kv_quant.check_kv_cache_dtype(kv_cache_dtype)
        if kv_quant.is_quantized(kv_cache_dtype):
            width = kv_quant.vector_width(head_dim, kv_cache_dtype)
            return self.xp.zeros((num_blocks, 2, block_size, num_kv_heads, width), np.int8)
        return self.xp.zeros((num_blocks, 2, block_size, num_kv_heads, head_dim), self.dtype)

    # ------------------------------------------------------------------ #
    # host <-> backend
    # ------------------------------------------------------------------ #

    def to_device(self, array: np.ndarray) -> Any:
        """Host array -> a new C-contiguous backend array (a copy under the
        simulator too, as a host-to-device transfer is on a GPU).

        Floating arrays (bfloat16 through ml_dtypes included) become the
        backend dtype: bf16 goes through float32 to float16 (exact to
        float32, one rounding to float16; values beyond float16's 65504
        become inf).  Other dtypes are kept.
        """
        a = np.asarray(array)
        if a.dtype.kind in "fV":  # "V": e.g. bfloat16 via ml_dtypes
            a = np.asarray(a, dtype=np.float32).astype(self.dtype, copy=False)
        return self.upload(a)

    def to_numpy(self, array: Any) -> np.ndarray:
        """Backend array -> a new host NumPy array (``download``)."""
        return self.download(array)

    def upload(self, array: Any) -> Any:
        """Host array -> a new C-contiguous device array of the same dtype:
        one counted host-to-device copy (``counters.h2d``). Every copy to the
        device goes through here."""
        self.counters.h2d += 1
        a = np.ascontiguousarray(array)
        if self._cupy is not None:
            return self._cupy.asarray(a)
        return np.array(a, order="C", copy=True)

    def upload_into(self, target: Any, array: np.ndarray) -> None:
        """Copy host ``array`` into the existing device array ``target`` (same
        size and dtype; a graph's fixed input): one counted host-to-device
        copy, on CuPy's current stream."""
        self.counters.h2d += 1
        a = np.ascontiguousarray(array)
        if a.nbytes != target.nbytes or a.dtype != target.dtype:
            raise ValueError(f"upload_into: {a.dtype} {a.shape} does not fit {target.dtype} "
                             f"{target.shape}")
        if self._cupy is not None:
            target.set(a.reshape(target.shape))
        else:
            target[...] = a.reshape(target.shape)

    def download(self, array: Any) -> np.ndarray:
        """Device array -> a new host NumPy array: one counted device-to-host
        copy (``counters.d2h``; on a GPU it waits for the stream's work).
        Every copy from the device goes through here."""
        self.counters.d2h += 1
        return self._cupy.asnumpy(array) if self._cupy is not None else np.array(array, copy=True)

    # ------------------------------------------------------------------ #
    # a step's inputs
    # ------------------------------------------------------------------ #

    def prepare_step(self, batch: Any, geometry: StepGeometry) -> StepViews:
        """Check a step's host arrays (``kvserve.cuda.step.check_step``),
        plan its attention, and upload everything in one copy.

        batch: a ``BatchInputs`` (host NumPy arrays: input_ids, positions,
        slot_mapping, block_tables, seq_lens, query_start_loc,
        logits_indices, and ``group_tables``: the slot mappings and block
        tables of KV-cache groups 1 .. G-1, each checked as group 0's).
        Returns the device views (``StepViews.group_tables``: the groups'
        views); until the next call the wrappers trust those arrays and read
        nothing back. Raises ValueError as ``check_step``.
        """
        i64, i32 = np.int64, np.int32
        arrays = {"input_ids": batch.input_ids.astype(i64, copy=False),
                  "positions": batch.positions.astype(i64, copy=False),
                  "slot_mapping": batch.slot_mapping.astype(i64, copy=False),
                  "block_tables": batch.block_tables.astype(i32, copy=False),
                  "seq_lens": batch.seq_lens.astype(i32, copy=False),
                  "query_start_loc": batch.query_start_loc.astype(i32, copy=False),
                  "logits_indices": batch.logits_indices.astype(i64, copy=False)}
        check_step(*arrays.values(), geometry)
        base = dict(arrays)
        for g, (slots, tables) in enumerate(getattr(batch, "group_tables", ()), start=1):
            group = {"slot_mapping": slots.astype(i64, copy=False),
                     "block_tables": tables.astype(i32, copy=False)}
            check_step(**{**base, **group}, geometry=geometry)
            arrays.update({group_name(name, g): a for name, a in group.items()})
        qsl, sl = arrays["query_start_loc"], arrays["seq_lens"]
        n_new = np.diff(qsl.astype(i64))
        tile_q = self._threads(min(self.prefill_tile_q, int(n_new.max(initial=1))))
        arrays.update(attention_plan(sl, qsl, self.prefill_min_queries, tile_q))
        packed = pack_step(arrays, num_tokens=batch.input_ids.shape[0], num_seqs=sl.shape[0],
                           decode_only=bool(sl.size) and bool((n_new == 1).all()),
                           max_context=int(sl.max(initial=0)), tile_q=tile_q)
        return self.use_step(self.step_views(packed, self.upload(packed.data)))

    def step_views(self, packed: PackedStep, buffer: Any) -> StepViews:
        """The typed views of ``packed``'s arrays in its device ``buffer``."""
        return StepViews(buffer, packed, {name: packed.view(buffer, name)
                                          for name in packed.layout})

    def use_step(self, views: StepViews) -> StepViews:
        """Make ``views`` the current step: until the next, the wrappers trust
        its arrays (checked on the host) and read none of them back."""
        self._step = views
        return views

    def rope_kv_attention(self, qkv: Any, positions: Any, cos_sin_cache: Any, kv_cache: Any,
                          attn: Any, scale: float, num_heads: int, num_kv_heads: int,
                          head_dim: int, window: int = 0, qk_norm: QKNorm | None = None) -> Any:
        """(Q/K norms,) RoPE of q and k, their K/V written to the cache, paged
        attention: ``kvserve.model.ops.rope_kv_attention``'s contract (qkv [T,
        (nh + 2 nkv) * hd]; returns a new [T, nh, hd]); ``window`` as
        :meth:`paged_attention`'s (0: full causal attention); ``qk_norm``
        (weights [hd] of qkv's dtype) normed in the fused kernel too.

        A decode step planned by ``prepare_step`` (``attn.plan``: every
        sequence one new token), with at most ``MAX_GROUP`` query heads per
        KV head, runs ``kernels.decode_fused_kernel``: one launch, a
        second (the split-K reduction) only for a context (or window)
        longer than ``partition_size``. Any other step runs the three ops in
        turn (:meth:`_compose`). An int8 ``kv_cache`` (``kvserve.model.kv_quant``)
        takes a float16 or float32 qkv; its fused route is
        ``kernels.decode_fused_int8_kernel`` (the new K/V quantized where they
        are written). Raises ValueError as those ops do.
        """
        window = _check_window(window, "rope_kv_attention")
        plan = getattr(attn, "plan", None)
        group = num_heads // num_kv_heads if num_kv_heads else 0
        if (not isinstance(plan, StepViews) or not plan.decode_only or plan.num_tiles
                or group > kernels.MAX_GROUP or head_dim > kernels.MAX_HEAD_DIM):
            return self._compose(qkv, positions, cos_sin_cache, kv_cache, attn, scale, num_heads,
                                 num_kv_heads, head_dim, window, qk_norm)
        cache = self._check_cache(kv_cache, "rope_kv_attention")
        qkv = self._float(qkv, "rope_kv_attention: qkv", "[T, (nh + 2 nkv) * hd]", 2,
                          dtype=self._kv_dtype(cache))
        if (cache.shape[3] != num_kv_heads or _cache_head_dim(cache) != head_dim
                or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim
                or num_heads % num_kv_heads or head_dim % 2):
            raise ValueError(f"rope_kv_attention: qkv {qkv.shape} and cache {cache.shape} do "
                             f"not match {num_heads} heads, {num_kv_heads} KV heads of "
                             f"{head_dim}")
        xp, P = self.xp, self.partition_size
        N = plan.num_decodes
        keys = _keys_seen(plan.max_context, window)
        parts = -(-keys // P)
        out = xp.zeros((qkv.shape[0], num_heads, head_dim), qkv.dtype)
        tmp_out = xp.empty((N, num_heads, parts if parts > 1 else 1, head_dim), np.float32)
        max_logits = xp.empty((N, num_heads, parts), np.float32)
        exp_sums = xp.empty((N, num_heads, parts), np.float32)
        threads = self._threads(max(min(P, keys), head_dim))
        window32 = np.int32(window)
        norms = self._qk_norm_args(qkv, qk_norm, head_dim)
        fused, caches = kernels.decode_fused_kernel, (cache,)
        if _quantized(cache):
            fused, caches = kernels.decode_fused_int8_kernel, self._kv_args(cache)
        self._launch(fused, (N, num_kv_heads, parts), (threads,),
                     qkv, positions, cos_sin_cache, *norms, *caches, attn.block_tables,
                     attn.slot_mapping,
                     plan.tokens, plan.token_seq, plan.token_ctx, np.int32(num_heads),
                     np.float32(scale), window32, np.int32(P), out, tmp_out, max_logits,
                     exp_sums)
        if parts > 1:
            self._launch(kernels.decode_reduce_kernel, (N, num_heads), (self._threads(head_dim),),
                         tmp_out, max_logits, exp_sums, plan.tokens, plan.token_ctx, window32, P,
                         out)
        return out

    def decode_path(self, model: Any) -> DecodePath:
        """:meth:`Ops.decode_path`: ``ops`` always (no whole-step call here:
        a launch per op, attention fused per layer, decode steps replayed
        as CUDA graphs)."""
        return DecodePath("ops", "the CUDA backend: a launch per op, attention fused per layer, "
                                 "decode steps replayed as CUDA graphs")

    def decode_layers(self, hidden: Any, model: Any, positions: Any, attn: Any,
                      kv_caches: list, x: Any = None) -> None:
        """:meth:`Ops.decode_layers`: none on this backend (``decode_path``)."""
        return None

    def _qk_norm_args(self, qkv: Any, qk_norm: QKNorm | None, head_dim: int) -> tuple:
        """``(q_norm, k_norm, eps)`` of the fused decode kernels: the weights
        checked ([head_dim] of qkv's dtype), or without norms 1-element
        dummies, which the kernels read as none. Raises ValueError."""
        if qk_norm is None:
            dummy = self._no_norm.get(qkv.dtype)
            if dummy is None:
                dummy = self._no_norm[qkv.dtype] = self.xp.ones(1, qkv.dtype)
            return dummy, dummy, np.float32(0.0)
        for weight, what in ((qk_norm.q_weight, "q_norm"), (qk_norm.k_weight, "k_norm")):
            self._float(weight, f"rope_kv_attention: {what}", f"[{head_dim}]", 1,
                        dtype=qkv.dtype)
            if weight.shape != (head_dim,):
                raise ValueError(f"rope_kv_attention: {what} {weight.shape}, expected "
                                 f"({head_dim},)")
        return qk_norm.q_weight, qk_norm.k_weight, np.float32(qk_norm.eps)

    def _compose(self, qkv: Any, positions: Any, cos_sin_cache: Any, kv_cache: Any, attn: Any,
                 scale: float, num_heads: int, num_kv_heads: int, head_dim: int,
                 window: int, qk_norm: QKNorm | None = None) -> Any:
        """:meth:`rope_kv_attention` as its ops (``compose_rope_kv_attention``'s
        steps: q and k copied out of ``qkv``, normed with ``qk_norm`` and
        rotated, K/V written, then :meth:`paged_attention` with ``window``)."""
        return compose_rope_kv_attention(self, qkv, positions, cos_sin_cache, kv_cache, attn,
                                         scale, num_heads, num_kv_heads, head_dim, window,
                                         qk_norm)

    # ------------------------------------------------------------------ #

    def warmup(self, kv_cache_dtype: str = "auto") -> None:
        """Run every kernel once on tiny inputs of the backend dtype, so that
        the first request does not pay Numba's compile time; with
        ``kv_cache_dtype`` int8, the KV write and attention kernels of the
        int8 cache too."""
        to = self.to_device
        nkv, hd, bs = 1, 4, 4
        cache = self.allocate_kv_cache(2, bs, nkv, hd)
        x = to(np.ones((2, 4)))
        w = to(np.ones(4))
        self.embedding(to(np.arange(2)), x)
        self.fused_add_rms_norm(self.rms_norm(x, w, 1e-6), to(np.ones((2, 4))), w, 1e-6)
        q, k = to(np.ones((2, 2, hd))), to(np.ones((2, nkv, hd)))
        self.rotary_embedding(to(np.arange(2)), q, k, to(build_rope_cache(hd, 4, 1e4)), hd)
        self.silu_and_mul(x)
        self.gelu_tanh_and_mul(x)
        meta = (to(np.array([[0, 1]], np.int32)), to(np.array([2], np.int32)))
        caches = [cache]
        if kv_quant.is_quantized(kv_cache_dtype):
            caches.append(self.allocate_kv_cache(2, bs, nkv, hd, kv_cache_dtype))
        for kv in caches:
            self.write_kv(k, k, kv, to(np.arange(2)))
            for n_new in (1, 2):  # decode route, prefill route
                self.paged_attention(q[:n_new].copy(), kv, *meta,
                                     to(np.array([0, n_new], np.int32)), 0.5)
        wq = to(np.ones((4, 4), np.int8))
        d = self.xp.ones((4, 1), np.float32)
        q4 = BlockQuantizedWeight("q4", to(np.zeros((4, QK // 2), np.uint8)), d, d, "Q4_1")
        q8 = BlockQuantizedWeight("q8", to(np.zeros((4, QK), np.int8)), d, None, "Q8_0")
        for rows in (1, kernels.GEMV_MAX_ROWS + 1):
            self.linear_int8(to(np.ones((rows, 4))), wq, self.xp.ones(4, np.float32))
            self.linear_w8a8(to(np.ones((rows, 4))), wq, self.xp.ones(4, np.float32))
            for blocks in (q4, q8):
                self.linear_q4(to(np.ones((rows, QK))), blocks)
        self.embedding(to(np.arange(2)), q4)
        self.embedding(to(np.arange(2)), q8)

