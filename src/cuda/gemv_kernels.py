"""Numba ``@cuda.jit`` matmul kernels of the CUDA backend: int8 weight-only,
W8A8 and ggml's block formats (``--quantization q4``), ``y = x @ W.T``.

As in :mod:`kvserve.cuda.kernels`, :class:`kvserve.cuda.ops.CudaOps` checks
every argument and picks the launch; the kernels trust their inputs.  Shared
limits (``GEMV_MAX_ROWS``, ``MATMUL_TILE``, ``W8A8_GROUP``, ``INT8_MAX``) live
in :mod:`kvserve.cuda.kernels`.

Decode products (T <= ``GEMV_MAX_ROWS`` activation rows) are memory-bound:
every weight byte is read once per call, so the GEMV kernels read the
weights as 32-bit words (an int8 ``[N, K]`` or a ``uint8`` nibble array viewed
as ``int32[N, K / 4]`` or ``int32[N, K / 8]`` on the host: K a multiple of 4),
unpack them in registers with shifts and masks, and use each unpacked weight
for all T rows.  Mapping, shared by every ``*_gemv_kernel``: block
``(lanes, rows)`` with ``lanes`` a power of two <= 32 (:func:`gemv_block`):
``lanes`` consecutive threads of a warp own one output channel (threadIdx.y
picks it, ``rows`` channels per block), stride over its words (a warp-wide
load reads consecutive words: coalesced), and accumulate float32 partial sums
for the T rows in registers; :func:`_lane_sums` then folds each channel's
lanes into its first lane with a tree of ``shfl.sync.down`` (offsets
lanes/2, ..., 1, :func:`_shuffle_sums`), and that lane stores: on a GPU no
barrier and no shared memory.  Numba's simulator has no warp shuffles: there
:data:`USE_SHUFFLE` is False and the lanes post their sums to shared memory,
one barrier, and the first lane adds them (:func:`_shared_sums`; one barrier
where an emulated shuffle tree costs two per offset, and each barrier costs
milliseconds there).  The tests run the shuffle tree too, on an emulated
``shfl_down_sync`` (``tests/cuda/conftest.py``).

Byte order: NumPy and CuPy arrays on x86 and CUDA are little-endian, so
byte ``j`` of a word is bits ``8j .. 8j + 7``.

Block formats (ggml's ``ggml-common.h``; the ``gguf`` package's
``gguf.quants`` reads the same): blocks of ``QK = 32`` input channels;
Q4_0 ``w = d * (q - 8)``, Q4_1 ``w = d * q + m``, Q8_0 ``w = d * q``, with
``d`` and ``m`` float16 in the file.  ``kvserve.model.ggml_blocks`` holds
them as ``BlockQuantizedWeight``: the codes as stored (4-bit: byte ``j`` of a
block's 16 holds channel ``j`` in its low nibble and ``j + 16`` in its high
nibble), ``d`` and ``m`` widened to float32 (Q4_0 gets ``m = -8 d``, exact),
so one q4 kernel serves Q4_0 and Q4_1.  Dequantization ``d * q + m`` is
exact in float32 up to the one rounding of the sum (``d`` has 11 significant
bits, ``q`` at most 8), as ``ggml_blocks.dequantize`` computes it.
"""

from __future__ import annotations

from numba import config as numba_config
from numba import cuda, float32, int32

from kvserve.cuda.kernels import GEMV_MAX_ROWS, MATMUL_TILE, MAX_BLOCK_THREADS
from kvserve.model.ggml_blocks import QK

