"""Prefill attention on the CPU through BLAS matrix products.

The Numba paged-attention kernel (``kernels.paged_attention_kernel``) walks
keys one by one with scalar loops: right for decodes (one query per
sequence), slow for a long prefill chunk, whose work is two large matrix
products per head (a 2,000-token prompt: 138 GFLOP over 30 layers, where the
scalar kernel reached about 9 GFLOP/s on this machine). Here, one sequence's
chunk is computed as dense tiles on the sequence's gathered K/V:

    scores = (Q_tile * scale) @ K[:L]^T    (sgemm)
    P      = softmax(scores with the causal mask)
    out    = P @ V[:L]                     (sgemm)

per (query tile, KV head), with the query heads of a GQA group stacked as
rows so that they share one product. A tile of ``tile_q`` queries sees keys
``0 .. first + tile end``; only its diagonal block needs the causal mask.
The softmax is exact (not online): the whole key range of a tile is in one
row, computed in float32 with the row maximum subtracted.

A sliding-window layer (``window`` > 0, Gemma 3) gathers only the blocks from
the one holding the chunk's first visible key (those before may be another
request's), and a tile's product starts at its first query's first visible
key; the band of keys each row may see is then a full additive mask.

An int8 cache (``--kv-cache-dtype int8``, ``kvserve.model.kv_quant``) is
dequantized while a sequence's blocks are gathered (codes x scale, as
``kv_quant.dequantize``): the products run on that float32 panel of the
sequence's own keys, never on a float copy of the cache.
"""

from __future__ import annotations

import numpy as np

_F32 = np.float32


