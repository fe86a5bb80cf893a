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
from typing import Any

import numpy as np
from numba import config as numba_config
from numba import cuda

from kvserve.cuda import kernels
from kvserve.cuda.arrays import array_module, describe, simulator_enabled
from kvserve.cuda.attention_ops import PagedAttentionOps
from kvserve.cuda.quantized_linear import QuantizedLinearOps
from kvserve.cuda.step import (PackedStep, StepGeometry, StepViews, attention_plan,
                               check_attention_metadata, check_step, group_name, pack_step)
from kvserve.model import kv_quant
from kvserve.model.ops import DecodePath, build_rope_cache
from kvserve.model.ggml_blocks import QK, BlockQuantizedWeight
from kvserve.model.quantization import QuantizedWeight

__all__ = ["CudaOps", "array_module", "build_rope_cache",
           "check_attention_metadata", "simulator_enabled"]

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


class CudaOps(QuantizedLinearOps, PagedAttentionOps):
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

    Here: construction, launching and checking, the dense ops, copies and a
    step's inputs; the quantized matmuls come from
    :class:`kvserve.cuda.quantized_linear.QuantizedLinearOps`, the KV cache
    and attention from :class:`kvserve.cuda.attention_ops.PagedAttentionOps`.
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
                             f"{self.xp.__name__} array, got {describe(a)}")
        return a

    def _index(self, a: Any, what: str, ndim: int, dtype: Any) -> Any:
        """An integer operand as a C-contiguous ``dtype`` array (copied only if
        needed).  Raises ValueError naming ``what``."""
        if not isinstance(a, self.xp.ndarray) or a.ndim != ndim or a.dtype.kind not in "iu":
            raise ValueError(f"{what} must be a {ndim}-D integer {self.xp.__name__} array, "
                             f"got {describe(a)}")
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
