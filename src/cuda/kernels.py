"""Numba ``@cuda.jit`` kernels of the CUDA backend.

One kernel per job; :class:`kvserve.cuda.ops.CudaOps` checks every argument
(shapes, dtypes, contiguity, index ranges) and chooses the launch
configuration, so the kernels trust their inputs: a kernel cannot raise on a
GPU, and an index out of range would corrupt memory silently.

Dtypes: activations, weights and the KV cache are float32 or float16; every
kernel converts to float32 on load, accumulates in float32 and rounds once on
store.  bfloat16 is not a kernel dtype: the backend converts bf16 checkpoints
to float16 when it loads them (``CudaOps.to_device``).

Launch mappings are 1-D blocks of any size up to :data:`MAX_BLOCK_THREADS`
(2-D for the int8 matmuls): loops stride over the work by ``blockDim``, so the
same kernel runs with a warp-multiple block on a GPU and with a handful of
threads under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), where each
CUDA thread is a Python thread and the tests run.  The mappings are the
readable baseline (scalar float32 FMAs, no tensor cores, no vectorized loads);
each kernel's docstring states its grid, block and barriers.

KV cache and attention metadata follow vLLM's paged layout
(``kvserve.model.ops``): ``kv_cache[num_blocks, 2, block_size, nkv, hd]``
(axis 1: 0 = K, 1 = V), token position ``j`` of sequence ``s`` lives in block
``block_tables[s, j // block_size]`` at offset ``j % block_size``.
"""

from __future__ import annotations

import math

from numba import cuda, float32, int32

#: Largest 1-D block a launch may use: sizes the shared reduction buffers.
MAX_BLOCK_THREADS = 256
#: Largest head_dim of the attention kernels (per-thread q/acc rows, shared K/V tiles).
MAX_HEAD_DIM = 256
#: Largest split-K partition (keys) of decode attention: the shared logits buffer.
MAX_PARTITION_SIZE = 512
#: Keys per shared-memory K/V tile of prefill attention
#: (K + V tiles: 2 * 16 * 256 * 4 B = 32 KiB of static shared memory).
PREFILL_KV_TILE = 16
#: Most activation rows of the int8 GEMV (its per-thread accumulators).
GEMV_MAX_ROWS = 8
#: Output channels per GEMV block (threadIdx.y).
GEMV_OUT_TILE = 4
#: Most GEMV threads along K (threadIdx.x): GEMV_OUT_TILE * 64 = 256 threads.
GEMV_MAX_K_THREADS = MAX_BLOCK_THREADS // GEMV_OUT_TILE
#: Largest tile edge of the tiled int8 matmul: (16, 16) threads, 16x16 outputs.
MATMUL_TILE = 16
#: Shared tiles get one extra column so that reading a column does not hit one bank.
_PADDED_TILE = MATMUL_TILE + 1
#: Input channels per activation scale of the W8A8 matmul (a K that it does
#: not divide gets one group per row); equal to ``kvserve.cpu.int8.GROUP``,
#: a multiple of every tile edge up to MATMUL_TILE.
W8A8_GROUP = 64
#: Largest magnitude of a symmetric int8 code.
INT8_MAX = 127

_NEG_INF = float32(-math.inf)
_ZERO = float32(0.0)
_ONE = float32(1.0)


# --------------------------------------------------------------------------- #
# Scalar helpers and block reductions
# --------------------------------------------------------------------------- #


# Plain comparisons instead of the builtins min / max: Numba types those
# through generic overloads that its built-in CUDA target fails to compile
# (seen with ``cuda.compile_ptx``, numba 0.68).
@cuda.jit(device=True)
def _max(a, b):
    return a if a > b else b  # noqa: FURB136 (see above)


@cuda.jit(device=True)
def _min(a, b):
    return a if a < b else b  # noqa: FURB136 (see above)


