"""The int8 KV cache (``--kv-cache-dtype int8``) in the CPU backend's kernels.

References are the NumPy format of ``kvserve.model.kv_quant`` (``quantize``,
``dequantize``) and float64 attention written here: the writes must be the
reference's bytes, codes and scales; attention over an int8 cache must be
float64 attention over the dequantized cache to float32 rounding, on every
route (the Numba tiles serial and parallel, a multi-query chunk, the BLAS
prefill path, batch-invariant ops, sliding windows, GQA). The fused decode
step on int8 caches is checked against the op path in
``test_decode_layer.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.cpu import ops as cpu_ops
from kvserve.cpu.ops import CpuOps
from kvserve.model import kv_quant
from kvserve.model.llama import AttentionMetadata
from kvserve.model.ops import build_rope_cache

NH, NKV, HD, BS = 6, 2, 16, 4  # GQA: 3 query heads per KV head
#: float32 kernels against float64 on the same dequantized K/V: the
#: tolerance of the float cache's tests (tests/cpu/test_kernels.py).
REL = 1e-5


def _rel(out, ref) -> float:
    return float(np.abs(out - ref).max() / np.abs(ref).max())


# --------------------------------------------------------------------------- #
# allocation and layout checks
# --------------------------------------------------------------------------- #


def test_allocate_int8_layout_zeroed_and_refusals():
    ops = CpuOps(num_threads=1)
    cache = ops.allocate_kv_cache(3, BS, NKV, HD, kv_cache_dtype="int8")
    assert cache.dtype == np.int8 and cache.shape == (3, 2, BS, NKV, HD + 4)
    assert not cache.any() and cache.flags.c_contiguous
    assert not kv_quant.dequantize(cache).any()  # zero bytes: zero vectors, scale 0
    auto = ops.allocate_kv_cache(3, BS, NKV, HD)
    assert auto.dtype == np.float32 and auto.shape == (3, 2, BS, NKV, HD)
    for bad in ("fp8", "float16", "int4"):
        with pytest.raises(ValueError, match="kv-cache-dtype"):
            ops.allocate_kv_cache(3, BS, NKV, HD, kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="divisible by 4"):
        ops.allocate_kv_cache(3, BS, NKV, 6, kv_cache_dtype="int8")


@pytest.mark.parametrize("cache", [np.zeros((2, 2, BS, NKV, HD + 4), np.int16),
                                   np.zeros((2, 2, BS, NKV, HD + 2), np.int8),
                                   np.zeros((2, 2, BS, NKV, 2 * HD + 8), np.int8)[..., :HD + 4]],
                         ids=["int16", "width-not-4k", "not-contiguous"])
def test_wrong_cache_arrays_raise_naming_the_op(cache):
    ops = CpuOps(num_threads=1)
    k = np.ones((1, NKV, HD), np.float32)
    with pytest.raises(ValueError, match="write_kv: kv_cache"):
        ops.write_kv(k, k, cache, np.array([0]))
    with pytest.raises(ValueError, match="paged_attention: kv_cache"):
        ops.paged_attention(np.ones((1, NH, HD), np.float32), cache, np.zeros((1, 1), np.int32),
                            np.array([1], np.int32), np.array([0, 1], np.int32), 0.25)


# --------------------------------------------------------------------------- #
# write_kv: the reference's bytes
# --------------------------------------------------------------------------- #


def _awkward_rows(rng, T):
    """float32[T, NKV, HD] of random magnitudes, a zero vector, a vector whose
    codes are exact halves (127 / max|x| = 1: round half to even decides),
    and a vector whose largest magnitude is negative."""
    x = rng.standard_normal((T, NKV, HD)).astype(np.float32)
    x *= (10.0 ** rng.uniform(-4, 3, (T, NKV, 1))).astype(np.float32)
    x[0, 0] = 0.0
    x[1, 1] = np.array([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 4.5, -126.5, 126.5,
                        -3.5, 0, 5.5, 6.5, -7.5], np.float32)
    x[2, 0, 3] = -5.0 * np.abs(x[2, 0]).max()
    return x


def test_write_kv_is_the_reference_quantization_byte_for_byte():
    rng = np.random.default_rng(0)
    T, nb = 9, 5
    k, v = _awkward_rows(rng, T), _awkward_rows(rng, T)[::-1].copy()
    slots = rng.permutation(nb * BS)[:T].astype(np.int64)
    slots[4] = -1  # padding: not written
    ops = CpuOps(num_threads=1)
    cache = ops.allocate_kv_cache(nb, BS, NKV, HD, kv_cache_dtype="int8")
    ops.write_kv(k, v, cache, slots)
    want = np.zeros_like(cache)
    for t, slot in enumerate(slots):
        if slot >= 0:
            want[slot // BS, 0, slot % BS] = kv_quant.quantize(k[t])
            want[slot // BS, 1, slot % BS] = kv_quant.quantize(v[t])
    np.testing.assert_array_equal(cache, want)  # codes and scale bytes
    s = kv_quant.scales(cache)
    t0 = slots[0]
    assert s[t0 // BS, 0, t0 % BS, 0] == 0.0  # the zero vector: scale 0, codes 0
    np.testing.assert_array_equal(cache[slots[1] // BS, 0, slots[1] % BS, 1, :HD],
                                  [127, 0, 2, 2, 0, -2, -2, 4, 4, -126, 126, -4, 0, 6, 6, -8])
    with pytest.raises(ValueError, match="slot beyond"):
        ops.write_kv(k[:1], v[:1], cache, np.array([nb * BS], np.int64))


# --------------------------------------------------------------------------- #
# attention over an int8 cache
# --------------------------------------------------------------------------- #


def _paged(rng, seqs, window):
    """An int8 cache holding the K/V of ``seqs`` ((context after the step,
    new tokens) each) in shuffled blocks, filled by ``kv_quant.quantize``;
    blocks wholly before a sequence's first window hold huge keys and values
    (they would dominate every softmax they entered). Returns (cache, dense
    float32 K/V per sequence [L, NKV, HD] x 2, block tables, seq_lens,
    query_start_loc)."""
    blocks = [-(-L // BS) for L, _ in seqs]
    nb = sum(blocks) + 2
    perm = rng.permutation(nb).astype(np.int32)
    bt = np.zeros((len(seqs), max(blocks)), np.int32)
    cache = np.zeros((nb, 2, BS, NKV, HD + 4), np.int8)
    cache[perm[-2:]] = kv_quant.quantize(
        rng.standard_normal((2, 2, BS, NKV, HD)).astype(np.float32))  # unused blocks
    dense, i = [], 0
    for s, (L, n_new) in enumerate(seqs):
        bt[s, :blocks[s]] = perm[i:i + blocks[s]]
        i += blocks[s]
        kv = rng.standard_normal((2, blocks[s] * BS, NKV, HD)).astype(np.float32)
        stale = max(0, L - n_new - window + 1) // BS if window > 0 else 0
        kv[:, :stale * BS] *= 1e4
        stored = kv_quant.quantize(kv).reshape(2, blocks[s], BS, NKV, HD + 4)
        cache[bt[s, :blocks[s]]] = stored.transpose(1, 0, 2, 3, 4)
        dq = kv_quant.dequantize(stored).reshape(2, blocks[s] * BS, NKV, HD)[:, :L]
        dense.append((dq[0], dq[1]))
    qsl = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    return cache, dense, bt, np.array([L for L, _ in seqs], np.int32), qsl


def _reference(q, dense, seqs, qsl, scale, window):
    """float64 causal (windowed) GQA attention on the dequantized K/V."""
    out = np.zeros(q.shape, np.float64)
    group = NH // NKV
    for s, (L, n_new) in enumerate(seqs):
        k, v = (np.repeat(a.astype(np.float64), group, axis=1) for a in dense[s])
        for i in range(n_new):
            pos = L - n_new + i
            lo = max(0, pos - window + 1) if window > 0 else 0
            row = q[qsl[s] + i].astype(np.float64)  # [NH, HD]
            sc = np.einsum("hd,khd->hk", row, k[lo:pos + 1]) * scale
            p = np.exp(sc - sc.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            out[qsl[s] + i] = np.einsum("hk,khd->hd", p, v[lo:pos + 1])
    return out


BATCHES = {
    "decode": [(5, 1), (17, 1), (40, 1), (9, 1)],
    "chunk": [(9, 1), (30, 5), (12, 3)],  # multi-query tiles of the Numba kernel
    "blas": [(40, 20), (7, 1), (26, 17)],  # two sequences on the BLAS prefill path
}
ROUTES = ["serial", "parallel", "batch_invariant"]


def _ops(route, monkeypatch):
    if route == "parallel":  # every call enters the parallel kernel
        monkeypatch.setattr(cpu_ops, "ATTENTION_PARALLEL_MIN_MACS", 0)
        return CpuOps(num_threads=2, tile_q=2)
    if route == "batch_invariant":  # no BLAS prefill path
        return CpuOps(num_threads=2, tile_q=2, batch_invariant=True)
    monkeypatch.setattr(cpu_ops, "ATTENTION_PARALLEL_MIN_MACS", 1 << 62)
    return CpuOps(num_threads=2, tile_q=2)


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("route", ROUTES)
def test_attention_matches_float64_on_the_dequantized_cache(route, batch, window, monkeypatch):
    rng = np.random.default_rng([ROUTES.index(route), list(BATCHES).index(batch), window])
    seqs = BATCHES[batch]
    cache, dense, bt, sl, qsl = _paged(rng, seqs, window)
    q = rng.standard_normal((int(qsl[-1]), NH, HD)).astype(np.float32)
    ops = _ops(route, monkeypatch)
    blas_calls = []
    real = cpu_ops.prefill_attention
    monkeypatch.setattr(cpu_ops, "prefill_attention",
                        lambda *a, **kw: blas_calls.append(1) or real(*a, **kw))
    before = cache.copy()
    out = ops.paged_attention(q, cache, bt, sl, qsl, HD ** -0.5, window=window)
    ref = _reference(q, dense, seqs, qsl, HD ** -0.5, window)
    assert _rel(out, ref) <= REL
    assert len(blas_calls) == (2 if batch == "blas" and route != "batch_invariant" else 0)
    np.testing.assert_array_equal(cache, before)  # attention never writes the cache


def test_int8_attention_is_close_to_the_float_cache():
    """The same K/V written to a float32 and an int8 cache: attention differs
    by the codes' rounding only. Each stored value is off by at most half a
    step, max|x| / 254 (0.4% of its vector's largest); a score is off by
    |q|.|dk| (about 0.4% of the score's own scale for unit-normal vectors)
    and the output, a softmax-weighted mean of values, by about as much
    again: 2% of the output's largest magnitude is a loose bound, and the
    difference must not be zero (the int8 cache is really quantized)."""
    rng = np.random.default_rng(5)
    seqs = [(33, 1), (50, 20), (12, 4)]
    nb = 42
    bt = rng.permutation(nb)[:39].astype(np.int32).reshape(3, 13)
    sl = np.array([L for L, _ in seqs], np.int32)
    qsl = np.array([0, 1, 21, 25], np.int32)
    ops = CpuOps(num_threads=2)
    caches = {d: ops.allocate_kv_cache(nb, BS, NKV, HD, kv_cache_dtype=d)
              for d in ("auto", "int8")}
    for s, (L, _) in enumerate(seqs):
        k = rng.standard_normal((L, NKV, HD)).astype(np.float32)
        v = rng.standard_normal((L, NKV, HD)).astype(np.float32)
        slots = bt[s, np.arange(L) // BS].astype(np.int64) * BS + np.arange(L) % BS
        for cache in caches.values():
            ops.write_kv(k, v, cache, slots)
    q = rng.standard_normal((25, NH, HD)).astype(np.float32)
    for window in (0, 5):
        f = ops.paged_attention(q, caches["auto"], bt, sl, qsl, HD ** -0.5, window=window)
        i8 = ops.paged_attention(q, caches["int8"], bt, sl, qsl, HD ** -0.5, window=window)
        assert 0 < _rel(i8, f) <= 2e-2, window


def _rope_ref(x, positions, table):
    """NeoX rotation of float32[T, n, HD] in float64 (``build_rope_cache`` rows)."""
    half = HD // 2
    cos = table[positions, :half].astype(np.float64)[:, None]
    sin = table[positions, half:].astype(np.float64)[:, None]
    x1, x2 = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@pytest.mark.parametrize("window", [0, 5])
def test_rope_kv_attention_on_int8(window):
    """The composed op on an int8 cache: the cache holds the reference
    quantization of the rotated K (to float32 rounding of the rotation: the
    codes of a float64-rotated K may differ by one step) and of V, and the
    output is attention over the dequantized cache."""
    rng = np.random.default_rng(11)
    seqs = [(6, 6), (9, 3), (4, 1)]  # all of each context written in this call
    ops = CpuOps(num_threads=2, prefill_min_queries=6)  # the 6-token chunk takes BLAS
    nb = 12
    bt = rng.permutation(nb)[:9].astype(np.int32).reshape(3, 3)
    sl = np.array([L for L, _ in seqs], np.int32)
    qsl = np.array([0, 6, 9, 10], np.int32)
    cache = ops.allocate_kv_cache(nb, BS, NKV, HD, kv_cache_dtype="int8")
    # sequence 1's first 6 positions and sequence 2's first 3 were cached before
    pre = [(1, np.arange(6)), (2, np.arange(3))]
    table = build_rope_cache(HD, 64, 10000.0)
    for s, pos in pre:
        k = rng.standard_normal((len(pos), NKV, HD)).astype(np.float32)
        ops.write_kv(k, k[::-1].copy(), cache,
                     bt[s, pos // BS].astype(np.int64) * BS + pos % BS)
    positions = np.concatenate([np.arange(L - n, L) for L, n in seqs])
    seq_of = np.repeat(np.arange(3), [n for _, n in seqs])
    slots = bt[seq_of, positions // BS].astype(np.int64) * BS + positions % BS
    qkv = rng.standard_normal((10, (NH + 2 * NKV) * HD)).astype(np.float32)
    attn = AttentionMetadata(slot_mapping=slots, block_tables=bt, seq_lens=sl,
                             query_start_loc=qsl)
    out = ops.rope_kv_attention(qkv, positions, table, cache, attn, HD ** -0.5, NH, NKV, HD,
                                window)
    k_ref = _rope_ref(qkv[:, NH * HD:(NH + NKV) * HD].reshape(10, NKV, HD), positions, table)
    v_ref = qkv[:, (NH + NKV) * HD:].reshape(10, NKV, HD)
    stored = cache[slots // BS, :, slots % BS]  # [10, 2, NKV, HD + 4]
    np.testing.assert_array_equal(stored[:, 1], kv_quant.quantize(v_ref))
    dq = kv_quant.dequantize(stored[:, 0])
    step = kv_quant.scales(stored[:, 0])[..., None]
    assert (np.abs(dq - k_ref) <= 0.5 * step * (1 + 1e-4) + 1e-6).all()
    dense = []
    for s, (L, _) in enumerate(seqs):
        all_pos = np.arange(L)
        kv = kv_quant.dequantize(cache[bt[s, all_pos // BS], :, all_pos % BS])
        dense.append((kv[:, 0], kv[:, 1]))
    q_ref = _rope_ref(qkv[:, :NH * HD].reshape(10, NH, HD), positions, table)
    ref = _reference(q_ref, dense, seqs, qsl, HD ** -0.5, window)
    assert _rel(out, ref) <= REL