def gather_kv(kv_cache: np.ndarray, block_table: np.ndarray, seq_len: int,
              first_block: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """K and V of one sequence's positions ``first_block * block_size ..
    seq_len - 1``, contiguous (the blocks before ``first_block`` are not read).

    kv_cache: float32[num_blocks, 2, block_size, nkv, hd], or int8 [...,
    hd + 4] (the gathered blocks dequantized); block_table:
    int32[>= ceil(seq_len / block_size)] physical block ids (checked by the
    caller). Returns (k, v), each float32[nkv, seq_len - first_block *
    block_size, hd].
    """
    block_size, nkv, hd = kv_cache.shape[2:]
    num_blocks = -(-seq_len // block_size)
    kv = kv_cache[block_table[first_block:num_blocks]]  # [nb, 2, bs, nkv, hd] (a copy)
    if kv.dtype == np.int8:
        hd -= 4  # codes, then the 4 bytes of the scale (index hd // 4 of a float32 view)
        kv = kv[..., :hd].astype(_F32) * kv.view(_F32)[..., hd // 4:hd // 4 + 1]
    n = seq_len - first_block * block_size
    k = kv[:, 0].reshape(-1, nkv, hd)[:n]
    v = kv[:, 1].reshape(-1, nkv, hd)[:n]
    return np.ascontiguousarray(k.transpose(1, 0, 2)), np.ascontiguousarray(v.transpose(1, 0, 2))


def causal_tile_mask(nq: int, group: int) -> np.ndarray:
    """Additive mask float32[nq * group, nq] of a tile's diagonal block: row
    ``i * group + g`` (query i, head g of the group) may see keys 0..i."""
    upper = np.triu(np.full((nq, nq), -np.inf, dtype=_F32), k=1)
    return np.repeat(upper, group, axis=0)


def window_tile_mask(q_pos0: int, nq: int, key0: int, n_keys: int, window: int,
                     group: int) -> np.ndarray:
    """Additive mask float32[nq * group, n_keys] of a sliding-window tile:
    row ``i * group + g`` (query at position ``q_pos0 + i``) may see the key
    at position ``key0 + j`` iff ``0 <= q_pos0 + i - (key0 + j) < window``."""
    dist = (q_pos0 + np.arange(nq))[:, None] - (key0 + np.arange(n_keys))[None, :]
    mask = np.where((dist >= 0) & (dist < window), _F32(0.0), _F32(-np.inf))
    return np.repeat(mask, group, axis=0)


def prefill_attention(q: np.ndarray, kv_cache: np.ndarray, block_table: np.ndarray,
                      seq_len: int, q_start: int, q_end: int, scale: float, out: np.ndarray,
                      tile_q: int = 512, window: int = 0) -> None:
    """Causal attention of one sequence's new tokens ``q[q_start:q_end]``.

    Args:
        q: float32[T, nh, hd], the batch's queries.
        kv_cache: float32[num_blocks, 2, block_size, nkv, hd], or int8
            [..., hd + 4] (``kv_quant``), with this step's K/V already written.
        block_table: int32[max_blocks], the sequence's physical blocks.
        seq_len: context length after this step; the new tokens are at
            positions ``seq_len - (q_end - q_start) .. seq_len - 1``.
        q_start, q_end: the sequence's rows of the flat batch.
        scale: multiplier of q.k (usually hd ** -0.5).
        out: float32[T, nh, hd]; rows ``q_start:q_end`` are written.
        tile_q: queries per tile (bounds the score block to
            ``tile_q * group * seq_len`` floats).
        window: 0, or the sliding window (tokens; ``kvserve.model.ops``).
    """
    nh, hd = q.shape[1:]
    nkv = kv_cache.shape[3]
    group = nh // nkv
    n_new = q_end - q_start
    first = seq_len - n_new
    if window > 0:
        _windowed_prefill(q, kv_cache, block_table, seq_len, q_start, q_end, scale, out,
                          tile_q, window)
        return
    k, v = gather_kv(kv_cache, block_table, seq_len)
    for a in range(0, n_new, tile_q):
        b = min(a + tile_q, n_new)
        mask = causal_tile_mask(b - a, group)
        keys = first + b  # keys visible to the tile's last query
        for h in range(nkv):
            heads = slice(h * group, (h + 1) * group)
            rows = q[q_start + a:q_start + b, heads].reshape((b - a) * group, hd) * _F32(scale)
            scores = rows @ k[h, :keys].T  # [(b - a) * group, keys]
            scores[:, first + a:keys] += mask
            scores -= scores.max(axis=1, keepdims=True)
            np.exp(scores, out=scores)
            denom = scores.sum(axis=1, keepdims=True)
            tile = (scores @ v[h, :keys]) / denom
            out[q_start + a:q_start + b, heads] = tile.reshape(b - a, group, hd)


def _windowed_prefill(q: np.ndarray, kv_cache: np.ndarray, block_table: np.ndarray,
                      seq_len: int, q_start: int, q_end: int, scale: float, out: np.ndarray,
                      tile_q: int, window: int) -> None:
    """:func:`prefill_attention` of a sliding-window layer (same arguments):
    keys gathered from the block of the chunk's first visible key; each
    tile's products over ``[its first query's first key, its last query]``."""
    nh, hd = q.shape[1:]
    nkv = kv_cache.shape[3]
    block_size = kv_cache.shape[2]
    group = nh // nkv
    n_new = q_end - q_start
    first = seq_len - n_new
    first_block = max(0, first - window + 1) // block_size
    key_base = first_block * block_size  # position of k[:, 0]
    k, v = gather_kv(kv_cache, block_table, seq_len, first_block)
    for a in range(0, n_new, tile_q):
        b = min(a + tile_q, n_new)
        lo = max(0, first + a - window + 1)  # the tile's first visible key
        hi = first + b  # one past its last
        mask = window_tile_mask(first + a, b - a, lo, hi - lo, window, group)
        for h in range(nkv):
            heads = slice(h * group, (h + 1) * group)
            rows = q[q_start + a:q_start + b, heads].reshape((b - a) * group, hd) * _F32(scale)
            scores = rows @ k[h, lo - key_base:hi - key_base].T  # [(b - a) * group, hi - lo]
            scores += mask
            scores -= scores.max(axis=1, keepdims=True)
            np.exp(scores, out=scores)
            denom = scores.sum(axis=1, keepdims=True)
            tile = (scores @ v[h, lo - key_base:hi - key_base]) / denom
            out[q_start + a:q_start + b, heads] = tile.reshape(b - a, group, hd)
