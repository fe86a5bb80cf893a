"""CUDA kernels of the paged KV cache's writes and of decode attention: the
KV writes (float and int8, vLLM's ``reshape_and_cache``), split-K decode
attention (vLLM ``paged_attention_v2``) with its reduction, and the fused
decode kernel (RoPE + KV write + GQA-group attention in one launch), which
writes the int8 cache with the same device function as the int8 KV write.

Dtypes, launch mappings, the paged layout and sliding windows as
:mod:`kvserve.cuda.kernels` states them; shared limits in
:mod:`kvserve.cuda.kernel_base`.
"""

from __future__ import annotations

import math

from numba import cuda, float32

from kvserve.cuda.kernel_base import (_NEG_INF, _ONE, _ZERO, INT8_MAX, MAX_BLOCK_THREADS,
                                      MAX_HEAD_DIM, MAX_PARTITION_SIZE, _max, _min,
                                      _window_start)


# --------------------------------------------------------------------------- #
# Block reductions (this module's own: see kvserve.cuda.kernel_base)
# --------------------------------------------------------------------------- #


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
# KV writes: float cache
# --------------------------------------------------------------------------- #


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
# The int8 KV cache (``--kv-cache-dtype int8``, ``kvserve.model.kv_quant``)
# --------------------------------------------------------------------------- #
#
# One int8 array per layer, ``kv_cache[num_blocks, 2, block_size, nkv,
# hd + 4]``: each vector is hd codes then the 4 bytes of its float32 scale s
# (value = code * s). The kernels take the cache twice: as int8 (the codes)
# and as its float32 view ``kv_scales[num_blocks, 2, block_size, nkv,
# (hd + 4) / 4]`` (``kv_cache.view(float32)``), where a vector's scale is
# element ``hd // 4``. A vector is quantized by the block that writes it
# (a max reduction over hd, then the codes and the scale), and dequantized
# inside attention: a key's dot product with the codes is scaled once
# (``s_k * sum_d q_d c_d``), and a value's scale folds into its softmax
# weight (``(p_j s_v) * c_d``).
#
# Each attention kernel is written once, in a factory (``_make_*``) whose
# ``quantized`` flag is a closure constant: Numba prunes the branches of the
# other cache at compile time, so the float (``auto``) kernel compiles to
# the code it had before the int8 cache, and the ``*_int8_kernel`` adds
# only the scale reads (and the fused kernel's quantizing write,
# :func:`_write_kv_int8`). The kernels themselves are one-call wrappers
# with their own signatures (the float ones take no ``kv_scales``).


@cuda.jit(device=True)
def _kv_code(x, inv):
    """int8 code of float32 ``x`` times ``inv`` (127 / max|x| of its vector):
    rint, round half to even (llrint on a GPU), clipped to [-127, 127]."""
    c = round(x * inv)
    return _min(_max(c, -INT8_MAX), INT8_MAX)


@cuda.jit(device=True)
def _kv_inverse(absmax):
    """127 / ``absmax`` in float32, 0 for an all-zero vector (its codes are 0)."""
    return float32(INT8_MAX) / absmax if absmax > _ZERO else _ZERO


