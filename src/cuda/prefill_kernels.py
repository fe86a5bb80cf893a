"""CUDA kernels of prefill attention: a tile of a sequence's consecutive new
queries against its paged context in shared-memory K/V tiles
(FlashAttention-2's online softmax, one query row per thread), over the
float or the int8 KV cache.

Dtypes, launch mappings, the paged layout and sliding windows as
:mod:`kvserve.cuda.kernels` states them; the int8 cache's layout and the
``_make_*`` factories as :mod:`kvserve.cuda.decode_kernels` states them.
"""

from __future__ import annotations

import math

from numba import cuda, float32

from kvserve.cuda.kernel_base import (_NEG_INF, _ZERO, MAX_HEAD_DIM, PREFILL_KV_TILE, _max, _min,
                                      _window_start)


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
