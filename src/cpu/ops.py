"""CPU backend: :class:`CpuOps`, the :class:`kvserve.model.ops.Ops` interface on
NumPy (BLAS for the matrix products) and the Numba kernels of
:mod:`kvserve.cpu.kernels`.

Everything is float32 but the int8 KV cache (``--kv-cache-dtype int8``,
``kvserve.model.kv_quant``), which every KV op accepts as well, telling the
two layouts apart by the cache's dtype.  Inputs are normalized here
(C-contiguous float32 data, int32/int64 metadata, writeable arrays) so that
each Numba kernel compiles for one type signature per cache layout; the
checks cost O(1) or O(metadata) per call.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from threadpoolctl import threadpool_limits

from kvserve.cpu import (block_dot_ops, block_ops, decode_path, int8, kernels, kquant_ops,
                         quant_ops)
from kvserve.cpu.parallel import PARALLEL_REGION, parallel_chunks
from kvserve.cpu.prefill_attention import prefill_attention
from kvserve.model import kv_quant
from kvserve.model.ops import (DecodePath, QKNorm, build_rope_cache,
                               compose_rope_kv_attention)
from kvserve.model.ggml_blocks import BlockQuantizedWeight, KQuantWeight, StackedWeight
from kvserve.model.quantization import LinearWeight, QuantizedWeight

__all__ = ["CpuOps", "build_rope_cache"]

_F32 = np.float32
#: New tokens from which a sequence's attention takes the BLAS prefill path.
PREFILL_MIN_QUERIES = 16
#: Dense float32 products of at most this many rows (decode steps, and
#: speculative verify chunks of up to 11 drafts) use the Numba GEMV kernel
#: rather than BLAS sgemm: with the OpenMP layer its threads are already
#: awake, where OpenBLAS's sleep between calls (see kvserve.thread_env).
#: Measured on the 2-core machine, a whole forward pass of the default model
#: over a 500-token context, with the 1 x 4 tile kernel: 9 rows 37-41 ms
#: against 73-82 ms with sgemm, 12 rows 40-47 against 83-94 ms, but 16 rows
#: 110-133 against 71 ms. The 2 x 4 tile since then is 1.5-1.7x faster from
#: 2 rows on (the two linear layers of an MLP, 576 x 1536: 2 rows 54-61 us
#: against 90-98, 8 rows 133-140 against 200, 12 rows 175-201 against 288-379).
DENSE_GEMV_MAX_ROWS = 12
#: Attention of less work than this (new tokens x context x heads x head_dim,
#: summed over sequences) runs serially. With the workqueue layer, entering
#: a Numba parallel region costs 50-120 us, more than the attention of a few
#: decode rows (measured on 2 cores, 9 heads of 64: one row at 300 tokens
#: 30 us serial, 102 us parallel; the two cross between 1.4 M and 2.8 M of
#: this product); with OpenMP it costs 1.3 us.
ATTENTION_PARALLEL_MIN_MACS = 1 << 16 if kernels.CHEAP_PARALLEL_REGIONS else 1 << 21


def _check_prefill_metadata(bt: np.ndarray, sl: np.ndarray, qsl: np.ndarray, T: int,
                            num_blocks: int, block_size: int, window: int = 0) -> None:
    """What the Numba kernel checks, for sequences that bypass it (with a
    ``window`` > 0, not the blocks before a sequence's first window).

    Raises ValueError: query_start_loc decreasing or outside [0, T], a
    sequence with fewer context than new tokens, a block table too narrow,
    or a block id outside the cache.
    """
    n_new = np.diff(qsl)
    if qsl[0] < 0 or (n_new < 0).any() or qsl[-1] > T:
        raise ValueError("paged_attention: query_start_loc must be non-decreasing within [0, T]")
    active = n_new > 0
    if (sl[active] < n_new[active]).any():
        raise ValueError("paged_attention: seq_lens[s] smaller than the sequence's new tokens")
    needed = -(-sl.astype(np.int64) // block_size)
    if (needed[active] > bt.shape[1]).any():
        raise ValueError("paged_attention: block_tables too narrow for seq_lens")
    used = np.arange(bt.shape[1])[None, :] < needed[:, None]
    if window > 0:
        first_key = np.maximum(sl.astype(np.int64) - n_new - window + 1, 0)
        used &= np.arange(bt.shape[1])[None, :] >= (first_key // block_size)[:, None]
    ids = bt[used & active[:, None]]
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        raise ValueError("paged_attention: block id out of range of the KV cache")



def _gated(x: np.ndarray, name: str, kernel: Any) -> np.ndarray:
    """A gated activation: ``kernel(x, out)`` with x float32[T, 2I] and a new
    out float32[T, I]. Raises ValueError for an odd last dimension."""
    x = _f32(x, f"{name} x", 2)
    if x.shape[1] % 2:
        raise ValueError(f"{name}: last dimension must be even, got {x.shape}")
    out = np.empty((x.shape[0], x.shape[1] // 2), dtype=_F32)
    kernel(x, out)
    return out

def _f32(a: np.ndarray, name: str, ndim: int) -> np.ndarray:
    """Read-only use: C-contiguous, writeable float32 (copies only when needed).

    Writeable matters because Numba compiles a separate variant for read-only
    arrays (e.g. memory-mapped safetensors).
    """
    a = np.ascontiguousarray(a, dtype=_F32)
    if a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim}-D array, got shape {a.shape}")
    if not a.flags.writeable:
        a = a.copy()
    return a


def _int(a: np.ndarray, dtype: type, name: str, ndim: int) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim}-D array, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected an integer array, got {a.dtype}")
    a = np.ascontiguousarray(a, dtype=dtype)
    if not a.flags.writeable:
        a = a.copy()
    return a


def _inplace(a: np.ndarray, name: str) -> tuple[np.ndarray, bool]:
    """For in-place ops: returns (contiguous buffer, needs_write_back).

    ``a`` must be a writeable float32 ndarray; a non-contiguous view (e.g. a
    slice of a fused qkv output) is processed in a contiguous copy that the
    caller writes back.
    """
    if not isinstance(a, np.ndarray) or a.dtype != _F32:
        raise ValueError(f"{name}: in-place operand must be a float32 numpy array, "
                         f"got {type(a).__name__} {getattr(a, 'dtype', '')}")
    if not a.flags.writeable:
        raise ValueError(f"{name}: in-place operand is read-only")
    if a.flags.c_contiguous:
        return a, False
    return np.ascontiguousarray(a), True


class CpuOps:
    """NumPy + Numba implementation of :class:`kvserve.model.ops.Ops` (float32).

    Args:
        tile_q: queries of one sequence per attention work item (default
            ``kernels.DEFAULT_TILE_Q``).
        num_threads: Numba threads of the parallel kernels, applied on the
            thread that calls them (None: Numba's current setting). BLAS
            threads are process-wide: ``kvserve.cpu.threads.apply_thread_policy``.
        prefill_min_queries: a sequence with at least this many new tokens
            in a step takes the BLAS prefill path
            (``kvserve.cpu.prefill_attention``); shorter ones (decodes, small
            chunks) the Numba paged-attention kernel.
        adaptive: a ``kvserve.cpu.threads.LoadAdaptiveThreads`` that sets
            both pools' threads from the machine's load (None: fixed).
        batch_invariant: a row's result never depends on the other rows of
            the call (``--batch-invariant``, vLLM's batch-invariant mode):
            every product of float32 or GGUF-block weights takes the per-row
            kernels (``kernels.f32_gemv_*``, ``block_kernels.q4/q8_gemv_*``:
            each output one sequential float32 sum over the input channels,
            whatever the row count) instead of BLAS / dequantize + sgemm
            above a few rows, and attention always the Numba kernel (each
            query row its own online softmax over the keys in order) instead
            of the BLAS prefill path. Slower prefill and large batches; int8
            and w8a8 weights are refused (their kernels group rows).
        fused_decode: ``"1"`` (a model's decode steps in one compiled call
            where ``kvserve.cpu.decode_path`` takes them), ``"layer"`` (a
            call per layer) or ``"0"`` (op by op); None: the environment's
            ``KVSERVE_CPU_FUSED_DECODE``, read here once (default ``"1"``).

    Raises ValueError for ``tile_q`` < 1, ``num_threads`` outside
    [1, NUMBA_NUM_THREADS] or an unknown ``fused_decode``.

    Thread safety: Numba kernels release the GIL; the parallel attention
    kernel uses Numba's threading layer, which runs one caller at a time per
    process (a lock serializes the workers of two engines in one process).
    """

    name = "cpu"
    xp = np

    def __init__(self, tile_q: int = kernels.DEFAULT_TILE_Q, num_threads: int | None = None,
                 prefill_min_queries: int = PREFILL_MIN_QUERIES, adaptive=None,
                 batch_invariant: bool = False, fused_decode: str | None = None) -> None:
        if tile_q < 1 or prefill_min_queries < 1:
            raise ValueError(f"tile_q and prefill_min_queries must be >= 1, got {tile_q} "
                             f"and {prefill_min_queries}")
        self.batch_invariant = bool(batch_invariant)
        # batch-invariant: no query count takes the BLAS prefill path
        self.prefill_min_queries = 2**62 if batch_invariant else int(prefill_min_queries)
        if num_threads is not None and not 1 <= num_threads <= numba.config.NUMBA_NUM_THREADS:
            raise ValueError(f"num_threads must be in [1, {numba.config.NUMBA_NUM_THREADS}], "
                             f"got {num_threads}")
        self.tile_q = int(tile_q)
        self.num_threads = num_threads
        self.adaptive = adaptive
        if fused_decode is None:
            fused_decode = decode_path.mode_from_env()
        if fused_decode not in decode_path.MODES:
            raise ValueError(f"fused_decode must be one of {decode_path.MODES}, "
                             f"got {fused_decode!r}")
        self.fused_decode = fused_decode

    def _threads(self) -> int:
        """Numba threads for a parallel kernel, set on the calling thread
        (Numba's setting is per thread; see ``kvserve.cpu.threads``); with
        ``adaptive``, BLAS's and Numba's threads follow the machine's load."""
        if self.adaptive is not None:
            wanted = self.adaptive.current()
            if wanted != self.num_threads:
                self.num_threads = wanted
                threadpool_limits(limits=wanted, user_api="blas")
        if self.num_threads is not None and numba.get_num_threads() != self.num_threads:
            numba.set_num_threads(self.num_threads)
        return numba.get_num_threads()

    # ------------------------------------------------------------------ #
    # dense ops
    # ------------------------------------------------------------------ #

    def embedding(self, token_ids: np.ndarray, table: np.ndarray) -> np.ndarray:
        """``table[token_ids]``: int64[T] ids, float32[V, H] table (or a
        ``BlockQuantizedWeight`` [V, H], whose rows are dequantized) ->
        float32[T, H].

        Raises ValueError for a non-1-D id array or an id outside [0, V).
        """
        ids = _int(token_ids, np.int64, "embedding token_ids", 1)
        if isinstance(table, BlockQuantizedWeight):
            return block_ops.embedding_blocks(ids, table)
        if isinstance(table, KQuantWeight):
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= table.n):
                raise ValueError(f"embedding: token id out of range [0, {table.n})")
            return kquant_ops.embedding_kquant(ids, table)
        if table.ndim != 2:
            raise ValueError(f"embedding: table must be [V, H], got {table.shape}")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= table.shape[0]):
            raise ValueError(f"embedding: token id out of range [0, {table.shape[0]})")
        return np.asarray(table[ids], dtype=_F32)

    def linear(self, x: np.ndarray, weight: LinearWeight,
               bias: np.ndarray | None = None) -> np.ndarray:
        """``x @ weight.T (+ bias)`` via BLAS sgemm (no transpose copy), or for
        a ``QuantizedWeight`` the int8 kernels of ``kvserve.cpu.quant_ops``
        (weight-only) or ``kvserve.cpu.int8`` (w8a8, grouped activations),
        or for a ``BlockQuantizedWeight`` those of ``kvserve.cpu.block_ops``,
        or for a ``KQuantWeight`` (or a ``StackedWeight`` of parts) those of
        ``kvserve.cpu.kquant_ops``.

        x: float32[T, in]; weight: float32[out, in] or a quantized weight;
        bias: float32[out] or None. Returns float32[T, out].  Raises
        ValueError on shape mismatch.
        """
        if isinstance(weight, QuantizedWeight):
            if self.batch_invariant:
                raise ValueError(f"linear: {weight.scheme} weights have no batch-invariant "
                                 "kernels (--batch-invariant serves none or q4)")
            return self._linear_quantized(np.ascontiguousarray(x, dtype=_F32), weight, bias)
        if isinstance(weight, (KQuantWeight, StackedWeight)):
            return kquant_ops.linear_kquant(np.ascontiguousarray(x, dtype=_F32), weight, bias,
                                            self._threads(), other=self.linear)
        if isinstance(weight, BlockQuantizedWeight):
            if weight.activations == "q8" and not self.batch_invariant and (
                    len(x) <= block_dot_ops.Q8_MAX_ROWS
                    or block_dot_ops.uses_panels(weight, len(x))):
                return block_dot_ops.linear_blocks_q8(np.ascontiguousarray(x, dtype=_F32),
                                                      weight, bias, num_threads=self._threads())
            return block_ops.linear_blocks(np.ascontiguousarray(x, dtype=_F32), weight, bias,
                                           num_threads=self._threads(),
                                           per_row=self.batch_invariant)
        x = np.asarray(x, dtype=_F32)
        if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
            raise ValueError(f"linear: x {x.shape} and weight {weight.shape} do not match "
                             "(expected x [T, in], weight [out, in])")
        if (x.shape[0] <= DENSE_GEMV_MAX_ROWS or self.batch_invariant) \
                and weight.dtype == _F32 and weight.flags.c_contiguous:
            y = self._gemv(np.ascontiguousarray(x), weight)
        else:
            y = x @ weight.T
        if y.dtype != _F32:
            y = y.astype(_F32)
        if bias is not None:
            if bias.shape != (weight.shape[0],):
                raise ValueError(f"linear: bias shape {bias.shape}, expected ({weight.shape[0]},)")
            y += bias
        return y

    def _gemv(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """``x @ weight.T`` by ``kernels.f32_gemv_*`` (``f32_gemv_rows_*`` when
        batch-invariant): float32[M, K] x, float32[N, K] weight."""
        out = np.empty((x.shape[0], weight.shape[0]), dtype=_F32)
        chunks = parallel_chunks(x.shape, weight.shape[0], self._threads())
        rows = self.batch_invariant
        if chunks:
            with PARALLEL_REGION:
                kernels.f32_gemv_parallel(x, weight, out, chunks, rows)
        else:
            (kernels.f32_gemv_rows_range if rows else kernels.f32_gemv_range)(
                x, weight, out, 0, weight.shape[0])
        return out

    def _linear_quantized(self, x: np.ndarray, weight: QuantizedWeight,
                          bias: np.ndarray | None) -> np.ndarray:
        if weight.scheme == "int8":
            return quant_ops.linear_int8(x, weight.qweight, weight.scales, bias,
                                         num_threads=self._threads())
        return int8.linear_w8a8(x, weight.qweight, weight.scales, bias,
                                num_threads=self._threads())

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """HF LlamaRMSNorm: float32[T, H], float32[H] -> new float32[T, H].

        The sum of squares is accumulated in float64.  Raises ValueError on
        shape mismatch.
        """
        x = _f32(x, "rms_norm x", 2)
        w = _f32(weight, "rms_norm weight", 1)
        if w.shape[0] != x.shape[1]:
            raise ValueError(f"rms_norm: weight {w.shape} does not match x {x.shape}")
        out = np.empty_like(x)
        kernels.rms_norm_kernel(x, w, float(eps), out)
        return out

    def fused_add_rms_norm(self, x: np.ndarray, residual: np.ndarray, weight: np.ndarray,
                           eps: float, x_weight: np.ndarray | None = None) -> None:
        """In place: ``residual += x; x[:] = rms_norm(residual)`` (vLLM convention),
        with ``x`` first ``rms_norm(x, x_weight)`` when ``x_weight`` is given
        (``Ops.fused_add_rms_norm``).

        x, residual: writeable float32[T, H], distinct buffers; weight,
        x_weight: float32[H].  Raises ValueError on shape/dtype mismatch or aliasing.
        """
        if x_weight is not None:
            x[...] = self.rms_norm(x, x_weight, eps)
        if x.shape != residual.shape or x.ndim != 2:
            raise ValueError(f"fused_add_rms_norm: x {x.shape} and residual {residual.shape} "
                             "must be equal [T, H]")
        if np.shares_memory(x, residual):
            raise ValueError("fused_add_rms_norm: x and residual must not overlap")
        w = _f32(weight, "fused_add_rms_norm weight", 1)
        if w.shape[0] != x.shape[1]:
            raise ValueError(f"fused_add_rms_norm: weight {w.shape} does not match x {x.shape}")
        xb, x_back = _inplace(x, "fused_add_rms_norm x")
        rb, r_back = _inplace(residual, "fused_add_rms_norm residual")
        kernels.fused_add_rms_norm_kernel(xb, rb, w, float(eps))
        if x_back:
            x[...] = xb
        if r_back:
            residual[...] = rb

    def rotary_embedding(self, positions: np.ndarray, q: np.ndarray, k: np.ndarray,
                         cos_sin_cache: np.ndarray, head_dim: int) -> None:
        """In-place NeoX / HF ``rotate_half`` RoPE on q and k.

        positions: int64[T]; q: float32[T, nh*hd] or [T, nh, hd]; k:
        float32[T, nkv*hd] or [T, nkv, hd]; cos_sin_cache: float32[max_pos, hd]
        from :func:`build_rope_cache`.  Non-contiguous q/k views are handled
        through a copy written back.  Raises ValueError on shape mismatch or a
        position outside [0, max_pos).
        """
        pos = _int(positions, np.int64, "rotary_embedding positions", 1)
        cache = _f32(cos_sin_cache, "rotary_embedding cos_sin_cache", 2)
        if cache.shape[1] != head_dim or head_dim % 2:
            raise ValueError(f"rotary_embedding: cos_sin_cache {cache.shape} does not match "
                             f"head_dim {head_dim} (must be even)")
        for name, a in (("q", q), ("k", k)):
            per_token = a.size // a.shape[0] if a.ndim and a.shape[0] else 0
            if a.ndim not in (2, 3) or a.shape[0] != pos.shape[0] or per_token % head_dim \
                    or (a.ndim == 3 and a.shape[2] != head_dim):
                raise ValueError(f"rotary_embedding: {name} shape {a.shape} does not match "
                                 f"T={pos.shape[0]} and head_dim {head_dim}")
            buf, back = _inplace(a, f"rotary_embedding {name}")
            kernels.rotary_kernel(pos, buf.reshape(buf.shape[0], -1, head_dim), cache)
            if back:
                a[...] = buf

    def silu_and_mul(self, x: np.ndarray) -> np.ndarray:
        """``silu(x[:, :I]) * x[:, I:]``: float32[T, 2I] -> new float32[T, I]."""
        return _gated(x, "silu_and_mul", kernels.silu_and_mul_kernel)

    def gelu_tanh_and_mul(self, x: np.ndarray) -> np.ndarray:
        """``gelu_tanh(x[:, :I]) * x[:, I:]`` (GeGLU; ``Ops.gelu_tanh_and_mul``):
        float32[T, 2I] -> new float32[T, I]. Raises ValueError for an odd
        last dimension."""
        return _gated(x, "gelu_tanh_and_mul", kernels.gelu_tanh_and_mul_kernel)

    def decode_path(self, model: Any) -> DecodePath:
        """:meth:`Ops.decode_path`: ``kvserve.cpu.decode_path.choose`` with
        ``fused_decode``."""
        return decode_path.choose(model, self.fused_decode, self.batch_invariant)

    def decode_layers(self, hidden: np.ndarray, model: Any, positions: np.ndarray, attn: Any,
                      kv_caches: list, x: np.ndarray | None = None
                      ) -> tuple[np.ndarray, np.ndarray] | None:
        """A decode or verification step's layers in one compiled call
        (``kvserve.cpu.decode_path``): ``(x, residual)`` before the final norm, or None where the op path runs.
        ``x``: a later pipeline stage's input MLP output (``hidden`` is then
        its residual stream)."""
        return decode_path.decode_layers(hidden, model, positions, attn, kv_caches,
                                         self._threads(), self.batch_invariant, x=x,
                                         mode=self.fused_decode)

    # ------------------------------------------------------------------ #
    # paged KV cache
    # ------------------------------------------------------------------ #

    @staticmethod
    def _check_cache(kv_cache: np.ndarray, name: str) -> tuple[int, np.ndarray | None]:
        """``(head_dim, kv_scales)`` of a KV cache: float32 [num_blocks, 2,
        block_size, nkv, head_dim] gives ``kv_scales`` None; int8 [..., head_dim
        + 4] (``kv_quant``) its float32 view, which holds each vector's scale
        at index ``head_dim // 4``. Raises ValueError naming ``name`` for any
        other array (dtype, rank, axis 1, an int8 width not a multiple of 4,
        not writeable or not C-contiguous)."""
        if isinstance(kv_cache, np.ndarray) and kv_cache.ndim == 5 and kv_cache.shape[1] == 2 \
                and kv_cache.flags.c_contiguous and kv_cache.flags.writeable:
            if kv_cache.dtype == _F32:
                return kv_cache.shape[4], None
            width = kv_cache.shape[4]
            if kv_cache.dtype == np.int8 and width > kv_quant.SCALE_BYTES and width % 4 == 0:
                return width - kv_quant.SCALE_BYTES, kv_cache.view(_F32)
        raise ValueError(f"{name}: kv_cache must be a writeable C-contiguous float32 array "
                         "[num_blocks, 2, block_size, num_kv_heads, head_dim] or int8 "
                         "[..., head_dim + 4] (--kv-cache-dtype int8), got "
                         f"{getattr(kv_cache, 'shape', None)} {getattr(kv_cache, 'dtype', None)}")

    def write_kv(self, k: np.ndarray, v: np.ndarray, kv_cache: np.ndarray,
                 slot_mapping: np.ndarray) -> None:
        """Scatter K/V rows float32[T, nkv, hd] into ``kv_cache`` by slot.

        kv_cache: float32[num_blocks, 2, block_size, nkv, hd], or int8 [...,
        hd + 4], where each row is quantized as it is written
        (``kernels.quantize_kv_vector``, ``kv_quant.quantize`` bit for bit).
        slot_mapping: int64[T]; negative entries are skipped.  Raises
        ValueError on shape mismatch or a slot beyond the cache.
        """
        hd, kv_scales = self._check_cache(kv_cache, "write_kv")
        nkv = kv_cache.shape[3]
        kk = _f32(k, "write_kv k", 3)
        vv = _f32(v, "write_kv v", 3)
        slots = _int(slot_mapping, np.int64, "write_kv slot_mapping", 1)
        T = slots.shape[0]
        if kk.shape != (T, nkv, hd) or vv.shape != (T, nkv, hd):
            raise ValueError(f"write_kv: k {kk.shape} / v {vv.shape} must be ({T}, {nkv}, {hd})")
        if kv_scales is None:
            kernels.write_kv_kernel(kk, vv, kv_cache, slots)
        else:
            kernels.write_kv_kernel(kk, vv, kv_cache, slots, kv_scales)

    def paged_attention(self, q: np.ndarray, kv_cache: np.ndarray, block_tables: np.ndarray,
                        seq_lens: np.ndarray, query_start_loc: np.ndarray,
                        scale: float, plan: Any = None, window: int = 0) -> np.ndarray:
        """Causal attention over the paged cache (see :meth:`Ops.paged_attention`;
        ``plan`` is not needed here: the kernels read the metadata directly;
        ``window`` > 0: each query sees its last ``window`` positions, and
        the blocks before a sequence's window are neither read nor checked).

        q: float32[T, nh, hd]; kv_cache: float32[num_blocks, 2, block_size,
        nkv, hd] or int8 [..., hd + 4] (dequantized as read: by the kernels,
        or while gathering a sequence's K/V for the BLAS prefill path);
        block_tables: int32[S, max_blocks]; seq_lens: int32[S];
        query_start_loc: int32[S+1]; scale: float.  Returns float32[T, nh, hd]
        (zero rows for tokens owned by no sequence).  Parallel over (query
        tile, kv head) with Numba threads; online softmax in float32.
        Raises ValueError on inconsistent shapes/metadata or a block id out of
        range.
        """
        hd, kv_scales = self._check_cache(kv_cache, "paged_attention")
        nkv = kv_cache.shape[3]
        qq = _f32(q, "paged_attention q", 3)
        T, nh, hd_q = qq.shape
        if hd_q != hd or nh % nkv:
            raise ValueError(f"paged_attention: q {qq.shape} incompatible with "
                             f"{nkv} kv heads of dim {hd}")
        bt = _int(block_tables, np.int32, "paged_attention block_tables", 2)
        sl = _int(seq_lens, np.int32, "paged_attention seq_lens", 1)
        qsl = _int(query_start_loc, np.int32, "paged_attention query_start_loc", 1)
        S = sl.shape[0]
        if qsl.shape[0] != S + 1 or bt.shape[0] != S:
            raise ValueError(f"paged_attention: {S} seq_lens need query_start_loc of {S + 1} "
                             f"and block_tables of {S} rows, got {qsl.shape[0]} and {bt.shape[0]}")
        window = int(window)
        if window < 0:
            raise ValueError(f"paged_attention: window must be >= 0, got {window}")
        out = np.zeros_like(qq)
        if not S:
            return out
        n_new = np.diff(qsl)
        long = n_new >= self.prefill_min_queries
        if not long.any():
            self._attention_kernel(qq, kv_cache, bt, sl, qsl, scale, out, window, kv_scales)
            return out
        _check_prefill_metadata(bt, sl, qsl, T, kv_cache.shape[0], kv_cache.shape[2], window)
        for s in np.flatnonzero(long):
            prefill_attention(qq, kv_cache, bt[s], int(sl[s]), int(qsl[s]), int(qsl[s + 1]),
                              scale, out, window=window)
        short = ~long & (n_new > 0)
        if short.any():
            self._decode_subset(qq, kv_cache, bt, sl, qsl, short, scale, out, window,
                                kv_scales)
        return out

    def _decode_subset(self, q: np.ndarray, kv_cache: np.ndarray, bt: np.ndarray,
                       sl: np.ndarray, qsl: np.ndarray, subset: np.ndarray, scale: float,
                       out: np.ndarray, window: int = 0,
                       kv_scales: np.ndarray | None = None) -> None:
        """The Numba kernel on the sequences of bool[S] ``subset`` alone:
        their rows are gathered into a compact batch and the result scattered
        back into ``out``."""
        seqs = np.flatnonzero(subset)
        rows = np.concatenate([np.arange(qsl[s], qsl[s + 1]) for s in seqs])
        sub_qsl = np.zeros(len(seqs) + 1, np.int32)
        np.cumsum(np.diff(qsl)[seqs], out=sub_qsl[1:])
        sub_out = np.zeros((len(rows),) + q.shape[1:], _F32)
        self._attention_kernel(np.ascontiguousarray(q[rows]), kv_cache,
                               np.ascontiguousarray(bt[seqs]), np.ascontiguousarray(sl[seqs]),
                               sub_qsl, scale, sub_out, window, kv_scales)
        out[rows] = sub_out

    def _attention_kernel(self, q: np.ndarray, kv_cache: np.ndarray, bt: np.ndarray,
                          sl: np.ndarray, qsl: np.ndarray, scale: float, out: np.ndarray,
                          window: int = 0, kv_scales: np.ndarray | None = None) -> None:
        """The Numba kernel: serial below ``ATTENTION_PARALLEL_MIN_MACS``
        (a parallel region costs more than that), else parallel, one caller
        at a time in the process: the workqueue threading layer aborts the
        process when two threads (two engines' workers) enter parallel
        regions at once. ``kv_scales``: None, or an int8 cache's float32 view
        (``_check_cache``)."""
        threads = self._threads()
        keys = sl if window <= 0 else np.minimum(sl, window)
        macs = int(np.dot(np.diff(qsl).astype(np.int64), keys)) * q.shape[1] * q.shape[2]
        # a float32 cache calls the kernels exactly as before the int8 cache
        scales = () if kv_scales is None else (kv_scales,)
        if threads == 1 or macs < ATTENTION_PARALLEL_MIN_MACS:
            kernels.paged_attention_kernel_serial(q, kv_cache, bt, sl, qsl, np.float32(scale),
                                                  self.tile_q, out, window, *scales)
            return
        with PARALLEL_REGION:
            kernels.paged_attention_kernel(q, kv_cache, bt, sl, qsl, np.float32(scale),
                                           self.tile_q, threads, out, window, *scales)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_kv_heads: int,
                          head_dim: int, kv_cache_dtype: str = "auto") -> np.ndarray:
        """Zeroed float32[num_blocks, 2, block_size, num_kv_heads, head_dim]
        (``auto``), or int8[num_blocks, 2, block_size, num_kv_heads, head_dim
        + 4] (``int8``: codes and scales, ``kvserve.model.kv_quant``; zero
        bytes read as zero vectors).

        Raises ValueError for a non-positive dimension, a ``kv_cache_dtype``
        other than ``auto`` or ``int8`` (``kv_quant.check_kv_cache_dtype``),
        or an int8 ``head_dim`` not a multiple of 4.

        Written once here (not ``np.zeros``, whose pages the OS commits only
        when first written): the cache's memory is taken at start-up, where a
        shortage fails at once, and the process's RSS does not creep up by
        the cache's size as blocks are first used (a soak read that as a leak).
        """
        dims = (num_blocks, block_size, num_kv_heads, head_dim)
        if any(int(d) <= 0 for d in dims):
            raise ValueError(f"allocate_kv_cache: all dimensions must be positive, got {dims}")
        kv_quant.check_kv_cache_dtype(kv_cache_dtype)
        width = kv_quant.vector_width(head_dim, kv_cache_dtype)
        dtype = np.int8 if kv_quant.is_quantized(kv_cache_dtype) else _F32
        cache = np.empty((num_blocks, 2, block_size, num_kv_heads, width), dtype=dtype)
        cache.fill(0)
        return cache

    # ------------------------------------------------------------------ #
    # host <-> backend
    # ------------------------------------------------------------------ #

    def rope_kv_attention(self, qkv: np.ndarray, positions: np.ndarray,
                          cos_sin_cache: np.ndarray, kv_cache: np.ndarray, attn: Any,
                          scale: float, num_heads: int, num_kv_heads: int,
                          head_dim: int, window: int = 0,
                          qk_norm: QKNorm | None = None) -> np.ndarray:
        """:meth:`Ops.rope_kv_attention` as its ops (``compose_rope_kv_attention``)."""
        return compose_rope_kv_attention(self, qkv, positions, cos_sin_cache, kv_cache, attn,
                                         scale, num_heads, num_kv_heads, head_dim, window,
                                         qk_norm)

    def prepare_step(self, batch: Any, geometry: Any) -> Any:
        """The step's host arrays are this backend's arrays: ``batch`` itself
        (each kernel checks its indices as it runs)."""
        return batch

    def to_device(self, array: np.ndarray) -> np.ndarray:
        """Floating arrays -> C-contiguous writeable float32 (copy if needed);
        other dtypes -> C-contiguous, dtype kept."""
        a = np.asarray(array)
        if a.dtype.kind == "f" or a.dtype.kind == "V":  # "V": e.g. bfloat16 via ml_dtypes
            a = np.ascontiguousarray(a, dtype=_F32)
        else:
            a = np.ascontiguousarray(a)
        if not a.flags.writeable:
            a = a.copy()
        return a

    def to_numpy(self, array: np.ndarray) -> np.ndarray:
        """Identity on the CPU backend (returns a NumPy view/array)."""
        return np.asarray(array)

    # ------------------------------------------------------------------ #

    def warmup(self, kv_cache_dtype: str = "auto") -> None:
        """Compile (or load from Numba's cache) every kernel on tiny inputs,
        the KV ops on a cache of ``kv_cache_dtype`` (``auto`` or ``int8``:
        the layout the engine serves; ValueError for another value).

        Call once at start-up so the first request does not pay JIT time.
        """
        nkv, hd, bs = 1, 4, 4
        cache = self.allocate_kv_cache(2, bs, nkv, hd, kv_cache_dtype)
        x = np.ones((2, 4), _F32)
        self.rms_norm(x, np.ones(4, _F32), 1e-6)
        self.fused_add_rms_norm(x, np.ones((2, 4), _F32), np.ones(4, _F32), 1e-6)
        q = np.ones((2, 2, hd), _F32)
        k = np.ones((2, nkv, hd), _F32)
        self.rotary_embedding(np.arange(2), q, k, build_rope_cache(hd, 4, 10000.0), hd)
        self.silu_and_mul(x)
        self.gelu_tanh_and_mul(x)
        self.write_kv(k, k, cache, np.arange(2))
        self.paged_attention(q, cache, np.array([[0, 1]], np.int32), np.array([2], np.int32),
                             np.array([0, 2], np.int32), 0.5)
        decode_path.warmup(kv_cache_dtype)

