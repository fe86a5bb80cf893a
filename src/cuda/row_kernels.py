"""Row-wise CUDA kernels: one block per token row (or per row and group of
channels), threads stride over the row. The embedding gather, RMSNorm (alone,
fused with the residual add, and Gemma 3's sandwich norm), RoPE, the gated
activations (SiLU, GELU-tanh) and W8A8's per-group activation quantization.

Dtypes, launch mappings and the checks the kernels trust as
:mod:`kvserve.cuda.kernels` states them; shared limits in
:mod:`kvserve.cuda.kernel_base`.
"""

from __future__ import annotations

import math

from numba import cuda, float32

from kvserve.cuda.kernel_base import (_HALF, _NEG_INF, _ONE, _ZERO, INT8_MAX, MAX_BLOCK_THREADS,
                                      _max, _min)

#: sqrt(2 / pi) and the cubic coefficient of the tanh approximation of GELU.
_GELU_SQRT_2_OVER_PI = float32(math.sqrt(2.0 / math.pi))
_GELU_CUBIC = float32(0.044715)


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