WARP_SIZE = 32
#: Every lane of the warp takes part in a shuffle.
FULL_MASK = 0xFFFFFFFF
#: Warp reductions by ``cuda.shfl_down_sync`` on a GPU; Numba's simulator
#: (``NUMBA_ENABLE_CUDASIM=1``) implements no shuffle, so there the lanes'
#: sums go through shared memory (:func:`_shared_sums`).
USE_SHUFFLE = not numba_config.ENABLE_CUDASIM
#: Lanes per output channel under the simulator, at most: each CUDA thread is
#: a Python thread there (about 0.4 ms each, and 5 ms a block, to start);
#: 2 lanes keep a reduction step and make every strided loop of the tests
#: take several turns, with 8 channels to a 16-thread block.  The kernel
#: tests launch every lane count up to 16 directly.
SIMULATOR_LANES = 2
#: Warps per GEMV block on a GPU: 128 threads, so that the 576-channel
#: layers of the default model still spread over 144 blocks (the H200 has 132 SMs).
GEMV_WARPS = 4
#: Elements of one dequantized panel of a many-row block product (64 MiB in
#: float32): the weight is dequantized panel by panel, each multiplied by cuBLAS.
DEQUANT_PANEL_ELEMS = 1 << 24
#: 32-bit words per ggml block: 32 nibbles (Q4) or 32 int8 codes (Q8).
Q4_BLOCK_WORDS = QK // 8
Q8_BLOCK_WORDS = QK // 4
#: Shared tiles get one extra column so that reading a column does not hit one bank.
_PADDED_TILE = MATMUL_TILE + 1

_ZERO = float32(0.0)
_ONE = float32(1.0)