@cuda.jit(device=True)
def _block_sum(buf, value):
    """Sum of ``value`` over the threads of a 1-D block.

    Each thread posts its value to ``buf`` (shared float32[>= blockDim.x]);
    after one barrier every thread folds all the posts, a broadcast read that
    is free of bank conflicts.  One barrier instead of the log2(n) of a tree:
    cheaper under the simulator, and a few hundred shared reads on a GPU.
    ``buf`` must not be written again before another barrier.
    """
    buf[cuda.threadIdx.x] = value
    cuda.syncthreads()
    total = _ZERO
    for i in range(cuda.blockDim.x):
        total += buf[i]
    return total


@cuda.jit(device=True)
def _block_max(buf, value):
    """Max of ``value`` over the threads of a 1-D block (as :func:`_block_sum`)."""
    buf[cuda.threadIdx.x] = value
    cuda.syncthreads()
    result = _NEG_INF
    for i in range(cuda.blockDim.x):
        result = _max(result, buf[i])
    return result


# --------------------------------------------------------------------------- #
# Row-wise kernels: one block per token row, threads stride over the row
# --------------------------------------------------------------------------- #


@cuda.jit
def embedding_kernel(token_ids, table, out):
    """out[t] = table[token_ids[t]].

    token_ids: int64[T] (checked in [0, V)); table, out: [V, H] / [T, H], same dtype.
    Mapping: grid (T,), threads stride over H (coalesced row copy).
    """
    t = cuda.blockIdx.x
    row = token_ids[t]
    for i in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
        out[t, i] = table[row, i]


@cuda.jit
def rms_norm_kernel(x, weight, eps, out):
    """out[t] = x[t] / sqrt(mean(x[t]**2) + eps) * weight (HF LlamaRMSNorm).

    x, out: [T, H] (distinct); weight: [H]; eps: float32.  Sum of squares in float32.
    Mapping: grid (T,), threads stride over H, one block reduction.
    """
    buf = cuda.shared.array(MAX_BLOCK_THREADS, float32)
    t = cuda.blockIdx.x
    H = x.shape[1]
    ss = _ZERO
    for i in range(cuda.threadIdx.x, H, cuda.blockDim.x):
        xi = float32(x[t, i])
        ss += xi * xi
    inv = _ONE / math.sqrt(_block_sum(buf, ss) / float32(H) + eps)
    for i in range(cuda.threadIdx.x, H, cuda.blockDim.x):
        out[t, i] = float32(x[t, i]) * inv * float32(weight[i])


@cuda.jit
def fused_add_rms_norm_kernel(x, residual, weight, eps):
    """In place: residual += x; x = rms_norm(residual) (vLLM's fused_add_rms_norm).

    x, residual: [T, H], distinct buffers of one dtype; weight: [H]; eps: float32.
    As in vLLM, the variance is taken from the float32 sum and the
    normalization reads the sum as stored (rounded to float16 for float16).
    Mapping: grid (T,), threads stride over H; each thread re-reads only the
    residual elements it wrote itself, so one block reduction is the only barrier.
    """
    buf = cuda.shared.array(MAX_BLOCK_THREADS, float32)
    t = cuda.blockIdx.x
    H = x.shape[1]
    ss = _ZERO
    for i in range(cuda.threadIdx.x, H, cuda.blockDim.x):
        r = float32(x[t, i]) + float32(residual[t, i])
        residual[t, i] = r
        ss += r * r
    inv = _ONE / math.sqrt(_block_sum(buf, ss) / float32(H) + eps)
    for i in range(cuda.threadIdx.x, H, cuda.blockDim.x):
        x[t, i] = float32(residual[t, i]) * inv * float32(weight[i])


@cuda.jit
def rotary_kernel(positions, x, cos_sin_cache):
    """In-place RoPE, NeoX / HF ``rotate_half``: element i pairs with i + hd/2.

    positions: int64[T] (checked in [0, max_position)); x: [T, n_heads, hd];
    cos_sin_cache: [max_position, hd], cos in the first half of a row and sin
    in the second (``build_rope_cache``; Llama 3 scaling is another table).
    x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin.
    Mapping: grid (T,), threads stride over the n_heads * hd/2 pairs.
    """
    t = cuda.blockIdx.x
    p = positions[t]
    half = x.shape[2] // 2
    for e in range(cuda.threadIdx.x, x.shape[1] * half, cuda.blockDim.x):
        h = e // half
        i = e - h * half
        c = float32(cos_sin_cache[p, i])
        s = float32(cos_sin_cache[p, half + i])
        x1 = float32(x[t, h, i])
        x2 = float32(x[t, h, half + i])
        x[t, h, i] = x1 * c - x2 * s
        x[t, h, half + i] = x2 * c + x1 * s


