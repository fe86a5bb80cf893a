"""Numba kernels of the CPU backend.

Every kernel here is ``@njit(nogil=True, cache=True)`` and expects C-contiguous
arrays of exactly the dtypes documented on it (float32 data, int32/int64
metadata); :class:`kvserve.cpu.ops.CpuOps` normalizes its inputs so that each
kernel compiles for one type signature only (compile time matters on small
machines: see ``tools/bench_kernels.py`` for the measured first-call times).

Kernels do the checks that would otherwise corrupt memory (Numba does no bounds
checking): out-of-range slots, block ids, positions and inconsistent metadata
raise ``ValueError`` with a constant message.

Layout conventions (DESIGN.md section 3, vLLM's paged-attention layout):

* ``kv_cache``: ``float32[num_blocks, 2, block_size, num_kv_heads, head_dim]``,
  index 0 of axis 1 is K, index 1 is V; or, quantized (``--kv-cache-dtype
  int8``, ``kvserve.model.kv_quant``), ``int8[num_blocks, 2, block_size,
  num_kv_heads, head_dim + 4]``: each vector's ``head_dim`` codes, then the
  bytes of its float32 scale. A kernel taking the cache then also takes
  ``kv_scales``, the cache's float32 view ``[..., (head_dim + 4) / 4]``
  (the scale at index ``head_dim // 4``), or None for a float32 cache; the
  ``kv_scales is None`` branches are pruned at compile time (Numba prunes a
  branch on an argument typed None), so the float32 variant compiles to
  the code it had before the int8 cache existed.
* ``slot_mapping``: ``int64[T]``; token ``t`` goes to block ``slot // block_size``,
  offset ``slot % block_size``; a negative slot is padding and is not written.
* ``query_start_loc``: ``int32[S+1]``; sequence ``s`` owns the flat tokens
  ``query_start_loc[s]:query_start_loc[s+1]`` (its new tokens of this step).
* ``seq_lens``: ``int32[S]``; context length of ``s`` *after* this step, so new
  token ``i`` of ``s`` is at position ``seq_lens[s] - n_new + i``.
* ``block_tables``: ``int32[S, max_blocks]``; physical block ids in logical order.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from kvserve.cpu.prefetch import CACHE_LINE, prefetch_line
from kvserve.cpu.vector_math import exp_f32

# Numba's threading layer: OpenMP where this Numba build has it, else
# workqueue. Entering a parallel region costs 1.3 us with OpenMP and 90 us
# with workqueue on the 2-core machine (workqueue parks its threads, and
# waking them is the cost), so with OpenMP even a decode step's small
# products and attention run on all cores. OpenMP's threads spin for a
# while after a region and then steal the cores from OpenBLAS's threads
# (measured once: a decode step of 8 sequences took 490 ms instead of 100);
# kvserve.thread_env (applied by the CLI first) caps that spin (GOMP_SPINCOUNT) and
# OpenBLAS's (OPENBLAS_THREAD_TIMEOUT) before either library loads.
numba.config.THREADING_LAYER_PRIORITY = ["omp", "workqueue", "tbb"]
numba.config.THREADING_LAYER = "default"


def _has_openmp_layer() -> bool:
    try:
        from numba.np.ufunc import omppool  # noqa: F401
    except ImportError:
        return False
    return True


#: True when parallel regions are cheap (the OpenMP layer): the parallel
#: thresholds of the ops (``parallel.PARALLEL_MIN_MACS``,
#: ``ops.ATTENTION_PARALLEL_MIN_MACS``) follow it.
CHEAP_PARALLEL_REGIONS = _has_openmp_layer()

# Fast-math flags for the dot products of attention: reassociation lets LLVM
# vectorize the float32 reductions.  "nnan"/"ninf" are deliberately absent:
# the online softmax starts from -inf.  Accuracy is checked in
# tests/cpu/test_kernels.py (relative error < 1e-5 against a float64 reference).
_ATTN_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}

# Queries of one sequence processed together by one parallel work item.  Each
# key/value block is loaded once per tile (it stays in L1 while the tile's
# rows go over it).
DEFAULT_TILE_Q = 16


# --------------------------------------------------------------------------- #
# Element-wise / row-wise kernels
# --------------------------------------------------------------------------- #


@njit(nogil=True, cache=True)
def rms_norm_kernel(x, weight, eps, out):
    """out[t] = x[t] / sqrt(mean(x[t]**2) + eps) * weight (HF LlamaRMSNorm).

    x, out: float32[T, H] (out may not alias x); weight: float32[H]; eps: float.
    The sum of squares is accumulated in float64.
    """
    T, H = x.shape
    for t in range(T):
        ss = 0.0
        for i in range(H):
            xi = np.float64(x[t, i])
            ss += xi * xi
        inv = np.float32(1.0 / np.sqrt(ss / H + eps))
        for i in range(H):
            out[t, i] = (x[t, i] * inv) * weight[i]


@njit(nogil=True, cache=True)
def fused_add_rms_norm_kernel(x, residual, weight, eps):
    """In place: residual += x; x = rms_norm(residual) (vLLM's fused_add_rms_norm).

    x, residual: float32[T, H], distinct buffers; weight: float32[H].
    """
    T, H = x.shape
    for t in range(T):
        ss = 0.0
        for i in range(H):
            r = residual[t, i] + x[t, i]
            residual[t, i] = r
            rd = np.float64(r)
            ss += rd * rd
        inv = np.float32(1.0 / np.sqrt(ss / H + eps))
        for i in range(H):
            x[t, i] = (residual[t, i] * inv) * weight[i]


@njit(nogil=True, cache=True)
def rotary_kernel(positions, x, cos_sin_cache):
    """In-place rotary embedding, NeoX / HF ``rotate_half`` style.

    positions: int64[T]; x: float32[T, n_heads, head_dim];
    cos_sin_cache: float32[max_position, head_dim] with cos in the first half
    and sin in the second half of each row.  For each head, with
    x1 = x[..., :hd/2], x2 = x[..., hd/2:]:
    x1' = x1*cos - x2*sin, x2' = x2*cos + x1*sin
    (= x*cos + rotate_half(x)*sin of HF's apply_rotary_pos_emb).
    Raises ValueError for a position outside [0, max_position).
    """
    T, n, hd = x.shape
    half = hd // 2
    max_pos = cos_sin_cache.shape[0]
    for t in range(T):
        p = positions[t]
        if p < 0 or p >= max_pos:
            raise ValueError("rotary_embedding: position out of range of cos_sin_cache")
        for h in range(n):
            for i in range(half):
                c = cos_sin_cache[p, i]
                s = cos_sin_cache[p, half + i]
                x1 = x[t, h, i]
                x2 = x[t, h, half + i]
                x[t, h, i] = x1 * c - x2 * s
                x[t, h, half + i] = x2 * c + x1 * s


@njit(nogil=True, cache=True, error_model="numpy")
def silu_and_mul_kernel(x, out):
    """out = silu(x[:, :I]) * x[:, I:], silu(a) = a / (1 + exp(-a)).

    x: float32[T, 2*I]; out: float32[T, I]. ``error_model="numpy"``: with
    Python's, each division checks for a zero divisor and raises, and that
    branch kept the loop scalar (4.8 ns an element; 0.5 packed, the same
    bits; 1 + exp(-a) is never 0).
    """
    T, I = out.shape
    for t in range(T):
        for i in range(I):
            a = x[t, i]
            out[t, i] = a / (np.float32(1.0) + exp_f32(-a)) * x[t, I + i]


@njit(nogil=True, cache=True)
def gelu_tanh_and_mul_kernel(x, out):
    """out = gelu_tanh(x[:, :I]) * x[:, I:] (GeGLU), with PyTorch's
    ``gelu(approximate="tanh")``: 0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3))).

    x: float32[T, 2*I]; out: float32[T, I]. float32 arithmetic, as PyTorch's
    CPU kernel for float32; for |a| large the cube overflows to +-inf, tanh
    gives +-1 and the result is a or 0, as in float64.
    """
    T, I = out.shape
    beta = np.float32(np.sqrt(2.0 / np.pi))
    kappa = np.float32(0.044715)
    half = np.float32(0.5)
    one = np.float32(1.0)
    for t in range(T):
        for i in range(I):
            a = x[t, i]
            inner = beta * (a + kappa * a * a * a)
            out[t, i] = half * a * (one + np.tanh(inner)) * x[t, I + i]


@njit(nogil=True, cache=True)
def quantize_kv_vector(x, codes, scales):
    """Store float32[hd] ``x`` as int8 codes and a float32 scale
    (``kvserve.model.kv_quant.quantize``, bit for bit): ``s = max|x| / 127``,
    ``codes[:hd] = clip(rint(x * (127 / max|x|)), -127, 127)`` (half to
    even); a zero vector gets ``s = 0`` and zero codes.

    codes: int8[hd + 4], the vector's slot in the cache; scales: its float32
    view, float32[(hd + 4) / 4] (``scales[hd // 4]`` receives ``s``). A NaN
    in ``x`` gives the scale NaN (and zero codes), as the reference's scale.
    """
    hd = x.shape[0]
    amax = np.float32(0.0)
    for d in range(hd):
        a = abs(x[d])
        if not a <= amax:  # a NaN wins, as in np.abs(x).max()
            amax = a
    inv = np.float32(0.0)
    if amax > np.float32(0.0):
        inv = np.float32(127.0) / amax
    for d in range(hd):
        c = np.rint(x[d] * inv)
        if c > np.float32(127.0):
            c = np.float32(127.0)
        elif c < np.float32(-127.0):
            c = np.float32(-127.0)
        elif c != c:
            c = np.float32(0.0)
        codes[d] = np.int8(c)
    scales[hd // 4] = amax / np.float32(127.0)


@njit(nogil=True, cache=True)
def write_kv_kernel(k, v, kv_cache, slot_mapping, kv_scales=None):
    """Scatter new K/V rows into the paged cache.

    k, v: float32[T, num_kv_heads, head_dim]; kv_cache: float32[num_blocks, 2,
    block_size, num_kv_heads, head_dim], or int8[..., head_dim + 4] with
    ``kv_scales`` its float32 view (each vector quantized by
    :func:`quantize_kv_vector`); slot_mapping: int64[T] (negative = skip).
    Raises ValueError for a slot beyond the cache.
    """
    T, nkv, hd = k.shape
    nb = kv_cache.shape[0]
    bs = kv_cache.shape[2]
    for t in range(T):
        slot = slot_mapping[t]
        if slot < 0:
            continue
        b = slot // bs
        o = slot - b * bs
        if b >= nb:
            raise ValueError("write_kv: slot beyond the KV cache")
        for h in range(nkv):
            if kv_scales is None:
                for d in range(hd):
                    kv_cache[b, 0, o, h, d] = k[t, h, d]
                    kv_cache[b, 1, o, h, d] = v[t, h, d]
            else:
                quantize_kv_vector(k[t, h], kv_cache[b, 0, o, h], kv_scales[b, 0, o, h])
                quantize_kv_vector(v[t, h], kv_cache[b, 1, o, h], kv_scales[b, 1, o, h])


# --------------------------------------------------------------------------- #
# Dense float32 GEMV (decode-sized linear layers)
# --------------------------------------------------------------------------- #


@njit(nogil=True, cache=True, fastmath=_ATTN_FASTMATH)
def f32_gemv_range(x, w, out, lo, hi):
    """out[:, n] = x @ w[n] for the channels n in [lo, hi), four at a time.

    x: float32[M, K]; w: float32[N, K]; out: float32[M, N]. Register tiles
    of four weight rows and four rows of x (16 float32 reductions over K,
    so that each load of a weight value serves four rows and each load of x
    four channels), then a 2 x 4 and a 1 x 4 tile for the last rows; the
    four weight rows stay in L1 while the rows of x pass. Memory-bound for
    a decode step's one or two rows, like BLAS sgemv, but with no BLAS
    thread pool to wake (see ``CpuOps.linear``); the 4-row tile is for
    speculative verification chunks and small decode batches, which the
    2 x 4 tile left bound by loads (``tools/bench_kernels.py --gemv-rows``,
    record ``docs/benchmarks/2026-12-06-attention-four-keys.json``).
    """
    M, K = x.shape
    last = w.shape[0] - 1
    for n0 in range(lo, hi, 4):
        n1, n2, n3 = min(n0 + 1, last), min(n0 + 2, last), min(n0 + 3, last)
        m = 0
        while m + 4 <= M:
            _tile_4x4(x, m, w, n0, n1, n2, n3, out, hi)
            m += 4
        if m + 2 <= M:
            _tile_2x4(x, m, w, n0, n1, n2, n3, out, hi)
            m += 2
        if m < M:
            a0, a1, a2, a3 = _row_dot4(x, m, w, n0, n1, n2, n3)
            _store4(out, m, n0, hi, a0, a1, a2, a3)


@njit(nogil=True, cache=True, fastmath=_ATTN_FASTMATH, inline="always")
def _tile_4x4(x, m, w, n0, n1, n2, n3, out, hi):
    """out[m:m + 4, n0:n0 + 4] (channels below ``hi``): rows m..m+3 of x
    against weight rows n0..n3, 16 reductions over K."""
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
    c0 = c1 = c2 = c3 = e0 = e1 = e2 = e3 = np.float32(0.0)
    for k in range(x.shape[1]):
        w0 = w[n0, k]
        w1 = w[n1, k]
        w2 = w[n2, k]
        w3 = w[n3, k]
        xa = x[m, k]
        xb = x[m + 1, k]
        xc = x[m + 2, k]
        xe = x[m + 3, k]
        a0 += xa * w0
        a1 += xa * w1
        a2 += xa * w2
        a3 += xa * w3
        b0 += xb * w0
        b1 += xb * w1
        b2 += xb * w2
        b3 += xb * w3
        c0 += xc * w0
        c1 += xc * w1
        c2 += xc * w2
        c3 += xc * w3
        e0 += xe * w0
        e1 += xe * w1
        e2 += xe * w2
        e3 += xe * w3
    _store4(out, m, n0, hi, a0, a1, a2, a3)
    _store4(out, m + 1, n0, hi, b0, b1, b2, b3)
    _store4(out, m + 2, n0, hi, c0, c1, c2, c3)
    _store4(out, m + 3, n0, hi, e0, e1, e2, e3)


@njit(nogil=True, cache=True, fastmath=_ATTN_FASTMATH, inline="always")
def _tile_2x4(x, m, w, n0, n1, n2, n3, out, hi):
    """out[m:m + 2, n0:n0 + 4] (channels below ``hi``): 8 reductions over K."""
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
    for k in range(x.shape[1]):
        w0 = w[n0, k]
        w1 = w[n1, k]
        w2 = w[n2, k]
        w3 = w[n3, k]
        xa = x[m, k]
        xb = x[m + 1, k]
        a0 += xa * w0
        a1 += xa * w1
        a2 += xa * w2
        a3 += xa * w3
        b0 += xb * w0
        b1 += xb * w1
        b2 += xb * w2
        b3 += xb * w3
    _store4(out, m, n0, hi, a0, a1, a2, a3)
    _store4(out, m + 1, n0, hi, b0, b1, b2, b3)


@njit(nogil=True, cache=True, inline="always")
def _store4(out, m, n0, hi, a0, a1, a2, a3):
    """out[m, n0:n0 + 4] = a0..a3, the channels below ``hi`` only."""
    out[m, n0] = a0
    if n0 + 1 < hi:
        out[m, n0 + 1] = a1
    if n0 + 2 < hi:
        out[m, n0 + 2] = a2
    if n0 + 3 < hi:
        out[m, n0 + 3] = a3


@njit(nogil=True, cache=True)
def _panel_span(c, n_chunks, n):
    """Channels [lo, hi) of chunk c of n_chunks: whole groups of four, spread evenly."""
    groups = (n + 3) // 4
    return c * groups // n_chunks * 4, min((c + 1) * groups // n_chunks * 4, n)


@njit(nogil=True, cache=True, fastmath=_ATTN_FASTMATH, inline="always")
def _row_dot4(x, m, w, n0, n1, n2, n3):
    """x[m] . w[n] for n in (n0, n1, n2, n3): four float32 reductions over K
    sharing each x load (the 1 x 4 tile)."""
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for k in range(x.shape[1]):
        xk = x[m, k]
        a0 += xk * w[n0, k]
        a1 += xk * w[n1, k]
        a2 += xk * w[n2, k]
        a3 += xk * w[n3, k]
    return a0, a1, a2, a3


@njit(nogil=True, cache=True, fastmath=_ATTN_FASTMATH)
def f32_gemv_rows_range(x, w, out, lo, hi):
    """:func:`f32_gemv_range`'s result, each row by the same code: a 1 x 4
    tile per row (four reductions over K sharing each x load), so that a
    row's sums do not depend on the row count or the row's place in ``x``
    (the 2 x 4 tile is compiled differently from the last odd row's 1 x 4
    tile, and they round differently). ``CpuOps(batch_invariant=True)``.

    x: float32[M, K]; w: float32[N, K]; out: float32[M, N].
    """
    M, K = x.shape
    last = w.shape[0] - 1
    for n0 in range(lo, hi, 4):
        n1, n2, n3 = min(n0 + 1, last), min(n0 + 2, last), min(n0 + 3, last)
        for m in range(M):
            a0, a1, a2, a3 = _row_dot4(x, m, w, n0, n1, n2, n3)
            _store4(out, m, n0, hi, a0, a1, a2, a3)


@njit(nogil=True, cache=True, parallel=True)
def f32_gemv_parallel(x, w, out, n_chunks, per_row):
    """:func:`f32_gemv_range` (``per_row``: :func:`f32_gemv_rows_range`) over
    all channels in ``n_chunks`` parallel ranges of whole groups of four."""
    for c in prange(n_chunks):
        lo, hi = _panel_span(c, n_chunks, w.shape[0])
        if per_row:
            f32_gemv_rows_range(x, w, out, lo, hi)
        else:
            f32_gemv_range(x, w, out, lo, hi)


# --------------------------------------------------------------------------- #
# Paged attention
# --------------------------------------------------------------------------- #


@njit(nogil=True, cache=True, inline="always")
def _prefetch_block(kv_cache, pb, kvh):
    """Prefetch the K and V vectors of KV head ``kvh`` in cache block ``pb``
    (``prefetch.prefetch_line``): the next block of a tile, read while this
    one is computed (blocks lie anywhere in the cache, so the hardware
    prefetchers cannot follow a block table). Measured for 32 sequences of
    200 over 30 caches in turn (``tools/bench_kernels.py --layers 30``):
    1.033 -> 0.912 ms a layer on two threads, 1.731 -> 1.646 on one
    (record ``docs/benchmarks/2026-12-06-attention-prefetch.json``)."""
    st = kv_cache.strides
    vector_bytes = kv_cache.shape[4] * kv_cache.itemsize
    head = kv_cache.ctypes.data + pb * st[0] + kvh * st[3]
    for half in range(2):
        for j in range(kv_cache.shape[2]):
            at = head + half * st[1] + j * st[2]
            for off in range(0, vector_bytes, CACHE_LINE):
                prefetch_line(at + off)


@njit(nogil=True, cache=True, fastmath=_ATTN_FASTMATH, inline="always")
def _scores(qbuf, r, kc, kvh, j0, lim, p, kv_scales, pb):
    """p[j] = qbuf[r] . K[j] for the keys j0 <= j < lim of one block
    (``kc``: its K vectors, [block_size, num_kv_heads, head_dim]); four keys
    at a time, so that each load of a query value serves four products (and
    the four horizontal sums overlap). An int8 block's codes are converted as
    they are read and each sum scaled by its key's scale."""
    hd = qbuf.shape[1]
    sidx = hd // 4
    j = j0
    while j + 4 <= lim:
        s0 = s1 = s2 = s3 = np.float32(0.0)
        for d in range(hd):
            qd = qbuf[r, d]
            s0 += qd * np.float32(kc[j, kvh, d])
            s1 += qd * np.float32(kc[j + 1, kvh, d])
            s2 += qd * np.float32(kc[j + 2, kvh, d])
            s3 += qd * np.float32(kc[j + 3, kvh, d])
        p[j] = s0
        p[j + 1] = s1
        p[j + 2] = s2
        p[j + 3] = s3
        j += 4
    while j < lim:
        s = np.float32(0.0)
        for d in range(hd):
            s += qbuf[r, d] * np.float32(kc[j, kvh, d])
        p[j] = s
        j += 1
    if kv_scales is not None:
        for j in range(j0, lim):
            p[j] *= kv_scales[pb, 0, j, kvh, sidx]


@njit(nogil=True, cache=True, fastmath=_ATTN_FASTMATH, inline="always")
def _accumulate_values(acc, r, vc, kvh, j0, lim, p):
    """acc[r] += sum of p[j] V[j] over the keys j0 <= j < lim of one block
    (``vc``: its V vectors); four keys per pass over ``acc[r]``, so that the
    row is loaded and stored once per four keys (one pass per key made each
    pass wait for the last one's stores). An int8 block's codes are
    converted as they are read (``p`` then holds the value scales too)."""
    hd = acc.shape[1]
    j = j0
    while j + 4 <= lim:
        p0 = p[j]
        p1 = p[j + 1]
        p2 = p[j + 2]
        p3 = p[j + 3]
        for d in range(hd):
            acc[r, d] += (p0 * np.float32(vc[j, kvh, d]) + p1 * np.float32(vc[j + 1, kvh, d])
                          + p2 * np.float32(vc[j + 2, kvh, d])
                          + p3 * np.float32(vc[j + 3, kvh, d]))
        j += 4
    while j < lim:
        pj = p[j]
        for d in range(hd):
            acc[r, d] += pj * np.float32(vc[j, kvh, d])
        j += 1


@njit(nogil=True, cache=True, fastmath=_ATTN_FASTMATH)
def _attend_tile(q, kv_cache, block_table, scale, t0, nq, pos0, kvh, group, out, window,
                 kv_scales=None):
    """Causal attention of queries q[t0:t0+nq] (heads of kv group ``kvh``).

    The queries are at consecutive positions pos0..pos0+nq-1 and attend to
    positions 0..own position (``window`` > 0: own position - window + 1 ..
    own position), read from the blocks listed in block_table. A key before
    a row's window is never read, and neither is a block before the first
    query's window (its block-table entry may be stale).
    Online (streaming) softmax over key blocks: per row a running max m, a
    running denominator l and an unnormalized accumulator acc; per block
    and row the scores (:func:`_scores`, four keys at a time), their
    exponentials by ``vector_math.exp_f32`` (a packed loop: ``np.exp`` was a
    libm call per key) and the values (:func:`_accumulate_values`, four
    keys per pass). Measured with ``tools/bench_kernels.py`` (record
    ``docs/benchmarks/2026-12-06-attention-four-keys.json``).
    An int8 cache (``kv_scales`` its float32 view) is dequantized as it is
    read: a key's score is ``s_k * sum(q_d * c_d)``, a value adds
    ``(p * s_v) * c_d``; codes are converted to float32 in the inner loops,
    which vectorize as the float32 ones do.
    """
    hd = q.shape[2]
    sidx = hd // 4  # the scale's index in a float32 view of an int8 vector
    bs = kv_cache.shape[2]
    R = nq * group
    qbuf = np.empty((R, hd), np.float32)
    for qi in range(nq):
        for g in range(group):
            for d in range(hd):
                qbuf[qi * group + g, d] = q[t0 + qi, kvh * group + g, d] * scale
    m = np.full(R, -np.inf, np.float32)
    l = np.zeros(R, np.float32)
    acc = np.zeros((R, hd), np.float32)
    p = np.empty(bs, np.float32)

    pos_last = pos0 + nq - 1
    n_blocks = pos_last // bs + 1
    first_key = 0  # the first query's first visible key
    if window > 0 and pos0 - window + 1 > 0:
        first_key = pos0 - window + 1
    for b in range(first_key // bs, n_blocks):
        pb = block_table[b]
        kstart = b * bs
        nk = min(bs, pos_last + 1 - kstart)
        kc = kv_cache[pb, 0]
        vc = kv_cache[pb, 1]
        if b + 1 < n_blocks:
            _prefetch_block(kv_cache, block_table[b + 1], kvh)
        for r in range(R):
            # keys j0 .. lim - 1 of this block are visible to row r (causal
            # mask, and the sliding window)
            lim = pos0 + r // group - kstart + 1
            if lim > nk:
                lim = nk
            if lim <= 0:
                continue
            j0 = 0
            if window > 0:
                j0 = pos0 + r // group - window + 1 - kstart
                if j0 < 0:
                    j0 = 0
                if j0 >= lim:
                    continue
            _scores(qbuf, r, kc, kvh, j0, lim, p, kv_scales, pb)
            bmax = p[j0]
            for j in range(j0 + 1, lim):
                if p[j] > bmax:
                    bmax = p[j]
            m_old = m[r]
            m_new = m_old if m_old > bmax else bmax
            alpha = exp_f32(m_old - m_new)  # exp(-inf) = 0 on the first block
            psum = np.float32(0.0)
            for j in range(j0, lim):
                e = exp_f32(p[j] - m_new)
                p[j] = e
                psum += e
            l[r] = l[r] * alpha + psum
            m[r] = m_new
            for d in range(hd):
                acc[r, d] *= alpha
            if kv_scales is not None:
                for j in range(j0, lim):
                    p[j] *= kv_scales[pb, 1, j, kvh, sidx]
            _accumulate_values(acc, r, vc, kvh, j0, lim, p)
    for qi in range(nq):
        for g in range(group):
            r = qi * group + g
            inv = np.float32(1.0) / l[r]
            for d in range(hd):
                out[t0 + qi, kvh * group + g, d] = acc[r, d] * inv


@njit(nogil=True, cache=True, parallel=True)
def paged_attention_kernel(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, tile_q,
                           n_threads, out, window=0, kv_scales=None):
    """Causal attention over the paged KV cache for a flat varlen batch.

    q: float32[T, num_heads, head_dim]; kv_cache: float32[num_blocks, 2,
    block_size, num_kv_heads, head_dim]; block_tables: int32[S, max_blocks];
    seq_lens: int32[S]; query_start_loc: int32[S+1]; scale: float (usually
    head_dim**-0.5); tile_q: int, queries per work item; n_threads: int,
    numba.get_num_threads() of the caller (passed in: reading it inside the
    kernel would stop Numba from caching it); out: float32[T,
    num_heads, head_dim], must be zero-filled by the caller (rows of tokens
    owned by no sequence are left untouched); window: int, 0 = full causal
    attention, else each query sees its last ``window`` positions only
    (``kvserve.model.ops``: blocks before a sequence's window are neither
    read nor checked); kv_scales: None, or with an int8 ``kv_cache``
    [..., head_dim + 4] its float32 view (module docstring).

    GQA: query head h reads kv head h // (num_heads // num_kv_heads).  Work is
    split into (query tile, kv head) items, dealt longest-first to the Numba
    threads so causal prefill tiles balance.
    Raises ValueError on inconsistent metadata or block ids out of range.
    """
    plan = _plan_tiles(q, kv_cache, block_tables, seq_lens, query_start_loc, tile_q, window)
    n_workers = max(1, min(n_threads, plan[4].shape[0] * kv_cache.shape[3]))
    for w in prange(n_workers):
        _attend_share(w, n_workers, plan, q, kv_cache, block_tables, scale, out, window,
                      kv_scales)


@njit(nogil=True, cache=True)
def paged_attention_kernel_serial(q, kv_cache, block_tables, seq_lens, query_start_loc, scale,
                                  tile_q, out, window=0, kv_scales=None):
    """:func:`paged_attention_kernel` on the calling thread alone: no Numba
    parallel region, whose entry (50-120 us) costs more than a few decode
    rows' attention. Same arguments but ``n_threads``."""
    plan = _plan_tiles(q, kv_cache, block_tables, seq_lens, query_start_loc, tile_q, window)
    _attend_share(0, 1, plan, q, kv_cache, block_tables, scale, out, window, kv_scales)


@njit(nogil=True, cache=True)
def _plan_tiles(q, kv_cache, block_tables, seq_lens, query_start_loc, tile_q, window):
    """Validate the metadata and cut it into query tiles: ``(tile_seq, tile_t0,
    tile_nq, tile_pos0, order)``, ``order`` the tiles longest first. With a
    ``window`` > 0 the blocks before a sequence's first window are not
    checked (they are not read) and a tile's cost counts its window only."""
    T = q.shape[0]
    nb = kv_cache.shape[0]
    bs = kv_cache.shape[2]
    S = seq_lens.shape[0]
    max_blocks = block_tables.shape[1]

    # Validation (serial, O(S * blocks)) and tile count.
    n_tiles = 0
    for s in range(S):
        q0 = query_start_loc[s]
        q1 = query_start_loc[s + 1]
        n_new = q1 - q0
        if q0 < 0 or n_new < 0 or q1 > T:
            raise ValueError("paged_attention: query_start_loc must be non-decreasing within [0, T]")
        if n_new == 0:
            continue
        L = seq_lens[s]
        if L < n_new:
            raise ValueError("paged_attention: seq_lens[s] smaller than the sequence's new tokens")
        n_blk = (L + bs - 1) // bs
        if n_blk > max_blocks:
            raise ValueError("paged_attention: block_tables too narrow for seq_lens")
        b_lo = 0
        if window > 0 and L - n_new - window + 1 > 0:
            b_lo = (L - n_new - window + 1) // bs
        for b in range(b_lo, n_blk):
            pb = block_tables[s, b]
            if pb < 0 or pb >= nb:
                raise ValueError("paged_attention: block id out of range of the KV cache")
        n_tiles += (n_new + tile_q - 1) // tile_q

    tile_seq = np.empty(n_tiles, np.int64)
    tile_t0 = np.empty(n_tiles, np.int64)
    tile_nq = np.empty(n_tiles, np.int64)
    tile_pos0 = np.empty(n_tiles, np.int64)
    cost = np.empty(n_tiles, np.int64)
    i = 0
    for s in range(S):
        q0 = query_start_loc[s]
        q1 = query_start_loc[s + 1]
        n_new = q1 - q0
        first_pos = seq_lens[s] - n_new
        t = q0
        while t < q1:
            nq = min(tile_q, q1 - t)
            tile_seq[i] = s
            tile_t0[i] = t
            tile_nq[i] = nq
            tile_pos0[i] = first_pos + (t - q0)
            cost[i] = nq * ((tile_pos0[i] if window <= 0 else min(tile_pos0[i], window)) + nq)
            i += 1
            t += nq
    return tile_seq, tile_t0, tile_nq, tile_pos0, np.argsort(-cost)


@njit(nogil=True, cache=True)
def _attend_share(w, n_workers, plan, q, kv_cache, block_tables, scale, out, window,
                  kv_scales):
    """Worker w's share of the (tile, kv head) items, dealt longest first in
    snake order (Numba's scheduler splits a prange into equal contiguous
    chunks, which would give all the long causal tiles to one thread)."""
    tile_seq, tile_t0, tile_nq, tile_pos0, order = plan
    nkv = kv_cache.shape[3]
    group = q.shape[1] // nkv
    n_items = order.shape[0] * nkv
    k = 0
    while True:
        rnd = k // n_workers
        lane = k - rnd * n_workers
        mine = lane if rnd % 2 == 0 else n_workers - 1 - lane
        if k >= n_items:
            break
        if mine == w:
            ti = order[k // nkv]
            kvh = k % nkv
            _attend_tile(q, kv_cache, block_tables[tile_seq[ti]], scale, tile_t0[ti],
                         tile_nq[ti], tile_pos0[ti], kvh, group, out, window, kv_scales)
        k += 1
