"""CPU backend ops (kvserve.cpu.ops.CpuOps) against float64 NumPy formulas and
the dense reference (kvserve.model.reference)."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.cpu import ops as cpu_ops
from kvserve.cpu.ops import CpuOps
from kvserve.model.ops import build_rope_cache
from kvserve.model.reference import reference_attention

OPS = CpuOps()


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    """max |out - ref| / max |ref| (robust to near-zero reference entries)."""
    ref = np.asarray(ref, np.float64)
    if ref.size == 0:
        return 0.0
    return float(np.abs(np.asarray(out, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


# --------------------------------------------------------------------------- #
# paged attention
# --------------------------------------------------------------------------- #


def build_paged_batch(rng, seqs, nh, nkv, hd, bs, pad_tokens=0, extra_cols=2):
    """seqs: list of (cached, n_new).  Returns the batch plus dense K/V per seq.

    The K/V of all positions (cached and new) are written through write_kv,
    into shuffled, non-contiguous physical blocks.
    """
    blocks_per = [-(-(c + n) // bs) for c, n in seqs]
    num_blocks = sum(blocks_per) + 3
    perm = rng.permutation(num_blocks)
    cache = OPS.allocate_kv_cache(num_blocks, bs, nkv, hd)
    cache[...] = np.nan  # unwritten slots must never be read
    bt = np.full((len(seqs), max(blocks_per) + extra_cols), -1, np.int32)
    dense = []
    i = 0
    for s, ((c, n), nb) in enumerate(zip(seqs, blocks_per)):
        bt[s, :nb] = perm[i:i + nb]
        i += nb
        L = c + n
        k = rng.standard_normal((L, nkv, hd)).astype(np.float32)
        v = rng.standard_normal((L, nkv, hd)).astype(np.float32)
        pos = np.arange(L)
        slots = bt[s, pos // bs].astype(np.int64) * bs + pos % bs
        OPS.write_kv(k, v, cache, slots)
        dense.append((k, v))
    n_new = [n for _, n in seqs]
    qsl = np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32)
    T = int(qsl[-1]) + pad_tokens
    q = rng.standard_normal((T, nh, hd)).astype(np.float32)
    seq_lens = np.array([c + n for c, n in seqs], np.int32)
    return q, cache, bt, seq_lens, qsl, dense


#: Routes of CpuOps.paged_attention: every sequence through the Numba kernel
#: (its serial and its parallel driver), every sequence through the BLAS
#: prefill path, and the default split. Values: (prefill_min_queries,
#: ATTENTION_PARALLEL_MIN_MACS), None for the default.
ROUTES = {"numba": (10**9, 10**18), "numba_parallel": (10**9, 0), "blas": (1, None),
          "split": (None, None)}


def check_attention(seqs, nh, nkv, hd, bs, tile_q=16, seed=0, pad_tokens=0, route="split"):
    rng = np.random.default_rng(seed)
    q, cache, bt, seq_lens, qsl, dense = build_paged_batch(rng, seqs, nh, nkv, hd, bs, pad_tokens)
    scale = hd ** -0.5
    min_queries, min_macs = ROUTES[route]
    extra = {} if min_queries is None else {"prefill_min_queries": min_queries}
    threshold = cpu_ops.ATTENTION_PARALLEL_MIN_MACS if min_macs is None else min_macs
    with mock.patch.object(cpu_ops, "ATTENTION_PARALLEL_MIN_MACS", threshold):
        out = CpuOps(tile_q=tile_q, num_threads=2, **extra).paged_attention(
            q, cache, bt, seq_lens, qsl, scale)
    assert out.shape == q.shape and out.dtype == np.float32
    for s, (k, v) in enumerate(dense):
        a, b = qsl[s], qsl[s + 1]
        ref = reference_attention(q[a:b], k, v, scale)
        err = rel_err(out[a:b], ref)
        assert err < 1e-5, (s, seqs[s], err)
    if pad_tokens:
        assert not out[qsl[-1]:].any()


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("nh,nkv", [(9, 3), (8, 8), (4, 1)])
def test_paged_attention_mixed_batch(nh, nkv, route):
    # (cached, new): decode, prefill without / with earlier context, chunk
    # ends on and off block boundaries.
    seqs = [(40, 1), (0, 37), (16, 16), (5, 1), (0, 1), (31, 50), (15, 2)]
    check_attention(seqs, nh, nkv, hd=64, bs=16, route=route)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_paged_attention_long_decode_and_prefill_tiles(route):
    # 600 new tokens after 129 cached: several BLAS tiles of 256 queries
    check_attention([(700, 1), (0, 300), (129, 600)], 9, 3, hd=64, bs=16, tile_q=16,
                    route=route)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_paged_attention_padding_tokens_are_zero(route):
    check_attention([(3, 2), (0, 4)], 4, 2, hd=16, bs=4, pad_tokens=3, route=route)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 40)), min_size=1, max_size=5),
    heads=st.sampled_from([(9, 3), (8, 8), (4, 1), (6, 2)]),
    hd=st.sampled_from([8, 16, 64]),
    bs=st.sampled_from([1, 4, 16]),
    tile_q=st.sampled_from([1, 3, 16]),
    seed=st.integers(0, 2**31 - 1),
    route=st.sampled_from(sorted(ROUTES)),
)
def test_paged_attention_random_batches(seqs, heads, hd, bs, tile_q, seed, route):
    check_attention(seqs, heads[0], heads[1], hd, bs, tile_q=tile_q, seed=seed, route=route)


@pytest.mark.parametrize("route", ["numba", "blas"])
def test_paged_attention_rejects_bad_block_id(route):
    ops = CpuOps(prefill_min_queries=ROUTES[route][0])
    rng = np.random.default_rng(1)
    q, cache, bt, seq_lens, qsl, _ = build_paged_batch(rng, [(3, 2)], 4, 2, 8, 4)
    bt[0, 1] = cache.shape[0]
    with pytest.raises(ValueError, match="block id"):
        ops.paged_attention(q, cache, bt, seq_lens, qsl, 0.3)
    bt[0, 1] = -1
    with pytest.raises(ValueError, match="block id"):
        ops.paged_attention(q, cache, bt, seq_lens, qsl, 0.3)


@pytest.mark.parametrize("route", ["numba", "blas"])
def test_paged_attention_rejects_bad_metadata(route):
    ops = CpuOps(prefill_min_queries=ROUTES[route][0])
    rng = np.random.default_rng(2)
    q, cache, bt, seq_lens, qsl, _ = build_paged_batch(rng, [(3, 2), (0, 3)], 4, 2, 8, 4)
    with pytest.raises(ValueError, match="seq_lens"):
        ops.paged_attention(q, cache, bt, np.array([1, 3], np.int32), qsl, 0.3)  # L < n_new
    with pytest.raises(ValueError, match="query_start_loc"):
        ops.paged_attention(q, cache, bt, seq_lens, np.array([0, 2, 9], np.int32), 0.3)  # > T
    with pytest.raises(ValueError):
        ops.paged_attention(q, cache, bt, seq_lens, qsl[:-1], 0.3)
    with pytest.raises(ValueError, match="too narrow"):
        ops.paged_attention(q, cache, bt[:, :1], seq_lens, qsl, 0.3)  # table too narrow


# --------------------------------------------------------------------------- #
# other ops
# --------------------------------------------------------------------------- #


def test_write_kv_reads_back_and_skips_negative_slots():
    rng = np.random.default_rng(3)
    nb, bs, nkv, hd = 5, 4, 3, 8
    cache = OPS.allocate_kv_cache(nb, bs, nkv, hd)
    T = 7
    k = rng.standard_normal((T, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((T, nkv, hd)).astype(np.float32)
    slots = np.array([19, 0, -1, 5, 6, -1, 12], np.int64)
    OPS.write_kv(k, v, cache, slots)
    written = np.zeros(nb * bs, bool)
    for t, s in enumerate(slots):
        if s < 0:
            continue
        written[s] = True
        np.testing.assert_array_equal(cache[s // bs, 0, s % bs], k[t])
        np.testing.assert_array_equal(cache[s // bs, 1, s % bs], v[t])
    flat = cache.transpose(0, 2, 1, 3, 4).reshape(nb * bs, 2, nkv, hd)
    assert not flat[~written].any()
    with pytest.raises(ValueError, match="slot"):
        OPS.write_kv(k[:1], v[:1], cache, np.array([nb * bs], np.int64))


def test_rms_norm_matches_float64():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((13, 576)) * 3).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + 1e-5) * w
    out = OPS.rms_norm(x, w, 1e-5)
    assert out.dtype == np.float32
    assert rel_err(out, ref) < 1e-6


def test_fused_add_rms_norm_in_place():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((9, 96)).astype(np.float32)
    res = rng.standard_normal((9, 96)).astype(np.float32)
    w = rng.standard_normal(96).astype(np.float32)
    r64 = res.astype(np.float64) + x
    ref = r64 / np.sqrt(np.mean(r64 * r64, -1, keepdims=True) + 1e-6) * w
    OPS.fused_add_rms_norm(x, res, w, 1e-6)
    np.testing.assert_allclose(res, r64, rtol=1e-6, atol=1e-6)
    assert rel_err(x, ref) < 1e-6
    with pytest.raises(ValueError):
        OPS.fused_add_rms_norm(x, x, w, 1e-6)


def rope_hf_float64(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """HF apply_rotary_pos_emb (q * cos + rotate_half(q) * sin), float64."""
    hd = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    freqs = positions.astype(np.float64)[:, None] * inv_freq
    emb = np.concatenate([freqs, freqs], -1)[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    rotate_half = np.concatenate([-x2, x1], -1)
    return x * np.cos(emb) + rotate_half * np.sin(emb)


@pytest.mark.parametrize("flat", [False, True])
def test_rotary_embedding_matches_hf_rotate_half(flat):
    rng = np.random.default_rng(6)
    T, nh, nkv, hd, theta = 11, 9, 3, 64, 100000.0
    positions = rng.integers(0, 2048, T).astype(np.int64)
    q = rng.standard_normal((T, nh, hd)).astype(np.float32)
    k = rng.standard_normal((T, nkv, hd)).astype(np.float32)
    ref_q = rope_hf_float64(q.astype(np.float64), positions, theta)
    ref_k = rope_hf_float64(k.astype(np.float64), positions, theta)
    cache = build_rope_cache(hd, 2048, theta)
    qq = q.reshape(T, nh * hd) if flat else q
    kk = k.reshape(T, nkv * hd) if flat else k
    OPS.rotary_embedding(positions, qq, kk, cache, hd)
    assert rel_err(q, ref_q) < 1e-6 and rel_err(k, ref_k) < 1e-6


def test_rotary_embedding_non_contiguous_view_and_bad_position():
    rng = np.random.default_rng(7)
    T, nh, nkv, hd = 5, 4, 2, 16
    qkv = rng.standard_normal((T, (nh + 2 * nkv) * hd)).astype(np.float32)
    positions = np.arange(T, dtype=np.int64)
    ref_q = rope_hf_float64(qkv[:, : nh * hd].reshape(T, nh, hd).astype(np.float64), positions, 1e4)
    q, k = qkv[:, : nh * hd], qkv[:, nh * hd:(nh + nkv) * hd]
    OPS.rotary_embedding(positions, q, k, build_rope_cache(hd, 16, 1e4), hd)
    assert rel_err(qkv[:, : nh * hd].reshape(T, nh, hd), ref_q) < 1e-6
    with pytest.raises(ValueError, match="position"):
        OPS.rotary_embedding(np.array([0, 1, 2, 3, 16]), q, k, build_rope_cache(hd, 16, 1e4), hd)


def test_build_rope_cache_layout():
    c = build_rope_cache(8, 3, 10000.0)
    assert c.shape == (3, 8) and c.dtype == np.float32
    np.testing.assert_array_equal(c[0], [1, 1, 1, 1, 0, 0, 0, 0])
    f = 10000.0 ** (-np.arange(0, 8, 2) / 8)
    np.testing.assert_allclose(c[2], np.concatenate([np.cos(2 * f), np.sin(2 * f)]), rtol=1e-6)


def test_silu_and_mul_matches_float64():
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((7, 2 * 40)) * 6).astype(np.float32)
    x[0, 0], x[0, 1] = -200.0, 200.0  # exp overflow / underflow
    x64 = x.astype(np.float64)
    g, u = x64[:, :40], x64[:, 40:]
    ref = g / (1.0 + np.exp(-g)) * u
    out = OPS.silu_and_mul(x)
    assert out.shape == (7, 40) and np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=1e-6)


def test_embedding_and_linear():
    rng = np.random.default_rng(9)
    table = rng.standard_normal((50, 12)).astype(np.float32)
    ids = np.array([3, 0, 49, 3])
    np.testing.assert_array_equal(OPS.embedding(ids, table), table[ids])
    with pytest.raises(ValueError):
        OPS.embedding(np.array([50]), table)
    x = rng.standard_normal((4, 12)).astype(np.float32)
    w = rng.standard_normal((7, 12)).astype(np.float32)
    b = rng.standard_normal(7).astype(np.float32)
    np.testing.assert_allclose(OPS.linear(x, w, b), x.astype(np.float64) @ w.T + b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        OPS.linear(x, w.T)


def test_linear_without_bias_matches_float64():
    rng = np.random.default_rng(12)
    x = rng.standard_normal((5, 33)).astype(np.float32)
    w = rng.standard_normal((19, 33)).astype(np.float32)
    out = OPS.linear(x, w)
    assert out.shape == (5, 19) and out.dtype == np.float32
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T.astype(np.float64),
                               rtol=1e-5, atol=1e-5)
    out[...] = 0  # a new array: neither input is aliased
    assert x.any() and w.any()
    np.testing.assert_allclose(OPS.linear(x[:0], w), np.zeros((0, 19)))
    with pytest.raises(ValueError):
        OPS.linear(x, w, np.zeros(18, np.float32))  # bias of the wrong size


@pytest.mark.parametrize("chunks", [0, 2])
@pytest.mark.parametrize("m", [1, 3, 8, 9])
def test_dense_linear_gemv_and_blas_paths_match_float64(m, chunks, monkeypatch):
    """Up to DENSE_GEMV_MAX_ROWS rows take the Numba GEMV kernel (serially or
    in two channel ranges), more take BLAS; N = 4 * 5 + 3 leaves a partial
    group of four channels. Bound: float32 summation, (K + 1) u |x| |w|^T."""
    from kvserve.cpu import quant_ops

    monkeypatch.setattr(quant_ops, "parallel_chunks", lambda shape, n, threads: chunks)
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, 77)).astype(np.float32)
    w = rng.standard_normal((23, 77)).astype(np.float32)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = 78 * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(w).T)
    assert (np.abs(OPS.linear(x, w) - ref) <= bound).all()


def test_allocate_kv_cache_is_zeroed_with_the_paged_layout():
    cache = OPS.allocate_kv_cache(6, 4, 3, 8)
    assert cache.shape == (6, 2, 4, 3, 8) and cache.dtype == np.float32
    assert cache.flags.c_contiguous and cache.flags.writeable
    assert not cache.any()
    other = OPS.allocate_kv_cache(6, 4, 3, 8)
    cache[...] = 1.0
    assert not other.any()  # each call is a fresh buffer
    with pytest.raises(ValueError):
        OPS.allocate_kv_cache(0, 4, 3, 8)


def test_to_device_to_numpy_round_trip():
    rng = np.random.default_rng(13)
    a64 = rng.standard_normal((4, 6))
    d = OPS.to_device(a64)
    assert d.dtype == np.float32 and d.flags.c_contiguous and d.flags.writeable
    back = OPS.to_numpy(d)
    assert isinstance(back, np.ndarray) and back.shape == (4, 6)
    np.testing.assert_array_equal(back, a64.astype(np.float32))
    a32 = a64.astype(np.float32)
    np.testing.assert_array_equal(OPS.to_numpy(OPS.to_device(a32)), a32)  # exact
    view = a32.T  # non-contiguous
    np.testing.assert_array_equal(OPS.to_numpy(OPS.to_device(view)), view)
    ro = a32.copy()
    ro.flags.writeable = False
    d = OPS.to_device(ro)
    assert d.flags.writeable
    d[0, 0] = 123.0
    assert ro[0, 0] != 123.0  # copied, the read-only input untouched
    ids = np.array([5, 0, 2**40], np.int64)
    d = OPS.to_device(ids)
    assert d.dtype == np.int64
    np.testing.assert_array_equal(OPS.to_numpy(d), ids)


# --------------------------------------------------------------------------- #
# the reference itself (the whole-model comparisons of LlamaModel.forward and
# ModelRunner.execute with it are in tests/model/test_forward_reference.py)
# --------------------------------------------------------------------------- #


def test_reference_attention_is_softmax_of_visible_keys():
    rng = np.random.default_rng(11)
    k = rng.standard_normal((5, 1, 4))
    v = rng.standard_normal((5, 1, 4))
    q = rng.standard_normal((2, 2, 4))
    out = reference_attention(q, k, v, 0.5)
    for i, L in enumerate((4, 5)):
        for h in range(2):
            s = k[:L, 0] @ q[i, h] * 0.5
            p = np.exp(s - s.max())
            np.testing.assert_allclose(out[i, h], (p / p.sum()) @ v[:L, 0], rtol=1e-12)
