"""Float64 NumPy references of the ``Ops`` methods, and the paged batches
they run on: shared by the conformance suite (``test_ops_conformance.py``)
and the backend-specific tests (``tests/cuda``), which import this module
by path."""

from __future__ import annotations

import numpy as np

BS = 4  # KV block size (tokens)
HD = 8  # head dim


def rel_err(out, ref) -> float:
    """max |out - ref| / max |ref| (0 for an empty reference)."""
    ref = np.asarray(ref, np.float64)
    if ref.size == 0:
        return 0.0
    return float(np.abs(np.asarray(out, np.float64) - ref).max() / np.abs(ref).max())


def ref_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """HF LlamaRMSNorm in float64."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def ref_rope(x: np.ndarray, positions: np.ndarray, table: np.ndarray) -> np.ndarray:
    """HF apply_rotary_pos_emb (``x * cos + rotate_half(x) * sin``) in
    float64 on ``x`` [T, heads, hd], with ``table`` as ``build_rope_cache``
    lays it out (cos in the first half of a row, sin in the second)."""
    half = x.shape[-1] // 2
    cos = np.asarray(table[positions, :half], np.float64)[:, None, :]
    sin = np.asarray(table[positions, half:], np.float64)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def ref_gelu_tanh_and_mul(x: np.ndarray) -> np.ndarray:
    """GeGLU in float64: ``gelu_tanh(x[:, :I]) * x[:, I:]`` with PyTorch's
    ``gelu(approximate="tanh")``, 0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3)))."""
    half = x.shape[1] // 2
    a, b = x[:, :half], x[:, half:]
    return 0.5 * a * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (a + 0.044715 * a**3))) * b


def stale_blocks(seq: tuple[int, int], window: int) -> int:
    """Logical blocks of a sequence (cached, n_new) wholly before the window
    of its first new token (the KV manager may have given them to another
    request): 0 without a window."""
    cached, _ = seq
    return max(0, cached - window + 1) // BS if window > 0 else 0


def paged_batch(rng, seqs, nkv: int, group: int, pad_tokens: int = 0, window: int = 0):
    """A paged batch of ``seqs`` = [(cached, n_new), ...] on host float64 arrays.

    Every sequence's K/V sit in shuffled physical blocks; every other slot
    of the cache is NaN, so reading outside a context shows in the output.
    With a ``window``, the blocks wholly before the window of a sequence's
    first new token (``stale_blocks``) are NaN too: a kernel must not read them.
    Returns (q [T + pad_tokens, nkv * group, HD], cache, block_tables,
    seq_lens, query_start_loc, dense K/V per sequence as [2, L, nkv, HD])."""
    blocks = [-(-(c + n) // BS) for c, n in seqs]
    num_blocks = sum(blocks) + 2
    perm = rng.permutation(num_blocks).astype(np.int32)
    cache = np.full((num_blocks, 2, BS, nkv, HD), np.nan)
    bt = np.full((len(seqs), max(blocks) + 1), -1, np.int32)
    dense, used = [], 0
    for s, ((c, n), nb) in enumerate(zip(seqs, blocks, strict=True)):
        bt[s, :nb] = perm[used:used + nb]
        used += nb
        pos = np.arange(c + n)
        kv = rng.standard_normal((2, c + n, nkv, HD))
        cache[bt[s, pos // BS], :, pos % BS] = kv.transpose(1, 0, 2, 3)
        cache[bt[s, :stale_blocks((c, n), window)]] = np.nan
        dense.append(kv)
    qsl = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    q = rng.standard_normal((int(qsl[-1]) + pad_tokens, nkv * group, HD))
    seq_lens = np.array([c + n for c, n in seqs], np.int32)
    return q, cache, bt, seq_lens, qsl, dense


def reference_attention(q: np.ndarray, seqs, qsl: np.ndarray, dense, scale: float,
                        window: int = 0) -> np.ndarray:
    """Dense causal float64 attention of ``paged_batch``'s queries over
    ``dense`` K/V: query head h reads KV head h // group; with a ``window``
    > 0 the query at position p sees positions p - window + 1 .. p only;
    rows of tokens owned by no sequence are zero."""
    q = np.asarray(q, np.float64)
    out = np.zeros_like(q)
    for s, (c, n) in enumerate(seqs):
        k, v = dense[s]
        group = q.shape[1] // k.shape[1]
        for i in range(n):
            pos, t = c + i, qsl[s] + i
            lo = max(0, pos - window + 1) if window > 0 else 0
            for h in range(q.shape[1]):
                logits = k[lo:pos + 1, h // group] @ q[t, h] * scale
                p = np.exp(logits - logits.max())
                out[t, h] = p @ v[lo:pos + 1, h // group] / p.sum()
    return out