@cuda.jit
def silu_and_mul_kernel(x, out):
    """out = silu(x[:, :I]) * x[:, I:], silu(a) = a / (1 + exp(-a)).

    x: [T, 2I] (gate then up); out: [T, I], same dtype.
    Mapping: grid (T,), threads stride over I.
    """
    t = cuda.blockIdx.x
    inter = out.shape[1]
    for i in range(cuda.threadIdx.x, inter, cuda.blockDim.x):
        a = float32(x[t, i])
        out[t, i] = a / (_ONE + math.exp(-a)) * float32(x[t, inter + i])


@cuda.jit
def write_kv_kernel(k, v, kv_cache, slot_mapping):
    """Scatter new K/V rows into the paged cache (vLLM's reshape_and_cache).

    k, v: [T, nkv, hd] (any token stride: views of the fused qkv output);
    kv_cache: [num_blocks, 2, block_size, nkv, hd]; slot_mapping: int64[T],
    a negative slot is padding and is skipped (slots checked in range).
    Mapping: grid (T,), threads stride over nkv * hd.
    """
    t = cuda.blockIdx.x
    slot = slot_mapping[t]
    if slot < 0:
        return
    block_size = kv_cache.shape[2]
    b = slot // block_size
    o = slot - b * block_size
    hd = k.shape[2]
    for e in range(cuda.threadIdx.x, k.shape[1] * hd, cuda.blockDim.x):
        h = e // hd
        d = e - h * hd
        kv_cache[b, 0, o, h, d] = k[t, h, d]
        kv_cache[b, 1, o, h, d] = v[t, h, d]


# --------------------------------------------------------------------------- #
# Paged attention, decode: split-K ("flash decoding", vLLM paged_attention_v2)
# --------------------------------------------------------------------------- #