def gemv_block(work: int, n_out: int, max_threads: int, simulator: bool) -> tuple[int, int]:
    """``(lanes, rows)``: the block of a GEMV kernel over ``n_out`` output
    channels of ``work`` words (or groups) each.

    lanes: the smallest power of two >= work, at most ``WARP_SIZE`` on a GPU
    and ``SIMULATOR_LANES`` (and ``max_threads``) under the simulator.  rows:
    channels per block, so that lanes * rows is a whole number of warps on a
    GPU (``GEMV_WARPS``, fewer for a small ``n_out``; at least one warp even
    if ``max_threads`` < 32, as the shuffles need whole warps) and at most
    ``max_threads`` under the simulator.
    """
    cap = min(SIMULATOR_LANES, max_threads) if simulator else WARP_SIZE
    lanes = 1
    while lanes < min(work, cap) and lanes * 2 <= cap:
        lanes *= 2
    if simulator:
        return lanes, max(1, min(max_threads // lanes, n_out))
    per_warp = WARP_SIZE // lanes
    warps = max(1, min(GEMV_WARPS, max_threads // WARP_SIZE, -(-n_out // per_warp)))
    return lanes, warps * per_warp


# --------------------------------------------------------------------------- #
# Unpacking and warp reductions
# --------------------------------------------------------------------------- #


@cuda.jit(device=True)
def _unpack_sbytes(word, out):
    """out[j] = byte j (0 = least significant) of a 32-bit word as a signed
    int8 value, j < 4: masked to 0..255, then sign-extended by
    ``(b ^ 0x80) - 0x80`` (no shift overflow: the same in NumPy's int32 and
    Numba's int64).  One call per word: under the simulator every device
    call costs tens of microseconds."""
    for j in range(4):
        out[j] = int32((((word >> (8 * j)) & 0xFF) ^ 0x80) - 0x80)


@cuda.jit(device=True)
def _shuffle_sums(acc, n):
    """acc[:n] of each output channel's first lane (threadIdx.x == 0) becomes
    the sum over its blockDim.x lanes (a power of two <= 32, so that a
    channel's lanes never straddle a warp), by the tree of ``shfl.sync.down``
    offsets blockDim.x / 2, ..., 1 (a source lane past the warp gives the
    caller's own value; the other lanes end with partial sums).  Every thread
    of the block must call it: the shuffles take the full warp (GPU)."""
    delta = cuda.blockDim.x // 2
    while delta > 0:
        for i in range(GEMV_MAX_ROWS):
            if i < n:
                acc[i] += cuda.shfl_down_sync(FULL_MASK, acc[i], delta)
        delta //= 2


@cuda.jit(device=True)
def _shared_sums(acc, n):
    """:func:`_shuffle_sums` through shared memory (the simulator, which has
    no shuffles): every thread posts acc[:n], one barrier, and each channel's
    first lane adds its lanes' posts in lane order.  Every thread of the block
    must call it."""
    posts = cuda.shared.array((GEMV_MAX_ROWS, MAX_BLOCK_THREADS), float32)
    tid = cuda.threadIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    for i in range(n):
        posts[i, tid] = acc[i]
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        for i in range(n):
            total = _ZERO
            for lane in range(cuda.blockDim.x):
                total += posts[i, tid + lane]
            acc[i] = total


#: The lane reduction of every GEMV kernel (see :data:`USE_SHUFFLE`).
_lane_sums = _shuffle_sums if USE_SHUFFLE else _shared_sums


@cuda.jit(device=True)
def _lane_and_channel():
    """(lane, output channel) of this thread in a GEMV block (see the module docstring)."""
    return cuda.threadIdx.x, cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y


@cuda.jit(device=True)
def _zero_rows(acc):
    for t in range(GEMV_MAX_ROWS):
        acc[t] = _ZERO


@cuda.jit(device=True)
def _fma_rows(x, T, c, w, n, acc):
    """acc[t] += sum_j x[t, channel j] * w[j], j < n (4 or 8, a constant), for
    each row t < T (x converted to float32 on load).  Channel j is
    c + j % 4 + 16 (j // 4): 4 consecutive channels (an int8 or Q8_0 word),
    then, for n = 8, the 4 channels 16 further (the high nibbles of a Q4 word)."""
    for t in range(GEMV_MAX_ROWS):
        if t < T:
            s = acc[t]
            for j in range(n):
                s += float32(x[t, c + j % 4 + (QK // 2) * (j // 4)]) * w[j]
            acc[t] = s


@cuda.jit(device=True)
def _store_sums(acc, T, lane, o, bias, out):
    """The first lane of channel o < N stores out[t, o] = acc[t] + bias[o], t < T."""
    if lane == 0 and o < out.shape[1]:
        b = float32(bias[o])
        for t in range(GEMV_MAX_ROWS):
            if t < T:
                out[t, o] = acc[t] + b


@cuda.jit(device=True)
def _scale_rows(acc, T, o, scales):
    """acc[t] *= scales[o] for t < T, when o is a channel (o < len(scales))."""
    if o < scales.shape[0]:
        s = scales[o]
        for t in range(GEMV_MAX_ROWS):
            if t < T:
                acc[t] *= s


@cuda.jit(device=True)
def _tile_coords():
    """(tx, ty, tile, row, col, w_row) of a tiled-matmul thread: its
    threadIdx, the tile edge (blockDim.x), the output it computes
    out[row, col], and the weight row it stages (the block's channel ty)."""
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    tile = cuda.blockDim.x
    row = cuda.blockIdx.y * tile + ty
    col = cuda.blockIdx.x * tile + tx
    return tx, ty, tile, row, col, cuda.blockIdx.x * tile + ty


# --------------------------------------------------------------------------- #
# Word GEMVs: int8 weight-only and ggml blocks, one skeleton and a word decoder each
# --------------------------------------------------------------------------- #


@cuda.jit(device=True)
def _int8_word(words, scales, m, n, i, w):
    """Word i of row n of an int8 weight into w[0:4] (channels 4i .. 4i + 3)
    as exact float32 integers; returns 4i.  (``scales`` and ``m`` unused:
    the int8 kernel scales each channel's sum once, :func:`_scale_rows`.)"""
    _unpack_sbytes(words[n, i], w)
    return 4 * i


@cuda.jit(device=True)
def _q4_word(words, d, m, n, i, w):
    """Dequantize word i of row n of a q4 weight into w[0:8]; returns c, the
    channel of w[0]: w[j] is channel c + j and w[4 + j] channel c + 16 + j.

    Word i is bytes 4 (i % 4) .. + 3 of block b = i // 4, so c = 32 b +
    4 (i % 4); byte j's low nibble is channel c + j, its high nibble channel
    c + 16 + j (ggml's block_q4_0 / block_q4_1).  w = d * q + m in float32
    (the product is exact: one rounding, as ``ggml_blocks.dequantize``).
    """
    b = i // Q4_BLOCK_WORDS
    scale, low = d[n, b], m[n, b]
    word = words[n, i]
    for j in range(4):
        w[j] = scale * float32(int32((word >> (8 * j)) & 0xF)) + low
        w[4 + j] = scale * float32(int32((word >> (8 * j + 4)) & 0xF)) + low
    return QK * b + 4 * (i - b * Q4_BLOCK_WORDS)


@cuda.jit(device=True)
def _q8_word(words, d, m, n, i, w):
    """Dequantize word i of row n of a q8 weight (channels 4i .. 4i + 3,
    block i // 8) into w[0:4]: w = d * q, exact in float32.  Returns 4i.
    (``m`` unused.)"""
    scale = d[n, i // Q8_BLOCK_WORDS]
    _unpack_sbytes(words[n, i], w)
    for j in range(4):
        w[j] *= scale
    return 4 * i


@cuda.jit(device=True)
def _unscaled(acc, T, o, d):
    """The block kernels' epilogue before the bias: nothing (their scales are per block)."""


def _word_gemv(decode_word, width, epilogue, doc):
    """A warp GEMV kernel ``(x, words, d, m, bias, out)`` (the mapping of the
    module docstring): the lanes of output channel o decode words l, l +
    lanes, ... of weight row o with ``decode_word(words, d, m, o, i, w)``
    (``width`` values into w, the first at the channel it returns, as
    :func:`_fma_rows` reads them) for all T rows; then the warp reduction,
    ``epilogue(acc, T, o, d)``, and the first lane stores acc + bias."""

    def gemv(x, words, d, m, bias, out):
        acc = cuda.local.array(GEMV_MAX_ROWS, float32)
        w = cuda.local.array(8, float32)
        lane, o = _lane_and_channel()
        T = x.shape[0]
        _zero_rows(acc)
        if o < words.shape[0]:
            for i in range(lane, words.shape[1], cuda.blockDim.x):
                c = decode_word(words, d, m, o, i, w)
                _fma_rows(x, T, c, w, width, acc)
        _lane_sums(acc, T)
        epilogue(acc, T, o, d)
        _store_sums(acc, T, lane, o, bias, out)

    gemv.__doc__ = doc
    gemv.__name__ = gemv.__qualname__ = decode_word.__name__.strip("_") + "_gemv_kernel"
    return cuda.jit(gemv)


def _word_rows(decode_word, width, doc):
    """A kernel ``(rows, words, d, m, out)``: out[r] = row rows[r] of the
    weight, decoded word by word with ``decode_word`` (as :func:`_word_gemv`),
    in out's dtype.  Mapping: the GEMV blocks over R = len(rows) rows
    (:func:`gemv_block`): grid (ceil(R / rows),), block (lanes, rows); the
    lanes of output row r stride over the words of weight row rows[r] (a
    coalesced read), each writing its ``width`` values; no barrier."""

    def rows_kernel(rows, words, d, m, out):
        w = cuda.local.array(8, float32)
        lane, r = _lane_and_channel()
        if r < rows.shape[0]:
            n = rows[r]
            for i in range(lane, words.shape[1], cuda.blockDim.x):
                c = decode_word(words, d, m, n, i, w)
                for j in range(width):  # the channels of _fma_rows
                    out[r, c + j % 4 + (QK // 2) * (j // 4)] = w[j]

    rows_kernel.__doc__ = doc
    rows_kernel.__name__ = rows_kernel.__qualname__ = (decode_word.__name__.strip("_")
                                                        + "_rows_kernel")
    return cuda.jit(rows_kernel)


int8_gemv_kernel = _word_gemv(_int8_word, 4, _scale_rows, """Few-row int8 matmul:
    out[t, o] = scales[o] * sum_k x[t, k] w_q[o, k] + bias[o].

    Arguments (x, words, scales, scales, bias, out): x: [T, K]
    float16/float32, T <= GEMV_MAX_ROWS; words: int32[N, K / 4], the
    C-contiguous int8 weight viewed as words (K a multiple of 4; other K take
    :func:`int8_matmul_tiled_kernel`); scales: float32[N], passed twice (as d
    and m); bias: float16/float32[N]; out: [T, N], x's dtype.  Each weight
    is an exact float32 integer, the products are summed in float32 and
    scaled once.  Mapping (:func:`_word_gemv`): grid (ceil(N / rows),),
    block (lanes, rows); lane l of channel o reads words l, l + lanes, ... of
    row o (4 weights each, unpacked once for all T rows) and x[t, 4i .. 4i +
    3]; the warp reduction, no barrier on a GPU.  Traffic per output
    channel: K weight bytes (each read once) + 8 bytes of scale and bias; the
    T x rows (2 or 4 bytes an element) are shared by every channel, from L1/L2.
    """)

q4_gemv_kernel = _word_gemv(_q4_word, 8, _unscaled, """Few-row product with a
    Q4_0 / Q4_1 weight: out[t, o] = sum_k x[t, k] W[o, k] + bias[o].

    Arguments (x, words, d, m, bias, out): x: [T, K] float16/float32, T <=
    GEMV_MAX_ROWS, K a multiple of 32; words: int32[N, K / 8] (the uint8[N,
    K / 2] nibble pairs viewed as words: 4 a block); d, m: float32[N, K /
    32]; bias: float16/float32[N]; out: [T, N], x's dtype.  Each word's 8
    weights are dequantized once (:func:`_q4_word`) for all T rows, the
    products summed in float32.  Mapping (:func:`_word_gemv`): grid
    (ceil(N / rows),), block (lanes, rows): lane l of channel o reads words
    l, l + lanes, ... of row o (a warp-wide load: 128 contiguous bytes, 8
    blocks) with their block's d and m (one sector for 4 lanes), and x[t, c
    .. c + 3], x[t, c + 16 .. c + 19]; the warp reduction, no barrier on a
    GPU.  Traffic per output channel: K / 2 bytes of codes + K / 4 bytes of
    float32 d and m (0.75 byte a weight; the GGUF's float16 scales would
    make it 0.625) + the bias.
    """)

q8_gemv_kernel = _word_gemv(_q8_word, 4, _unscaled, """Few-row product with a
    Q8_0 weight (the formula of :func:`q4_gemv_kernel`).

    Arguments (x, words, d, d, bias, out): as :func:`q4_gemv_kernel`, with
    words: int32[N, K / 4] (the int8 codes viewed as words: 8 a block) and
    d: float32[N, K / 32] passed twice (as d and m).  Each word gives 4
    weights of channels 4i .. 4i + 3 (:func:`_q8_word`).  Traffic per output
    channel: K bytes of codes + K / 8 bytes of float32 d + the bias.
    """)

q4_rows_kernel = _word_rows(_q4_word, 8, """out[r] = dequantized row rows[r] of a
    Q4_0 / Q4_1 weight, in out's dtype (the embedding lookup of a q4 table,
    and the panels of a many-row product).

    Arguments (rows, words, d, m, out): rows: int64[R] (checked in [0, N));
    words, d, m as :func:`q4_gemv_kernel`; out: [R, K] float16/float32.
    Mapping (:func:`_word_rows`): grid (ceil(R / rows),), block (lanes,
    rows), 8 values a word, K / 2 bytes of codes read per row; no barrier.
    """)

q8_rows_kernel = _word_rows(_q8_word, 4, """out[r] = dequantized row rows[r] of a
    Q8_0 weight (as :func:`q4_rows_kernel`).

    Arguments (rows, words, d, d, out): rows: int64[R]; words, d as
    :func:`q8_gemv_kernel`; out: [R, K].  4 values a word.
    """)


#: (GEMV kernel, row-gather kernel) per ``BlockQuantizedWeight.kind``.
BLOCK_KERNELS = {"q4": (q4_gemv_kernel, q4_rows_kernel), "q8": (q8_gemv_kernel, q8_rows_kernel)}


# --------------------------------------------------------------------------- #
# int8 weight-only matmul, many rows: y = (x @ w_q.T) * scales + bias
# --------------------------------------------------------------------------- #


@cuda.jit
def int8_matmul_tiled_kernel(x, w_q, scales, bias, out):
    """Many-row int8 matmul (the formula of :func:`int8_gemv_kernel`, any T and K).

    x: [T, K] float16/float32; w_q: int8[N, K]; scales: float32[N]; bias:
    float16/float32[N]; out: [T, N], x's dtype.
    Mapping: grid (ceil(N / tile), ceil(T / tile)), block (tile, tile) with
    tile = blockDim.x <= MATMUL_TILE: thread (tx, ty) computes
    out[row0 + ty, col0 + tx].  Per step of ``tile`` along K the block
    stages an x tile and a weight tile in shared memory (both loads
    coalesced along K, weights converted to float32 once), barrier,
    ``tile`` multiply-adds per thread, barrier.
    """
    x_tile = cuda.shared.array((MATMUL_TILE, _PADDED_TILE), float32)
    w_tile = cuda.shared.array((MATMUL_TILE, _PADDED_TILE), float32)
    tx, ty, tile, row, col, w_row = _tile_coords()
    T, K = x.shape
    N = w_q.shape[0]
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
        out[row, col] = acc * scales[col] + float32(bias[col])


# --------------------------------------------------------------------------- #
# W8A8 matmul: int8 activations per (token, group), exact int32 group sums
# y = scales * sum_g x_scales[:, g] * (xq[:, group g] @ w_q[:, group g].T) + bias
# --------------------------------------------------------------------------- #


@cuda.jit
def w8a8_gemv_kernel(xq_words, x_scales, group_words, w_words, scales, bias, out):
    """Few-row W8A8 matmul: out[t, o] = scales[o] * sum_g x_scales[t, g] *
    acc[t, o, g] + bias[o], acc the exact int32 sum over group g of
    xq[t, k] * w_q[o, k].

    xq_words: int32[T, K / 4] (int8 codes viewed as words), T <=
    GEMV_MAX_ROWS; x_scales: float32[T, G]; group_words: words per group
    (K / (4 G)); w_words: int32[N, K / 4]; scales: float32[N]; bias:
    float16/float32[N]; out: [T, N], float16/float32.  Per word, 4 weights
    and, per row, 4 activations are unpacked and their products summed in
    int32 (exact: |acc| <= group * 127 * 128 < 2**31); each group's sum is
    converted to float32 once (exact below 2**24), times its activation
    scale, the groups summed in float32.
    Mapping (module docstring): grid (ceil(N / rows),), block (lanes, rows),
    lanes >= G where the warp allows: lane l of channel o takes whole groups
    l, l + lanes, ... (a group's words in turn: 16 words, 64 contiguous bytes
    per lane, the warp's first load brings the lines its next 15 hit in L1);
    then the warp reduction of the float32 partials, no barrier on a GPU.
    Traffic per output channel: K weight bytes + 8 bytes of scale and bias;
    xq (T * K bytes) and x_scales are shared by every channel.
    """
    acc = cuda.local.array(GEMV_MAX_ROWS, float32)
    iacc = cuda.local.array(GEMV_MAX_ROWS, int32)
    wb = cuda.local.array(4, int32)
    xb = cuda.local.array(4, int32)
    lane, o = _lane_and_channel()
    T = xq_words.shape[0]
    _zero_rows(acc)
    if o < w_words.shape[0]:
        for g in range(lane, x_scales.shape[1], cuda.blockDim.x):
            for t in range(GEMV_MAX_ROWS):
                iacc[t] = 0
            for i in range(g * group_words, (g + 1) * group_words):
                _unpack_sbytes(w_words[o, i], wb)
                for t in range(GEMV_MAX_ROWS):
                    if t < T:
                        _unpack_sbytes(xq_words[t, i], xb)
                        s = iacc[t]
                        for j in range(4):
                            s = int32(s + xb[j] * wb[j])
                        iacc[t] = s
            for t in range(GEMV_MAX_ROWS):
                if t < T:
                    acc[t] += float32(iacc[t]) * x_scales[t, g]
    _lane_sums(acc, T)
    _scale_rows(acc, T, o, scales)
    _store_sums(acc, T, lane, o, bias, out)


@cuda.jit
def w8a8_matmul_tiled_kernel(xq, x_scales, group, w_q, scales, bias, out):
    """Many-row W8A8 matmul (the formula of :func:`w8a8_gemv_kernel`, any T and K).

    xq: int8[T, K]; x_scales: float32[T, K // group]; w_q: int8[N, K];
    scales: float32[N]; bias: float16/float32[N]; out: [T, N].
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
    tx, ty, tile, row, col, w_row = _tile_coords()
    T, K = xq.shape
    N = w_q.shape[0]
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
        out[row, col] = total * scales[col] + float32(bias[col])
