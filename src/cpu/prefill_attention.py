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
"""

from __future__ import annotations

import numpy as np

_F32 = np.float32


def gather_kv(kv_cache: np.ndarray, block_table: np.ndarray,
              seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V of one sequence's first ``seq_len`` positions, contiguous.

    kv_cache: float32[num_blocks, 2, block_size, nkv, hd]; block_table:
    int32[>= ceil(seq_len / block_size)] physical block ids (checked by the
    caller). Returns (k, v), each float32[nkv, seq_len, hd].
    """
    block_size, nkv, hd = kv_cache.shape[2:]
    num_blocks = -(-seq_len // block_size)
    kv = kv_cache[block_table[:num_blocks]]  # [nb, 2, bs, nkv, hd] (a copy)
    k = kv[:, 0].reshape(num_blocks * block_size, nkv, hd)[:seq_len]
    v = kv[:, 1].reshape(num_blocks * block_size, nkv, hd)[:seq_len]
    return np.ascontiguousarray(k.transpose(1, 0, 2)), np.ascontiguousarray(v.transpose(1, 0, 2))


def causal_tile_mask(nq: int, group: int) -> np.ndarray:
    """Additive mask float32[nq * group, nq] of a tile's diagonal block: row
    ``i * group + g`` (query i, head g of the group) may see keys 0..i."""
    upper = np.triu(np.full((nq, nq), -np.inf, dtype=_F32), k=1)
    return np.repeat(upper, group, axis=0)


def prefill_attention(q: np.ndarray, kv_cache: np.ndarray, block_table: np.ndarray,
                      seq_len: int, q_start: int, q_end: int, scale: float, out: np.ndarray,
                      tile_q: int = 512) -> None:
    """Causal attention of one sequence's new tokens ``q[q_start:q_end]``.

    Args:
        q: float32[T, nh, hd], the batch's queries.
        kv_cache: float32[num_blocks, 2, block_size, nkv, hd] with this
            step's K/V already written.
        block_table: int32[max_blocks], the sequence's physical blocks.
        seq_len: context length after this step; the new tokens are at
            positions ``seq_len - (q_end - q_start) .. seq_len - 1``.
        q_start, q_end: the sequence's rows of the flat batch.
        scale: multiplier of q.k (usually hd ** -0.5).
        out: float32[T, nh, hd]; rows ``q_start:q_end`` are written.
        tile_q: queries per tile (bounds the score block to
            ``tile_q * group * seq_len`` floats).
    """
    nh, hd = q.shape[1:]
    nkv = kv_cache.shape[3]
    group = nh // nkv
    n_new = q_end - q_start
    first = seq_len - n_new
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
