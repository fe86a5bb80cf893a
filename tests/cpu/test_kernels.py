"""What only the CPU backend's ops (kvserve.cpu.ops.CpuOps) do, against float64
NumPy formulas and the dense reference (kvserve.testing.reference): the routes
of paged attention (the Numba kernel serial and parallel, the BLAS prefill
path, the split between them) on random batches, the float64 sum of
``rms_norm``, in-place ops on non-contiguous views, the dense GEMV and BLAS
paths of ``linear``. What every backend must do is the conformance suite's,
``tests/backends/test_ops_conformance.py``."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.cpu import ops as cpu_ops
from kvserve.cpu.ops import CpuOps
from kvserve.model.ops import build_rope_cache
from kvserve.testing.reference import reference_attention

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


def test_rms_norm_matches_float64():
    """Its sum of squares is accumulated in float64: within 1e-6 at 576 channels."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((13, 576)) * 3).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + 1e-5) * w
    out = OPS.rms_norm(x, w, 1e-5)
    assert out.dtype == np.float32
    assert rel_err(out, ref) < 1e-6


def rope_hf_float64(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """HF apply_rotary_pos_emb (q * cos + rotate_half(q) * sin), float64."""
    hd = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    freqs = positions.astype(np.float64)[:, None] * inv_freq
    emb = np.concatenate([freqs, freqs], -1)[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    rotate_half = np.concatenate([-x2, x1], -1)
    return x * np.cos(emb) + rotate_half * np.sin(emb)


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


@pytest.mark.parametrize("chunks", [0, 2])
@pytest.mark.parametrize("m", [1, 3, 8, 9])
def test_dense_linear_gemv_and_blas_paths_match_float64(m, chunks, monkeypatch):
    """Up to DENSE_GEMV_MAX_ROWS rows take the Numba GEMV kernel (serially or
    in two channel ranges), more take BLAS; N = 4 * 5 + 3 leaves a partial
    group of four channels. Bound: float32 summation, (K + 1) u |x| |w|^T."""
    monkeypatch.setattr(cpu_ops, "parallel_chunks", lambda shape, n, threads: chunks)
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, 77)).astype(np.float32)
    w = rng.standard_normal((23, 77)).astype(np.float32)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = 78 * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(w).T)
    assert (np.abs(OPS.linear(x, w) - ref) <= bound).all()


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