@cuda.jit
def decode_partition_kernel(q, kv_cache, block_tables, tokens, token_seq, token_ctx, scale,
                            partition_size, tmp_out, max_logits, exp_sums):
    """Attention of one query over one partition of its context.

    q: [T, nh, hd]; kv_cache as above; block_tables: int32[S, max_blocks];
    work item i is flat token ``tokens[i]`` of sequence ``token_seq[i]``,
    attending to context positions [0, token_ctx[i]); scale: float32;
    partition p covers positions [p * P, (p + 1) * P), P = partition_size <=
    MAX_PARTITION_SIZE.  Writes the partition's max logit, its sum of
    exp(logit - max) and its normalized output to max_logits[i, h, p],
    exp_sums[i, h, p] (float32[N, nh, parts]) and tmp_out[i, h, p]
    (float32[N, nh, parts, hd]); :func:`decode_reduce_kernel` combines them.

    Mapping: grid (N, nh, parts), block 1-D.  Logits: one thread per key
    (a full hd dot product; q is read from global memory, the same element by
    every lane at once: a broadcast load), kept in shared memory.  Output: one
    thread per head dimension, reading V rows coalesced.  Two barriers (the
    max and the sum reductions).  A partition past the token's context exits
    before any barrier, uniformly for the whole block.
    """
    logits = cuda.shared.array(MAX_PARTITION_SIZE, float32)
    red_max = cuda.shared.array(MAX_BLOCK_THREADS, float32)
    red_sum = cuda.shared.array(MAX_BLOCK_THREADS, float32)
    i, h, p = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
    tid, nthreads = cuda.threadIdx.x, cuda.blockDim.x
    start = p * partition_size
    ctx = token_ctx[i]
    if start >= ctx:
        return
    n_keys = _min(partition_size, ctx - start)
    t, s = tokens[i], token_seq[i]
    hd = q.shape[2]
    kvh = h // (q.shape[1] // kv_cache.shape[3])  # GQA: query head -> KV head
    block_size = kv_cache.shape[2]

    local_max = _NEG_INF
    for j in range(tid, n_keys, nthreads):
        pos = start + j
        blk = block_tables[s, pos // block_size]
        off = pos % block_size
        dot = _ZERO
        for d in range(hd):
            dot += float32(q[t, h, d]) * float32(kv_cache[blk, 0, off, kvh, d])
        logit = dot * scale
        logits[j] = logit
        local_max = _max(local_max, logit)
    m = _block_max(red_max, local_max)

    local_sum = _ZERO
    for j in range(tid, n_keys, nthreads):  # the keys this thread wrote
        e = math.exp(logits[j] - m)
        logits[j] = e
        local_sum += e
    denom = _block_sum(red_sum, local_sum)  # its barrier also publishes logits

    for d in range(tid, hd, nthreads):
        acc = _ZERO
        for j in range(n_keys):
            pos = start + j
            blk = block_tables[s, pos // block_size]
            acc += logits[j] * float32(kv_cache[blk, 1, pos % block_size, kvh, d])
        tmp_out[i, h, p, d] = acc / denom
    if tid == 0:
        max_logits[i, h, p] = m
        exp_sums[i, h, p] = denom


@cuda.jit
def decode_reduce_kernel(tmp_out, max_logits, exp_sums, tokens, token_ctx, partition_size, out):
    """Combine the partitions of :func:`decode_partition_kernel` into out[tokens[i], h].

    With M = max_p m_p and w_p = l_p exp(m_p - M):
    out = sum_p w_p o_p / sum_p w_p (o_p are the normalized partial outputs).
    out: [T, nh, hd] (q's dtype); the other arguments as the partition kernel's.
    Mapping: grid (N, nh), threads stride over hd.  Each thread recomputes
    the partition weights (a few per thousand keys) instead of staging them
    in shared memory: no barrier.
    """
    i, h = cuda.blockIdx.x, cuda.blockIdx.y
    n_parts = (token_ctx[i] + partition_size - 1) // partition_size
    m_all = _NEG_INF
    for p in range(n_parts):
        m_all = _max(m_all, max_logits[i, h, p])
    denom = _ZERO
    for p in range(n_parts):
        denom += exp_sums[i, h, p] * math.exp(max_logits[i, h, p] - m_all)
    t = tokens[i]
    for d in range(cuda.threadIdx.x, tmp_out.shape[3], cuda.blockDim.x):
        acc = _ZERO
        for p in range(n_parts):
            w = exp_sums[i, h, p] * math.exp(max_logits[i, h, p] - m_all)
            acc += w * tmp_out[i, h, p, d]
        out[t, h, d] = acc / denom


# --------------------------------------------------------------------------- #
# Paged attention, prefill chunks: query tiles over shared-memory K/V tiles
# --------------------------------------------------------------------------- #


@cuda.jit
def prefill_attention_kernel(q, kv_cache, block_tables, tile_seq, tile_t0, tile_nq, tile_pos0,
                             scale, out):
    """Causal attention of a tile of consecutive queries of one sequence.

    Tile i holds the flat tokens tile_t0[i] .. + tile_nq[i] - 1 (<= blockDim.x)
    of sequence tile_seq[i], at positions tile_pos0[i] ..; the query at
    position pos attends to context positions [0, pos], i.e. fully over the
    cached prefix and causally within the chunk.  q, out: [T, nh, hd];
    kv_cache, block_tables as above; scale: float32.

    Mapping: grid (tiles, nh), block 1-D: thread r owns query row r, with
    its scaled q row, running max, denominator and output row in registers /
    local memory (FlashAttention-2's online softmax, one row per thread).
    The block walks the context in tiles of PREFILL_KV_TILE keys: all threads
    load a K/V tile into shared memory (coalesced along hd), barrier, each
    row consumes the keys it may see, barrier.  Rows past tile_nq[i] only help
    load, so every thread reaches every barrier.
    """
    k_tile = cuda.shared.array((PREFILL_KV_TILE, MAX_HEAD_DIM), float32)
    v_tile = cuda.shared.array((PREFILL_KV_TILE, MAX_HEAD_DIM), float32)
    q_row = cuda.local.array(MAX_HEAD_DIM, float32)
    acc = cuda.local.array(MAX_HEAD_DIM, float32)
    scores = cuda.local.array(PREFILL_KV_TILE, float32)
    i, h = cuda.blockIdx.x, cuda.blockIdx.y
    r, nthreads = cuda.threadIdx.x, cuda.blockDim.x
    s, nq, pos0 = tile_seq[i], tile_nq[i], tile_pos0[i]
    t = tile_t0[i] + r
    active = r < nq
    pos = pos0 + r
    hd = q.shape[2]
    kvh = h // (q.shape[1] // kv_cache.shape[3])  # GQA: query head -> KV head
    block_size = kv_cache.shape[2]

    m = _NEG_INF
    denom = _ZERO
    if active:
        for d in range(hd):
            q_row[d] = float32(q[t, h, d]) * scale
            acc[d] = _ZERO

    n_ctx = pos0 + nq  # the last row's context
    for k0 in range(0, n_ctx, PREFILL_KV_TILE):
        nk = _min(PREFILL_KV_TILE, n_ctx - k0)
        for e in range(r, nk * hd, nthreads):
            j = e // hd
            d = e - j * hd
            kpos = k0 + j
            blk = block_tables[s, kpos // block_size]
            off = kpos % block_size
            k_tile[j, d] = float32(kv_cache[blk, 0, off, kvh, d])
            v_tile[j, d] = float32(kv_cache[blk, 1, off, kvh, d])
        cuda.syncthreads()
        visible = _min(nk, pos + 1 - k0)  # causal mask
        if active and visible > 0:
            tile_max = _NEG_INF
            for j in range(visible):
                dot = _ZERO
                for d in range(hd):
                    dot += q_row[d] * k_tile[j, d]
                scores[j] = dot
                tile_max = _max(tile_max, dot)
            m_new = _max(m, tile_max)
            alpha = math.exp(m - m_new)  # exp(-inf) = 0 on the first tile
            psum = _ZERO
            for j in range(visible):
                e_j = math.exp(scores[j] - m_new)
                scores[j] = e_j
                psum += e_j
            denom = denom * alpha + psum
            m = m_new
            for d in range(hd):
                a = acc[d] * alpha
                for j in range(visible):
                    a += scores[j] * v_tile[j, d]
                acc[d] = a
        cuda.syncthreads()

    if active:
        for d in range(hd):
            out[t, h, d] = acc[d] / denom


# --------------------------------------------------------------------------- #
# int8 weight-only matmul: y = (x @ w_q.T) * scales + bias
# --------------------------------------------------------------------------- #


@cuda.jit(device=True)
def _fold_lanes(partial, acc, T, o, n_out, scales, bias, out):
    """GEMV epilogue: sum each row's per-lane partials of output channel ``o``
    (lanes along threadIdx.x, channels along threadIdx.y) through shared
    ``partial``; out[t, o] = sum * scales[o] + bias[o]. All threads must call it."""
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    for t in range(T):
        partial[ty, t, tx] = acc[t]
    cuda.syncthreads()
    if o < n_out:
        for t in range(tx, T, cuda.blockDim.x):
            total = _ZERO
            for lane in range(cuda.blockDim.x):
                total += partial[ty, t, lane]
            out[t, o] = total * scales[o] + bias[o]


@cuda.jit
def int8_gemv_kernel(x, w_q, scales, bias, out):
    """Few-row int8 matmul: out[t, o] = scales[o] * sum_k x[t, k] w_q[o, k] + bias[o].

    x: [T, K] float16/float32, T <= GEMV_MAX_ROWS; w_q: int8[N, K];
    scales, bias: float32[N]; out: [T, N], x's dtype.  The weights are used
    as integers converted to float32 (exact), the products summed in
    float32, the scale applied once per output at the end.
    Mapping: grid (ceil(N / GEMV_OUT_TILE),), block (k_threads, GEMV_OUT_TILE):
    threadIdx.y picks an output channel, the threadIdx.x lanes stride along K
    (reading the weight row coalesced, each weight once for all T rows),
    then one barrier and lane t folds row t's partial sums.
    """
    partial = cuda.shared.array((GEMV_OUT_TILE, GEMV_MAX_ROWS, GEMV_MAX_K_THREADS), float32)
    acc = cuda.local.array(GEMV_MAX_ROWS, float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    lanes = cuda.blockDim.x
    T, K = x.shape
    o = cuda.blockIdx.x * GEMV_OUT_TILE + ty
    for t in range(T):
        acc[t] = _ZERO
    if o < w_q.shape[0]:
        for k in range(tx, K, lanes):
            w = float32(w_q[o, k])
            for t in range(T):
                acc[t] += float32(x[t, k]) * w
    _fold_lanes(partial, acc, T, o, w_q.shape[0], scales, bias, out)


@cuda.jit
def int8_matmul_tiled_kernel(x, w_q, scales, bias, out):
    """Many-row int8 matmul (same formula and arguments as :func:`int8_gemv_kernel`, any T).

    Mapping: grid (ceil(N / tile), ceil(T / tile)), block (tile, tile) with
    tile = blockDim.x <= MATMUL_TILE: thread (tx, ty) computes
    out[row0 + ty, col0 + tx].  Per step of ``tile`` along K the block
    stages an x tile and a weight tile in shared memory (both loads
    coalesced along K, weights converted to float32 once), barrier,
    ``tile`` multiply-adds per thread, barrier.
    """
    x_tile = cuda.shared.array((MATMUL_TILE, _PADDED_TILE), float32)
    w_tile = cuda.shared.array((MATMUL_TILE, _PADDED_TILE), float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    tile = cuda.blockDim.x
    T, K = x.shape
    N = w_q.shape[0]
    row = cuda.blockIdx.y * tile + ty
    col = cuda.blockIdx.x * tile + tx
    w_row = cuda.blockIdx.x * tile + ty  # the weight row this thread loads
    acc = _ZERO
    for k0 in range(0, K, tile):
        k = k0 + tx
        x_tile[ty, tx] = float32(x[row, k]) if row < T and k < K else _ZERO
        w_tile[ty, tx] = float32(w_q[w_row, k]) if w_row < N and k < K else _ZERO
        cuda.syncthreads()
        for kk in range(tile):
            acc += x_tile[ty, kk] * w_tile[tx, kk]
        cuda.syncthreads()
    if row < T and col < N:
        out[row, col] = acc * scales[col] + bias[col]


# --------------------------------------------------------------------------- #
# W8A8 matmul: int8 activations per (token, group), exact int32 group sums
# y = scales * sum_g x_scales[:, g] * (xq[:, group g] @ w_q[:, group g].T) + bias
# --------------------------------------------------------------------------- #


@cuda.jit
def quantize_groups_kernel(x, group, xq, x_scales):
    """Symmetric int8 per (row, group): x_scales[t, g] = max|x[t, group g]| / 127
    (1 for an all-zero group), xq = clip(rint(x / x_scales), -127, 127).

    x: [T, K] float16/float32; group: channels per scale (divides K);
    xq: int8[T, K]; x_scales: float32[T, K // group].  As
    ``kvserve.cpu.int8._quantize_groups`` (bit for bit on the same x): the
    code is rint(x * (1 / scale)), round half to even, in float32.
    Mapping: grid (T, K // group), threads stride over the group; one block
    max reduction.
    """
    buf = cuda.shared.array(MAX_BLOCK_THREADS, float32)
    t, g = cuda.blockIdx.x, cuda.blockIdx.y
    k0 = g * group
    local = _ZERO
    for k in range(k0 + cuda.threadIdx.x, k0 + group, cuda.blockDim.x):
        local = _max(local, abs(float32(x[t, k])))
    absmax = _block_max(buf, local)
    scale = absmax / float32(INT8_MAX) if absmax > _ZERO else _ONE
    inv = _ONE / scale
    for k in range(k0 + cuda.threadIdx.x, k0 + group, cuda.blockDim.x):
        q = round(float32(x[t, k]) * inv)  # round half to even (llrint on a GPU)
        xq[t, k] = _min(_max(q, -INT8_MAX), INT8_MAX)
    if cuda.threadIdx.x == 0:
        x_scales[t, g] = scale


@cuda.jit
def w8a8_gemv_kernel(xq, x_scales, group, w_q, scales, bias, out):
    """Few-row W8A8 matmul: out[t, o] = scales[o] * sum_g x_scales[t, g] *
    acc[t, o, g] + bias[o], acc the exact int32 sum over group g of
    xq[t, k] * w_q[o, k].

    xq: int8[T, K], T <= GEMV_MAX_ROWS; x_scales: float32[T, K // group];
    w_q: int8[N, K]; scales, bias: float32[N]; out: [T, N], float16/float32.
    Each group's int32 sum is converted to float32 once (exact below 2**24),
    times its activation scale, the groups summed in float32.
    Mapping: grid (ceil(N / GEMV_OUT_TILE),), block (k_threads, GEMV_OUT_TILE):
    threadIdx.y picks an output channel, the threadIdx.x lanes stride over
    whole groups (each lane reads a group's weights once for all T rows),
    then one barrier and lane t folds row t's partial sums.
    """
    partial = cuda.shared.array((GEMV_OUT_TILE, GEMV_MAX_ROWS, GEMV_MAX_K_THREADS), float32)
    acc = cuda.local.array(GEMV_MAX_ROWS, float32)
    iacc = cuda.local.array(GEMV_MAX_ROWS, int32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    lanes = cuda.blockDim.x
    T, K = xq.shape
    o = cuda.blockIdx.x * GEMV_OUT_TILE + ty
    for t in range(T):
        acc[t] = _ZERO
    if o < w_q.shape[0]:
        for g in range(tx, K // group, lanes):
            for t in range(T):
                iacc[t] = 0
            for k in range(g * group, (g + 1) * group):
                w = int32(w_q[o, k])
                for t in range(T):
                    iacc[t] = int32(iacc[t] + int32(xq[t, k]) * w)
            for t in range(T):
                acc[t] += float32(iacc[t]) * x_scales[t, g]
    _fold_lanes(partial, acc, T, o, w_q.shape[0], scales, bias, out)


@cuda.jit
def w8a8_matmul_tiled_kernel(xq, x_scales, group, w_q, scales, bias, out):
    """Many-row W8A8 matmul (same formula and arguments as :func:`w8a8_gemv_kernel`, any T).

    Mapping: grid (ceil(N / tile), ceil(T / tile)), block (tile, tile) with
    tile = blockDim.x <= MATMUL_TILE, and group a multiple of tile or K
    itself: thread (tx, ty) computes out[row0 + ty, col0 + tx].  Per step of
    ``tile`` along K the block stages an xq tile and a weight tile (as
    int32) in shared memory, barrier, ``tile`` integer multiply-adds per
    thread, barrier; at the step that ends a group the thread adds its int32
    sum, times the row's group scale, to a float32 total and restarts it.
    """
    x_tile = cuda.shared.array((MATMUL_TILE, _PADDED_TILE), int32)
    w_tile = cuda.shared.array((MATMUL_TILE, _PADDED_TILE), int32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    tile = cuda.blockDim.x
    T, K = xq.shape
    N = w_q.shape[0]
    row = cuda.blockIdx.y * tile + ty
    col = cuda.blockIdx.x * tile + tx
    w_row = cuda.blockIdx.x * tile + ty  # the weight row this thread loads
    total = _ZERO
    iacc = int32(0)
    g = 0
    for k0 in range(0, K, tile):
        k = k0 + tx
        x_tile[ty, tx] = int32(xq[row, k]) if row < T and k < K else int32(0)
        w_tile[ty, tx] = int32(w_q[w_row, k]) if w_row < N and k < K else int32(0)
        cuda.syncthreads()
        for kk in range(tile):
            iacc = int32(iacc + x_tile[ty, kk] * w_tile[tx, kk])
        cuda.syncthreads()
        if k0 + tile >= (g + 1) * group:  # this step ends group g
            if row < T:
                total += float32(iacc) * x_scales[row, g]
            iacc = int32(0)
            g += 1
    if row < T and col < N:
        out[row, col] = total * scales[col] + bias[col]