@cuda.jit(device=True)
def _write_kv_int8(k_row, v_row, kv_cache, kv_scales, b, o, h, hd, red_k, red_v):
    """Quantize one token's key and value vectors of KV head ``h`` into slot
    (block ``b``, offset ``o``) of the int8 cache.

    k_row, v_row: [>= hd] float16/float32 (views of the token's rows, or
    shared memory); kv_cache, kv_scales as :func:`write_kv_int8_kernel`'s;
    red_k, red_v: distinct shared float32[MAX_BLOCK_THREADS]. Per vector x:
    s = max|x| / 127, codes = clip(rint(x * (127 / max|x|)), -127, 127),
    0 and zero codes for x = 0, all in float32 (``kv_quant.quantize``, bit
    for bit). Threads stride over hd; two block max reductions (two
    barriers), reached by every thread of the block.
    """
    k_max = _ZERO
    v_max = _ZERO
    for d in range(cuda.threadIdx.x, hd, cuda.blockDim.x):
        k_max = _max(k_max, abs(float32(k_row[d])))
        v_max = _max(v_max, abs(float32(v_row[d])))
    k_max = _block_max(red_k, k_max)
    v_max = _block_max(red_v, v_max)
    k_inv = _kv_inverse(k_max)
    v_inv = _kv_inverse(v_max)
    for d in range(cuda.threadIdx.x, hd, cuda.blockDim.x):
        kv_cache[b, 0, o, h, d] = _kv_code(float32(k_row[d]), k_inv)
        kv_cache[b, 1, o, h, d] = _kv_code(float32(v_row[d]), v_inv)
    if cuda.threadIdx.x == 0:
        kv_scales[b, 0, o, h, hd // 4] = k_max / float32(INT8_MAX)
        kv_scales[b, 1, o, h, hd // 4] = v_max / float32(INT8_MAX)


@cuda.jit
def write_kv_int8_kernel(k, v, kv_cache, kv_scales, slot_mapping):
    """Quantize and scatter new K/V rows into the int8 paged cache.

    k, v: [T, nkv, hd] float16/float32; kv_cache: int8[num_blocks, 2,
    block_size, nkv, hd + 4]; kv_scales: its float32 view (scale at
    ``hd // 4``); slot_mapping: int64[T], a negative slot is padding and is
    skipped (slots checked in range). Per vector x (token t, head h; K and
    V): s = max|x| / 127, codes = clip(rint(x * (127 / max|x|)), -127, 127),
    0 and zero codes for x = 0, all in float32 (``kv_quant.quantize``, bit
    for bit; :func:`_write_kv_int8`).
    Mapping: grid (T, nkv), threads stride over hd; two block max
    reductions (K's and V's, distinct buffers: two barriers).
    """
    red_k = cuda.shared.array(MAX_BLOCK_THREADS, float32)
    red_v = cuda.shared.array(MAX_BLOCK_THREADS, float32)
    t, h = cuda.blockIdx.x, cuda.blockIdx.y
    slot = slot_mapping[t]
    if slot < 0:  # uniform for the block: before any barrier
        return
    block_size = kv_cache.shape[2]
    b = slot // block_size
    o = slot - b * block_size
    _write_kv_int8(k[t, h], v[t, h], kv_cache, kv_scales, b, o, h, k.shape[2], red_k, red_v)


# --------------------------------------------------------------------------- #
# Paged attention, decode: split-K ("flash decoding", vLLM paged_attention_v2)
# --------------------------------------------------------------------------- #


def _make_decode_partition(quantized):
    """The body of :func:`decode_partition_kernel` (``quantized`` False) or
    of :func:`decode_partition_int8_kernel` (True): a device function with
    the int8 kernel's arguments (the float kernel passes its cache again as
    ``kv_scales``, never read). ``quantized`` is a closure constant, so
    Numba compiles only its own branches."""

    @cuda.jit(device=True)
    def decode_partition(q, kv_cache, kv_scales, block_tables, tokens, token_seq, token_ctx,
                         scale, window, partition_size, tmp_out, max_logits, exp_sums):
        logits = cuda.shared.array(MAX_PARTITION_SIZE, float32)
        red_max = cuda.shared.array(MAX_BLOCK_THREADS, float32)
        red_sum = cuda.shared.array(MAX_BLOCK_THREADS, float32)
        i, h, p = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        tid, nthreads = cuda.threadIdx.x, cuda.blockDim.x
        ctx = token_ctx[i]
        start = _window_start(ctx, window) + p * partition_size
        if start >= ctx:
            return
        n_keys = _min(partition_size, ctx - start)
        t, s = tokens[i], token_seq[i]
        hd = q.shape[2]
        sc = hd // 4  # the scale's index in the float32 view
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
            if quantized:
                logit = dot * kv_scales[blk, 0, off, kvh, sc] * scale
            else:
                logit = dot * scale
            logits[j] = logit
            local_max = _max(local_max, logit)
        m = _block_max(red_max, local_max)

        local_sum = _ZERO
        for j in range(tid, n_keys, nthreads):  # the keys this thread wrote
            e = math.exp(logits[j] - m)
            if quantized:  # the weight times s_v: the output loop reads only codes
                pos = start + j
                blk = block_tables[s, pos // block_size]
                logits[j] = e * kv_scales[blk, 1, pos % block_size, kvh, sc]
            else:
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

    return decode_partition


_decode_partition = _make_decode_partition(quantized=False)
_decode_partition_int8 = _make_decode_partition(quantized=True)


@cuda.jit
def decode_partition_kernel(q, kv_cache, block_tables, tokens, token_seq, token_ctx, scale,
                            window, partition_size, tmp_out, max_logits, exp_sums):
    """Attention of one query over one partition of its context.

    q: [T, nh, hd]; kv_cache as above; block_tables: int32[S, max_blocks];
    work item i is flat token ``tokens[i]`` of sequence ``token_seq[i]``,
    attending to context positions [lo, token_ctx[i]) with lo =
    ``_window_start(token_ctx[i], window)`` (0 without a window); scale:
    float32; window: int (0: none); partition p covers positions
    [lo + p * P, lo + (p + 1) * P), P = partition_size <=
    MAX_PARTITION_SIZE (the partitions count from the window's start, so a
    key before it is never read).  Writes the partition's max logit, its sum of
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
    _decode_partition(q, kv_cache, kv_cache, block_tables, tokens, token_seq, token_ctx, scale,
                      window, partition_size, tmp_out, max_logits, exp_sums)


@cuda.jit
def decode_partition_int8_kernel(q, kv_cache, kv_scales, block_tables, tokens, token_seq,
                                 token_ctx, scale, window, partition_size, tmp_out, max_logits,
                                 exp_sums):
    """:func:`decode_partition_kernel` over the int8 cache.

    kv_cache: int8[num_blocks, 2, block_size, nkv, hd + 4], kv_scales its
    float32 view (see :func:`write_kv_int8_kernel`); the other arguments,
    outputs and mapping as the float kernel's. A key's logit is
    ``(s_k * sum_d q_d c_d) * scale``; its softmax weight, once the
    partition's sum is taken, is stored times ``s_v`` in the shared logits,
    so the output loop reads only codes: ``acc_d += (p_j s_v) c_{j,d}``.
    """
    _decode_partition_int8(q, kv_cache, kv_scales, block_tables, tokens, token_seq, token_ctx,
                           scale, window, partition_size, tmp_out, max_logits, exp_sums)


@cuda.jit
def decode_reduce_kernel(tmp_out, max_logits, exp_sums, tokens, token_ctx, window,
                         partition_size, out):
    """Combine the partitions of :func:`decode_partition_kernel` (or of
    :func:`decode_fused_kernel`) into out[tokens[i], h]: the
    ceil((token_ctx[i] - lo) / P) partitions from the window's start lo
    (``_window_start``; window 0: none, lo = 0).

    With M = max_p m_p and w_p = l_p exp(m_p - M):
    out = sum_p w_p o_p / sum_p w_p (o_p are the normalized partial outputs).
    out: [T, nh, hd] (q's dtype); the other arguments as the partition kernel's.
    Mapping: grid (N, nh), threads stride over hd.  Each thread recomputes
    the partition weights (a few per thousand keys) instead of staging them
    in shared memory: no barrier.
    """
    i, h = cuda.blockIdx.x, cuda.blockIdx.y
    ctx = token_ctx[i]
    n_parts = (ctx - _window_start(ctx, window) + partition_size - 1) // partition_size
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
# Decode, fused: RoPE + KV write + GQA-group attention in one launch
# --------------------------------------------------------------------------- #
#
# (Here, beside the device helpers it calls: under the simulator a device
# function swaps its module's ``cuda`` global while it runs, which races
# with a kernel of another module calling it from several threads.)
#
# The fused decode-attention kernel: RoPE, KV write and attention in one launch.
#
# In a decode step every sequence brings one new token, whose fused QKV
# projection row holds its query heads, its key and value heads. vLLM and
# llama.cpp fuse the work around attention; here one kernel does, for each
# (token, KV head) pair:
#
# 1. RoPE (NeoX / HF ``rotate_half``) of the KV head's query heads (its GQA
#    group) and of its key, into shared memory;
# 2. the new key and value written to the paged cache at the token's slot
#    (vLLM's ``reshape_and_cache``) by the block whose partition holds the new
#    position, which then reads every key from the cache: the new one
#    rounded to the cache's dtype exactly as the others are;
# 3. attention of the whole group over the token's context: each K row and
#    V element is read once for all the group's query heads (K/V bytes are
#    what decode attention costs).
#
# A context longer than ``partition_size`` keys is split across blocks
# (grid z, vLLM paged_attention_v2's split-K); they write partial results
# that ``kvserve.cuda.kernels.decode_reduce_kernel`` combines, so a decode
# step's attention is one launch for contexts up to a partition and two
# beyond. The kernels trust their inputs: the step's indices were checked on
# the host (``kvserve.cuda.step``).

#: Most query heads per KV head the fused kernel holds (shared q rows and logits).
MAX_GROUP = 8
# The fused kernel's shared arrays, sized by plain int globals: Numba's CUDA
# target takes a shared array's shape only as a constant, and an expression
# such as ``MAX_GROUP * MAX_HEAD_DIM`` in the kernel is typed as a run-time
# int64 (``cuda.compile_ptx`` refuses it; the simulator does not check).
_GROUP_Q_ELEMS = MAX_GROUP * MAX_HEAD_DIM
_GROUP_LOGITS = MAX_GROUP * MAX_PARTITION_SIZE
_GROUP_AND_KEY = MAX_GROUP + 1


def _make_decode_fused(quantized):
    """The body of :func:`decode_fused_kernel` (``quantized`` False) or of
    :func:`decode_fused_int8_kernel` (True), as :func:`_make_decode_partition`'s."""

    @cuda.jit(device=True)
    def decode_fused(qkv, positions, cos_sin_cache, q_norm, k_norm, qk_eps, kv_cache, kv_scales,
                     block_tables, slot_mapping, tokens, token_seq, token_ctx, num_heads, scale,
                     window, partition_size, out, tmp_out, max_logits, exp_sums):
        q_s = cuda.shared.array(_GROUP_Q_ELEMS, float32)
        k_s = cuda.shared.array(MAX_HEAD_DIM, float32)
        logits = cuda.shared.array(_GROUP_LOGITS, float32)
        red_max = cuda.shared.array(MAX_BLOCK_THREADS, float32)
        red_sum = cuda.shared.array(MAX_BLOCK_THREADS, float32)
        m_loc = cuda.local.array(MAX_GROUP, float32)
        den_loc = cuda.local.array(MAX_GROUP, float32)
        acc = cuda.local.array(MAX_GROUP, float32)
        inv_norm = cuda.shared.array(_GROUP_AND_KEY, float32)

        i, g, p = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        tid, nthreads = cuda.threadIdx.x, cuda.blockDim.x
        ctx = token_ctx[i]
        lo = _window_start(ctx, window)
        start = lo + p * partition_size
        if start >= ctx:
            return
        t, s = tokens[i], token_seq[i]
        nkv, hd = kv_cache.shape[3], kv_cache.shape[4]
        if quantized:
            hd -= 4  # codes, then the scale's 4 bytes
        sc = hd // 4
        block_size = kv_cache.shape[2]
        group = num_heads // nkv
        half = hd // 2
        pos = positions[t]

        # 0. with q/k norms (q_norm of hd elements; a 1-element dummy
        # otherwise), each head's 1 / rms into shared memory: one block sum
        # per head, the two reduction buffers taken in turn
        normed = q_norm.shape[0] == hd
        if normed:
            for h in range(group + 1):
                base = (g * group + h) * hd if h < group else (num_heads + g) * hd
                ss = _ZERO
                for d in range(tid, hd, nthreads):
                    xd = float32(qkv[t, base + d])
                    ss += xd * xd
                if h % 2 == 0:
                    total = _block_sum(red_max, ss)
                else:
                    total = _block_sum(red_sum, ss)
                if tid == 0:
                    inv_norm[h] = _ONE / math.sqrt(total / float32(hd) + qk_eps)
            cuda.syncthreads()  # inv_norm is published, the reduction buffers free again

        # 1. RoPE of the group's query heads (h < group) and of the key (h == group)
        for e in range(tid, (group + 1) * half, nthreads):
            h = e // half
            j = e - h * half
            base = (g * group + h) * hd if h < group else (num_heads + g) * hd
            c = float32(cos_sin_cache[pos, j])
            sn = float32(cos_sin_cache[pos, half + j])
            x1 = float32(qkv[t, base + j])
            x2 = float32(qkv[t, base + half + j])
            if normed:
                w = q_norm if h < group else k_norm
                x1 *= inv_norm[h] * float32(w[j])
                x2 *= inv_norm[h] * float32(w[half + j])
            if h < group:
                q_s[h * hd + j] = x1 * c - x2 * sn
                q_s[h * hd + half + j] = x2 * c + x1 * sn
            else:
                k_s[j] = x1 * c - x2 * sn
                k_s[half + j] = x2 * c + x1 * sn
        cuda.syncthreads()

        # 2. the block whose partition holds the new position writes (int8:
        # quantizes) its K/V
        if p == (ctx - 1 - lo) // partition_size:
            slot = slot_mapping[t]
            if slot >= 0:  # the token's: uniform for the block
                b = slot // block_size
                o = slot - b * block_size
                v_base = (num_heads + nkv + g) * hd
                if quantized:
                    _write_kv_int8(k_s, qkv[t, v_base:v_base + hd], kv_cache, kv_scales, b, o,
                                   g, hd, red_max, red_sum)
                else:
                    for d in range(tid, hd, nthreads):
                        kv_cache[b, 0, o, g, d] = k_s[d]
                        kv_cache[b, 1, o, g, d] = qkv[t, v_base + d]
            cuda.syncthreads()

        # 3. logits of every query head of the group over the partition's keys
        n_keys = _min(partition_size, ctx - start)
        for h in range(group):
            m_loc[h] = _NEG_INF
        for j in range(tid, n_keys, nthreads):
            key = start + j
            blk = block_tables[s, key // block_size]
            off = key % block_size
            for h in range(group):
                acc[h] = _ZERO
            for d in range(hd):
                kd = float32(kv_cache[blk, 0, off, g, d])
                for h in range(group):
                    acc[h] += q_s[h * hd + d] * kd
            if quantized:
                s_k = kv_scales[blk, 0, off, g, sc]
            for h in range(group):
                if quantized:
                    logit = acc[h] * s_k * scale
                else:
                    logit = acc[h] * scale
                logits[h * MAX_PARTITION_SIZE + j] = logit
                m_loc[h] = _max(m_loc[h], logit)
        for h in range(group):
            m = _block_max(red_max, m_loc[h])
            local_sum = _ZERO
            for j in range(tid, n_keys, nthreads):  # the keys this thread wrote
                e = math.exp(logits[h * MAX_PARTITION_SIZE + j] - m)
                if quantized:  # the weight times s_v, against the V codes
                    key = start + j
                    s_v = kv_scales[block_tables[s, key // block_size], 1, key % block_size, g, sc]
                    logits[h * MAX_PARTITION_SIZE + j] = e * s_v
                else:
                    logits[h * MAX_PARTITION_SIZE + j] = e
                local_sum += e
            den_loc[h] = _block_sum(red_sum, local_sum)  # its barrier publishes the logits
            m_loc[h] = m

        # 4. output: each V element read once for the whole group; with one
        # partition launched, normalized in place (a captured graph launches
        # every partition of the longest context, and reduces them all)
        single = cuda.gridDim.z == 1
        for d in range(tid, hd, nthreads):
            for h in range(group):
                acc[h] = _ZERO
            for j in range(n_keys):
                key = start + j
                blk = block_tables[s, key // block_size]
                vd = float32(kv_cache[blk, 1, key % block_size, g, d])
                for h in range(group):
                    acc[h] += logits[h * MAX_PARTITION_SIZE + j] * vd
            for h in range(group):
                if single:
                    out[t, g * group + h, d] = acc[h] / den_loc[h]
                else:
                    tmp_out[i, g * group + h, p, d] = acc[h] / den_loc[h]
        if tid == 0 and not single:
            for h in range(group):
                max_logits[i, g * group + h, p] = m_loc[h]
                exp_sums[i, g * group + h, p] = den_loc[h]

    return decode_fused


_decode_fused = _make_decode_fused(quantized=False)
_decode_fused_int8 = _make_decode_fused(quantized=True)


@cuda.jit
def decode_fused_kernel(qkv, positions, cos_sin_cache, q_norm, k_norm, qk_eps, kv_cache,
                        block_tables, slot_mapping, tokens, token_seq, token_ctx, num_heads,
                        scale, window, partition_size, out, tmp_out, max_logits, exp_sums):
    """(Q/K norms +) RoPE + KV write + GQA-group attention of one decode token, one partition.

    qkv: [T, (nh + 2 nkv) * hd], the fused projection (query heads, then key
    heads, then value heads; not modified); positions: int64[T];
    cos_sin_cache: [max_position, hd] (``build_rope_cache``); q_norm,
    k_norm: [hd] RMSNorm weights of every query and key head, applied before
    RoPE with ``qk_eps`` (float32; Qwen3's and Gemma 3's ``q_norm`` /
    ``k_norm``), or [1] each for none; kv_cache: [num_blocks, 2,
    block_size, nkv, hd]; block_tables: int32[S, max_blocks]; slot_mapping:
    int64[T] (negative: not written); work item i is flat token
    ``tokens[i]`` of sequence ``token_seq[i]`` with context
    ``token_ctx[i]`` (its own position + 1); num_heads: nh (a multiple of
    nkv, nh / nkv <= MAX_GROUP); scale: float32; window: int, 0 for full
    causal attention, else the token sees keys [lo, ctx) with lo =
    ``_window_start(ctx, window)``; partition_size: P <= MAX_PARTITION_SIZE
    keys, partition p covering [lo + p P, lo + (p + 1) P) (no key before lo
    is read).

    Output: with one partition launched (grid z of 1: every context <= P)
    the normalized rows go to ``out[t, h]`` ([T, nh, hd], q's dtype); with
    more, each partition's
    normalized rows, max logit and exp sum go to ``tmp_out[i, h, p]``
    (float32[N, nh, parts, hd]), ``max_logits[i, h, p]`` and
    ``exp_sums[i, h, p]`` for ``decode_reduce_kernel``.

    Mapping: grid (N, nkv, parts), block 1-D. With norms, threads stride
    over each of the G + 1 heads for its sum of squares (one block sum
    each); then they stride over the (G + 1) * hd/2 rotation pairs, then over the partition's keys (one
    key each: a dot product with all G query rows, K read once), then over
    hd for the output (one V element each, for all G heads). Barriers:
    after the staging, after the KV write (the writing block only), and two
    per query head for the max and the sum. A partition past the context
    exits before any barrier, uniformly for its block.
    """
    _decode_fused(qkv, positions, cos_sin_cache, q_norm, k_norm, qk_eps, kv_cache, kv_cache,
                  block_tables, slot_mapping, tokens, token_seq, token_ctx, num_heads, scale,
                  window, partition_size, out, tmp_out, max_logits, exp_sums)


@cuda.jit
def decode_fused_int8_kernel(qkv, positions, cos_sin_cache, q_norm, k_norm, qk_eps, kv_cache,
                             kv_scales, block_tables, slot_mapping, tokens, token_seq, token_ctx,
                             num_heads, scale, window, partition_size, out, tmp_out, max_logits,
                             exp_sums):
    """:func:`decode_fused_kernel` over the int8 cache.

    kv_cache: int8[num_blocks, 2, block_size, nkv, hd + 4], kv_scales its
    float32 view (see :func:`write_kv_int8_kernel`); the other arguments,
    outputs and mapping as the float kernel's. The writing block quantizes
    the rotated key and the value as :func:`write_kv_int8_kernel` does (two
    more barriers: the max reductions), and then reads the new key back
    quantized, as every other key. Logits ``(s_k sum_d q_d c_d) scale``;
    softmax weights times ``s_v`` against the V codes.
    """
    _decode_fused_int8(qkv, positions, cos_sin_cache, q_norm, k_norm, qk_eps, kv_cache,
                       kv_scales, block_tables, slot_mapping, tokens, token_seq, token_ctx,
                       num_heads, scale, window, partition_size, out, tmp_out, max_logits,
                       exp_sums)
