"""Numba ``@cuda.jit`` kernels of the CUDA backend.

One kernel per job; :class:`kvserve.cuda.ops.CudaOps` checks every argument
(shapes, dtypes, contiguity, index ranges) and chooses the launch
configuration, so the kernels trust their inputs: a kernel cannot raise on a
GPU, and an index out of range would corrupt memory silently.

Dtypes: activations, weights and the KV cache are float32 or float16; every
kernel converts to float32 on load, accumulates in float32 and rounds once on
store.  bfloat16 is not a kernel dtype: the backend converts bf16 checkpoints
to float16 when it loads them (``CudaOps.to_device``).  The KV cache may
also be int8 (``--kv-cache-dtype int8``: codes and a float32 scale per
vector, ``kvserve.model.kv_quant``), which the ``*_int8_kernel``s write and
read; each attention kernel is written once for both caches (see the
int8 section), and the float kernels compute what they did without it.

Launch mappings are 1-D blocks of any size up to :data:`MAX_BLOCK_THREADS`
(the matmuls, in :mod:`kvserve.cuda.gemv_kernels`, are 2-D): loops stride
over the work by ``blockDim``, so the same kernel runs with a warp-multiple
block on a GPU and with a handful of threads under Numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``), where each CUDA thread is a Python thread and
the tests run.  The mappings are the
readable baseline (scalar float32 FMAs, no tensor cores, no vectorized loads);
each kernel's docstring states its grid, block and barriers.

KV cache and attention metadata follow vLLM's paged layout
(``kvserve.model.ops``): ``kv_cache[num_blocks, 2, block_size, nkv, hd]``
(axis 1: 0 = K, 1 = V), token position ``j`` of sequence ``s`` lives in block
``block_tables[s, j // block_size]`` at offset ``j % block_size``.

Sliding-window attention (Gemma 3's local layers; Beltagy et al. 2020,
Mistral's ``sliding_window``): every attention kernel takes ``window``, 0
for full causal attention, else a query at position p attends to keys
p - window < j <= p only.  The kernels start their loops at the window's
first key (:func:`_window_start`): a key before it is never loaded, not
loaded and masked, since the KV manager frees the blocks behind the window
and they may hold another request's K/V (or NaN).
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
#: Most activation rows of the GEMV kernels (``kvserve.cuda.gemv_kernels``:
#: int8, W8A8, ggml blocks; their per-lane accumulators).
GEMV_MAX_ROWS = 8
#: Largest tile edge of the tiled int8 matmuls: (16, 16) threads, 16x16 outputs.
MATMUL_TILE = 16
#: Input channels per activation scale of the W8A8 matmul (a K that it does
#: not divide gets one group per row); equal to ``kvserve.cpu.int8.GROUP``,
#: a multiple of every tile edge up to MATMUL_TILE.
W8A8_GROUP = 64
#: Largest magnitude of a symmetric int8 code.
INT8_MAX = 127

_NEG_INF = float32(-math.inf)
_ZERO = float32(0.0)
_ONE = float32(1.0)
_HALF = float32(0.5)
#: sqrt(2 / pi) and the cubic coefficient of the tanh approximation of GELU.
_GELU_SQRT_2_OVER_PI = float32(math.sqrt(2.0 / math.pi))
_GELU_CUBIC = float32(0.044715)


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
def _window_start(ctx, window):
    """First key position a query with ``ctx`` keys of context (its own
    position + 1) may see: ``ctx - window`` with a window (``window`` > 0),
    clamped at 0; 0 without (full causal attention)."""
    if window > 0 and ctx > window:
        return ctx - window
    return 0


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


@cuda.jit(device=True)
def _inv_rms(x, t, buf, eps):
    """``1 / sqrt(mean(x[t]**2) + eps)`` of row ``t`` of x [T, H], over the
    block: each thread sums the squares of the elements it strides over (in
    float32), one block sum in ``buf`` (its barrier)."""
    H = x.shape[1]
    ss = _ZERO
    for i in range(cuda.threadIdx.x, H, cuda.blockDim.x):
        xi = float32(x[t, i])
        ss += xi * xi
    return _ONE / math.sqrt(_block_sum(buf, ss) / float32(H) + eps)


@cuda.jit
def rms_norm_kernel(x, weight, eps, out):
    """out[t] = x[t] / sqrt(mean(x[t]**2) + eps) * weight (HF LlamaRMSNorm).

    x, out: [T, H] (distinct); weight: [H]; eps: float32.  Sum of squares in float32.
    Mapping: grid (T,), threads stride over H, one block reduction.
    """
    buf = cuda.shared.array(MAX_BLOCK_THREADS, float32)
    t = cuda.blockIdx.x
    H = x.shape[1]
    inv = _inv_rms(x, t, buf, eps)
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
def fused_norm_add_rms_norm_kernel(x, residual, x_weight, weight, eps):
    """In place: x = rms_norm(x, x_weight); residual += x; x = rms_norm(residual, weight).

    Gemma 3's sandwich norm and the next norm in one pass: a block's output
    normed by its own norm (``post_attention_layernorm`` or
    ``post_feedforward_layernorm``), added to the residual stream, which is
    then normed for the next block. x, residual: [T, H], distinct buffers of
    one dtype; x_weight, weight: [H]; eps: float32. The normed x is stored
    (rounded to x's dtype) before it is added, as ``rms_norm`` then
    :func:`fused_add_rms_norm_kernel` would; sums of squares in float32.
    Mapping: grid (T,), threads stride over H and touch only their own
    elements; two block reductions (two buffers) are the only barriers.
    """
    buf = cuda.shared.array(MAX_BLOCK_THREADS, float32)
    buf2 = cuda.shared.array(MAX_BLOCK_THREADS, float32)
    t = cuda.blockIdx.x
    H = x.shape[1]
    inv = _inv_rms(x, t, buf, eps)
    ss = _ZERO
    for i in range(cuda.threadIdx.x, H, cuda.blockDim.x):
        x[t, i] = float32(x[t, i]) * inv * float32(x_weight[i])
        r = float32(x[t, i]) + float32(residual[t, i])
        residual[t, i] = r
        ss += r * r
    inv = _ONE / math.sqrt(_block_sum(buf2, ss) / float32(H) + eps)
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
def gelu_tanh_and_mul_kernel(x, out):
    """out = gelu_tanh(x[:, :I]) * x[:, I:], with
    gelu_tanh(a) = 0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3)))
    (Hendrycks & Gimpel 2016's tanh approximation; PyTorch's
    ``gelu(approximate="tanh")``, HF's ``gelu_pytorch_tanh`` of Gemma 3).

    x: [T, 2I] (gate then up); out: [T, I], same dtype.  float32 throughout.
    Mapping: grid (T,), threads stride over I.
    """
    t = cuda.blockIdx.x
    inter = out.shape[1]
    for i in range(cuda.threadIdx.x, inter, cuda.blockDim.x):
        a = float32(x[t, i])
        inner = _GELU_SQRT_2_OVER_PI * (a + _GELU_CUBIC * a * a * a)
        out[t, i] = _HALF * a * (_ONE + math.tanh(inner)) * float32(x[t, inter + i])


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
# Paged attention, prefill chunks: query tiles over shared-memory K/V tiles
# --------------------------------------------------------------------------- #


def _make_prefill_attention(quantized):
    """The body of :func:`prefill_attention_kernel` (``quantized`` False)
    or of :func:`prefill_attention_int8_kernel` (True), as
    :func:`_make_decode_partition`'s."""

    @cuda.jit(device=True)
    def prefill_attention(q, kv_cache, kv_scales, block_tables, tile_seq, tile_t0, tile_nq,
                          tile_pos0, scale, window, out):
        k_tile = cuda.shared.array((PREFILL_KV_TILE, MAX_HEAD_DIM), float32)
        v_tile = cuda.shared.array((PREFILL_KV_TILE, MAX_HEAD_DIM), float32)
        if quantized:  # each key's two scales, beside its codes
            k_sc = cuda.shared.array(PREFILL_KV_TILE, float32)
            v_sc = cuda.shared.array(PREFILL_KV_TILE, float32)
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
        sc = hd // 4
        kvh = h // (q.shape[1] // kv_cache.shape[3])  # GQA: query head -> KV head
        block_size = kv_cache.shape[2]

        m = _NEG_INF
        denom = _ZERO
        if active:
            for d in range(hd):
                q_row[d] = float32(q[t, h, d]) * scale
                acc[d] = _ZERO

        n_ctx = pos0 + nq  # the last row's context
        for k0 in range(_window_start(pos0 + 1, window), n_ctx, PREFILL_KV_TILE):
            nk = _min(PREFILL_KV_TILE, n_ctx - k0)
            for e in range(r, nk * hd, nthreads):
                j = e // hd
                d = e - j * hd
                kpos = k0 + j
                blk = block_tables[s, kpos // block_size]
                off = kpos % block_size
                k_tile[j, d] = float32(kv_cache[blk, 0, off, kvh, d])
                v_tile[j, d] = float32(kv_cache[blk, 1, off, kvh, d])
            if quantized:
                for j in range(r, nk, nthreads):
                    kpos = k0 + j
                    blk = block_tables[s, kpos // block_size]
                    off = kpos % block_size
                    k_sc[j] = kv_scales[blk, 0, off, kvh, sc]
                    v_sc[j] = kv_scales[blk, 1, off, kvh, sc]
            cuda.syncthreads()
            visible = _min(nk, pos + 1 - k0)  # causal mask
            first = _max(0, _window_start(pos + 1, window) - k0)  # the row's window
            if active and visible > first:
                tile_max = _NEG_INF
                for j in range(first, visible):
                    dot = _ZERO
                    for d in range(hd):
                        dot += q_row[d] * k_tile[j, d]
                    if quantized:
                        dot = dot * k_sc[j]
                    scores[j] = dot
                    tile_max = _max(tile_max, dot)
                m_new = _max(m, tile_max)
                alpha = math.exp(m - m_new)  # exp(-inf) = 0 on the first tile
                psum = _ZERO
                for j in range(first, visible):
                    e_j = math.exp(scores[j] - m_new)
                    if quantized:
                        scores[j] = e_j * v_sc[j]
                    else:
                        scores[j] = e_j
                    psum += e_j
                denom = denom * alpha + psum
                m = m_new
                for d in range(hd):
                    a = acc[d] * alpha
                    for j in range(first, visible):
                        a += scores[j] * v_tile[j, d]
                    acc[d] = a
            cuda.syncthreads()

        if active:
            for d in range(hd):
                out[t, h, d] = acc[d] / denom

    return prefill_attention


_prefill_attention = _make_prefill_attention(quantized=False)
_prefill_attention_int8 = _make_prefill_attention(quantized=True)


@cuda.jit
def prefill_attention_kernel(q, kv_cache, block_tables, tile_seq, tile_t0, tile_nq, tile_pos0,
                             scale, window, out):
    """Causal attention of a tile of consecutive queries of one sequence.

    Tile i holds the flat tokens tile_t0[i] .. + tile_nq[i] - 1 (<= blockDim.x)
    of sequence tile_seq[i], at positions tile_pos0[i] ..; the query at
    position pos attends to context positions [0, pos], i.e. fully over the
    cached prefix and causally within the chunk, or with a window (window >
    0) to (pos - window, pos].  q, out: [T, nh, hd]; kv_cache, block_tables
    as above; scale: float32; window: int (0: none).

    With a window the block loads keys from the tile's first row's window
    start on (never a key before it); a later row skips the loaded keys
    before its own window.

    Mapping: grid (tiles, nh), block 1-D: thread r owns query row r, with
    its scaled q row, running max, denominator and output row in registers /
    local memory (FlashAttention-2's online softmax, one row per thread).
    The block walks the context in tiles of PREFILL_KV_TILE keys: all threads
    load a K/V tile into shared memory (coalesced along hd), barrier, each
    row consumes the keys it may see, barrier.  Rows past tile_nq[i] only help
    load, so every thread reaches every barrier.
    """
    _prefill_attention(q, kv_cache, kv_cache, block_tables, tile_seq, tile_t0, tile_nq, tile_pos0,
                       scale, window, out)


@cuda.jit
def prefill_attention_int8_kernel(q, kv_cache, kv_scales, block_tables, tile_seq, tile_t0,
                                  tile_nq, tile_pos0, scale, window, out):
    """:func:`prefill_attention_kernel` over the int8 cache.

    kv_cache, kv_scales as :func:`write_kv_int8_kernel`'s; the other
    arguments, the output and the mapping as the float kernel's. A K/V tile
    holds the codes (as float32) in shared memory and each key's two scales
    beside them; a row's score is ``s_k * sum_d (scale q_d) c_d``, and its
    softmax weight times ``s_v`` multiplies the V codes.
    """
    _prefill_attention_int8(q, kv_cache, kv_scales, block_tables, tile_seq, tile_t0, tile_nq,
                            tile_pos0, scale, window, out)


# --------------------------------------------------------------------------- #
# W8A8 activations: int8 per (token, group); the int8 and W8A8 matmuls are
# in kvserve.cuda.gemv_kernels
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
