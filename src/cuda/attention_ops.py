"""The paged KV cache and attention of :class:`kvserve.cuda.ops.CudaOps`:
the cache's checks and allocation, KV writes, paged attention (split-K
decode and tiled prefill routes) and ``rope_kv_attention``'s fused decode
route, on the kernels of :mod:`kvserve.cuda.decode_kernels` and
:mod:`kvserve.cuda.prefill_kernels` (through :mod:`kvserve.cuda.kernels`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvserve.cuda import kernels
from kvserve.cuda.arrays import describe
from kvserve.cuda.step import StepViews, attention_plan, check_attention_metadata, pack_step
from kvserve.model import kv_quant
from kvserve.model.ops import QKNorm, compose_rope_kv_attention


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


class PagedAttentionOps:
    """:class:`kvserve.cuda.ops.CudaOps`' methods for the paged KV cache and
    attention (a mixin: it uses ``CudaOps``' array module ``xp``, ``dtype``,
    ``simulator``, ``partition_size``, ``prefill_min_queries``,
    ``prefill_tile_q``, the current step, and its checking, launching and
    copying methods ``_float``, ``_index``, ``_check_range``, ``_checked``,
    ``_host``, ``_launch``, ``_threads``, ``_row_threads``, ``upload``,
    ``step_views``)."""

    # ------------------------------------------------------------------ #
    # checking a KV cache
    # ------------------------------------------------------------------ #

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
                                 f"of 4, got {describe(kv_cache)}")
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
    # the fused decode route
    # ------------------------------------------------------------------ #

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
