"""Gemma 3's pieces on the CUDA backend (issue 30): ``CudaOps.gelu_tanh_and_mul``
and sliding-window attention (``window=``) in every attention route: split-K
decode, the prefill tiles, the fused decode kernel of ``rope_kv_attention``,
and the KV-cache groups of a step (``prepare_step``, the CUDA-graph buckets).

References are float64 NumPy written here. The paged batches put NaN in
every cache slot a query must not read: the slots of each sequence before
the window of its first new token, and whole blocks before that window,
which the block table points at a NaN block (the KV manager frees them, and
the null block or another request's block takes their place); a kernel
that reads such a key, even to mask it, puts NaN in its output.

Runs under Numba's CUDA simulator (tiny shapes: head_dim 8, blocks of 4
keys, split-K partitions of 4 keys). Tolerances as ``test_cuda_ops_routes``:
float32 1e-5 relative, float16 plus half an ulp of the output.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))  # the references
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))

from ops_references import ref_rope, rel_err  # noqa: E402

from kvserve.cuda import kernels  # noqa: E402
from kvserve.cuda.ops import CudaOps  # noqa: E402
from kvserve.cuda.step import check_attention_metadata  # noqa: E402
from kvserve.model.input_batch import BatchInputs  # noqa: E402
from kvserve.model.llama import AttentionMetadata  # noqa: E402
from kvserve.model.ops import StepGeometry, build_rope_cache  # noqa: E402

F32_REL = 1e-5
F16_REL = 2.0**-11 + F32_REL
BS = 4  # KV block size (tokens)
HD = 8  # head dim
PARTITION = 4  # split-K partition (keys)


def make_ops(dtype=np.float32, **kw) -> CudaOps:
    return CudaOps(dtype=dtype, partition_size=kw.pop("partition_size", PARTITION), **kw)


def rel(dtype) -> float:
    return F16_REL if np.dtype(dtype) == np.float16 else F32_REL


# --------------------------------------------------------------------------- #
# gelu_tanh_and_mul
# --------------------------------------------------------------------------- #


def ref_gelu_tanh_and_mul(x: np.ndarray) -> np.ndarray:
    """PyTorch's gelu(approximate="tanh")(gate) * up in float64."""
    x = np.asarray(x, np.float64)
    inter = x.shape[1] // 2
    a, b = x[:, :inter], x[:, inter:]
    return 0.5 * a * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * a**3))) * b


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape", [(1, 2), (3, 10), (2, 70)])
def test_gelu_tanh_and_mul_equals_the_float64_formula(dtype, shape):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    x[0, 0] = -30.0  # tanh saturated: gelu ~ 0
    x[-1, shape[1] // 2 - 1] = 12.0  # gelu ~ identity
    ops = make_ops(dtype)
    out = ops.to_numpy(ops.gelu_tanh_and_mul(ops.to_device(x)))
    assert out.dtype == dtype and out.shape == (shape[0], shape[1] // 2)
    assert rel_err(out, ref_gelu_tanh_and_mul(x)) <= rel(dtype)


def test_gelu_tanh_and_mul_is_not_the_erf_gelu_nor_silu():
    """The tanh form differs from the exact (erf) GELU by ~1e-3 near |a| = 2:
    the test above would tell them apart; here, that the values are the tanh form's."""
    x = np.array([[2.0, -1.0, 1.0, 1.0]], np.float32)
    ops = make_ops()
    out = ops.to_numpy(ops.gelu_tanh_and_mul(ops.to_device(x)))
    erf_gelu = np.array([2.0 * 0.5 * (1 + math.erf(2.0 / math.sqrt(2.0))),
                         -0.5 * (1 + math.erf(-1.0 / math.sqrt(2.0)))])
    np.testing.assert_allclose(out[0], ref_gelu_tanh_and_mul(x)[0], rtol=1e-6)
    assert np.abs(out[0] - erf_gelu).max() > 1e-4


def test_gelu_tanh_and_mul_refuses_an_odd_width():
    ops = make_ops()
    with pytest.raises(ValueError, match="gelu_tanh_and_mul: x last dimension must be even"):
        ops.gelu_tanh_and_mul(ops.to_device(np.ones((2, 3), np.float32)))


# --------------------------------------------------------------------------- #
# windowed paged attention
# --------------------------------------------------------------------------- #


def window_start(pos: int, window: int) -> int:
    """First key a query at ``pos`` sees (keys pos - window < j <= pos)."""
    return max(0, pos + 1 - window) if window else 0


def windowed_batch(rng, seqs, nkv: int, group: int, window: int, pad_tokens: int = 0,
                   freed: int = 0):
    """A paged batch of ``seqs`` = [(cached, n_new), ...] whose every unreadable
    slot is NaN: the slots before the window of each sequence's first new token
    (position ``cached``), the blocks wholly before it (their table entries
    point at block ``freed``, a NaN block: 0, the null block, or -1, which a
    kernel reading it would take as the last block, also NaN), and the slots
    past each context. Returns (q, cache, block_tables, seq_lens,
    query_start_loc, K, V) with K, V float64 [L, nkv, HD] per sequence (NaN
    before the window too: the reference must not read them either)."""
    blocks = [-(-(c + n) // BS) for c, n in seqs]
    num_blocks = sum(blocks) + 2  # block 0 and the last: NaN
    perm = 1 + rng.permutation(num_blocks - 2).astype(np.int32)
    cache = np.full((num_blocks, 2, BS, nkv, HD), np.nan)
    bt = np.full((len(seqs), max(blocks) + 1), freed, np.int32)
    ks, vs, used = [], [], 0
    for s, ((c, n), nb) in enumerate(zip(seqs, blocks, strict=True)):
        bt[s, :nb] = perm[used:used + nb]
        used += nb
        lo = window_start(c, window)
        bt[s, :lo // BS] = freed
        kv = rng.standard_normal((2, c + n, nkv, HD))
        kv[:, :lo] = np.nan
        pos = np.arange(lo, c + n)
        cache[bt[s, pos // BS], :, pos % BS] = kv[:, lo:].transpose(1, 0, 2, 3)
        ks.append(kv[0])
        vs.append(kv[1])
    qsl = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    q = rng.standard_normal((int(qsl[-1]) + pad_tokens, nkv * group, HD))
    seq_lens = np.array([c + n for c, n in seqs], np.int32)
    return q, cache, bt, seq_lens, qsl, ks, vs


def ref_windowed_attention(q, seqs, qsl, ks, vs, scale: float, window: int) -> np.ndarray:
    """Float64 attention of each new token at position p over keys
    p - window < j <= p (all j <= p for window 0); rows of no sequence zero."""
    q = np.asarray(q, np.float64)
    out = np.zeros_like(q)
    for s, (c, n) in enumerate(seqs):
        k, v = ks[s], vs[s]
        group = q.shape[1] // k.shape[1]
        for i in range(n):
            pos, t = c + i, qsl[s] + i
            lo = window_start(pos, window)
            for h in range(q.shape[1]):
                logits = k[lo:pos + 1, h // group] @ q[t, h] * scale
                p = np.exp(logits - logits.max())
                out[t, h] = p @ v[lo:pos + 1, h // group] / p.sum()
    return out


ROUTES = {"split": {}, "all-decode": {"prefill_min_queries": 10**6},
          "all-prefill": {"prefill_min_queries": 1, "prefill_tile_q": 3}}

WINDOW_CASES = {
    # contexts 1 .. 17 around the window (6) and the partitions (4)
    "decodes": dict(seqs=[(0, 1), (2, 1), (5, 1), (6, 1), (7, 1), (12, 1), (16, 1)], window=6),
    # chunks crossing the window, in tiles of up to 3 queries (all-prefill)
    "chunks": dict(seqs=[(5, 7), (0, 9), (13, 2)], window=4),
    "window-1": dict(seqs=[(3, 1), (2, 5)], window=1),
    "window-beyond-context": dict(seqs=[(3, 1), (2, 6)], window=100),
    "gqa4-mixed-padded": dict(seqs=[(9, 1), (4, 6), (0, 1)], window=5, nkv=1, group=4,
                              pad_tokens=2),
}


def run_windowed(case: dict, dtype=np.float32, freed: int = 0, seed: int = 0, **ops_kw):
    """(CudaOps.paged_attention output, float64 reference) of a case."""
    seqs, window = case["seqs"], case["window"]
    nkv, group = case.get("nkv", 2), case.get("group", 1)
    rng = np.random.default_rng(seed)
    q, cache, bt, sl, qsl, ks, vs = windowed_batch(rng, seqs, nkv, group, window,
                                                   case.get("pad_tokens", 0), freed)
    ops = make_ops(dtype, **ops_kw)
    to = ops.to_device
    out = ops.to_numpy(ops.paged_attention(to(q), to(cache), to(bt), to(sl), to(qsl), HD ** -0.5,
                                           window=window))
    stored = [[np.asarray(a, dtype).astype(np.float64) for a in (k, v)] for k, v in zip(ks, vs)]
    ref = ref_windowed_attention(np.asarray(q, dtype), seqs, qsl, [k for k, _ in stored],
                                 [v for _, v in stored], HD ** -0.5, window)
    return out, ref, qsl


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", WINDOW_CASES)
def test_windowed_paged_attention_equals_the_reference_and_reads_no_freed_key(case, route):
    out, ref, qsl = run_windowed(WINDOW_CASES[case], **ROUTES[route])
    assert not np.isnan(out).any(), "a key before the window was read"
    assert not out[int(qsl[-1]):].any()  # padding rows
    assert rel_err(out, ref) <= F32_REL


@pytest.mark.parametrize("case", ["decodes", "chunks"])
def test_windowed_paged_attention_in_float16(case):
    out, ref, _ = run_windowed(WINDOW_CASES[case], np.float16)
    assert out.dtype == np.float16 and not np.isnan(out).any()
    assert rel_err(out, ref) <= F16_REL


@pytest.mark.parametrize("freed", [-1, 2**30])
@pytest.mark.parametrize("route", ROUTES)
def test_freed_entries_may_be_any_id_and_are_neither_checked_nor_read(freed, route):
    """Entries before the window set to -1 or far past the cache: accepted
    with the window and never read (not even loaded and masked: as
    ``kv_cache[-1]``, a NaN block, -1 would show; 2**30 would raise
    IndexError under the simulator and fault on a GPU), refused without."""
    case = WINDOW_CASES["chunks"]
    out, ref, _ = run_windowed(case, freed=freed, **ROUTES[route])
    assert not np.isnan(out).any() and rel_err(out, ref) <= F32_REL
    rng = np.random.default_rng(0)
    q, cache, bt, sl, qsl, _, _ = windowed_batch(rng, case["seqs"], 2, 1, case["window"],
                                                 freed=freed)
    ops = make_ops()
    to = ops.to_device
    with pytest.raises(ValueError, match="block id out of range"):
        ops.paged_attention(to(q), to(cache), to(bt), to(sl), to(qsl), 0.5)


def test_a_window_beyond_every_context_is_full_attention():
    case = WINDOW_CASES["window-beyond-context"]
    full, _, _ = run_windowed({**case, "window": 0})
    wide, _, _ = run_windowed(case)
    np.testing.assert_array_equal(wide, full)


@pytest.mark.parametrize("window", [-1, 2.0, True])
def test_a_bad_window_is_refused(window):
    ops = make_ops()
    q = ops.to_device(np.zeros((1, 1, HD)))
    cache = ops.allocate_kv_cache(1, BS, 1, HD)
    meta = [ops.to_device(np.array(a, np.int32)) for a in ([[0]], [1], [0, 1])]
    with pytest.raises(ValueError, match="window must be an int >= 0"):
        ops.paged_attention(q, cache, *meta, 0.5, window=window)


def test_check_attention_metadata_skips_only_the_blocks_before_the_window():
    # one sequence: 3 cached + 2 new tokens (positions 3, 4), window 2:
    # keys from position 2 on, i.e. blocks 1 and 2 of size 2; block 0 unread
    bt = np.array([[-1, 0, 1]], np.int32)
    args = (np.array([5], np.int32), np.array([0, 2], np.int32), 2, 2, 2)
    check_attention_metadata(bt, *args, window=2)
    with pytest.raises(ValueError, match="block id out of range"):
        check_attention_metadata(bt, *args)
    with pytest.raises(ValueError, match="block id out of range"):
        check_attention_metadata(bt, *args, window=3)  # position 3 sees key 1: block 0


# --------------------------------------------------------------------------- #
# the fused decode kernel (rope_kv_attention) and the three-op path
# --------------------------------------------------------------------------- #


def _decode_step(seed: int, num_heads: int, num_kv_heads: int, contexts: list[int],
                 windows: list[int]):
    """A decode step of ``len(contexts)`` sequences whose earlier keys sit in a
    cache that is NaN wherever a query must not read (before its window, and
    whole freed blocks: table entries 0, a NaN block). One KV-cache group per
    entry of ``windows`` (0: full attention), each with its own tables and
    slots (blocks of the one cache). Returns (qkv, batch, cache, rope table,
    geometry, dense K/V per group)."""
    groups = len(windows)
    rng = np.random.default_rng(seed)
    T = len(contexts)
    per_seq = -(-max(contexts) // BS)
    num_blocks = groups * T * per_seq + 1
    cache = np.full((num_blocks, 2, BS, num_kv_heads, HD), np.nan, np.float32)
    perm = 1 + rng.permutation(num_blocks - 1)
    positions = np.array(contexts, np.int64) - 1
    tables, slots, dense = [], [], []
    for g, window in enumerate(windows):
        table = perm[g * T * per_seq:(g + 1) * T * per_seq].reshape(T, per_seq).astype(np.int32)
        kv = rng.standard_normal((T, 2, per_seq * BS, num_kv_heads, HD)).astype(np.float32)
        for s, ctx in enumerate(contexts):
            lo = window_start(ctx - 1, window)
            table[s, :lo // BS] = 0
            kv[s, :, :lo] = np.nan
            pos = np.arange(lo, ctx - 1)  # the new token's K/V: written by the step
            cache[table[s, pos // BS], :, pos % BS] = kv[s, :, pos]  # [n, 2, nkv, HD]
        tables.append(table)
        slots.append((table[np.arange(T), positions // BS] * BS + positions % BS).astype(np.int64))
        dense.append(kv)
    batch = BatchInputs(
        input_ids=np.zeros(T, np.int64), positions=positions, slot_mapping=slots[0],
        block_tables=tables[0], seq_lens=np.array(contexts, np.int32),
        query_start_loc=np.arange(T + 1, dtype=np.int32),
        logits_indices=np.arange(T, dtype=np.int64), sample_ids=tuple(map(str, range(T))),
        group_tables=tuple(zip(slots[1:], tables[1:])))
    qkv = rng.standard_normal((T, (num_heads + 2 * num_kv_heads) * HD)).astype(np.float32)
    rope = build_rope_cache(HD, 64, 1000.0)
    return qkv, batch, cache, rope, StepGeometry(16, 64, num_blocks, BS), dense


def ref_decode(qkv, contexts, rope, dense, num_heads, num_kv_heads, window):
    """Float64 RoPE of q and the new k, then windowed attention over the
    group's dense K/V with the new token's K/V in its place."""
    T = qkv.shape[0]
    x = qkv.astype(np.float64)
    nq, nk = num_heads * HD, num_kv_heads * HD
    pos = np.array(contexts) - 1
    q = ref_rope(x[:, :nq].reshape(T, num_heads, HD), pos, rope)
    k_new = ref_rope(x[:, nq:nq + nk].reshape(T, num_kv_heads, HD), pos, rope)
    v_new = x[:, nq + nk:].reshape(T, num_kv_heads, HD)
    ks, vs = [], []
    for s, ctx in enumerate(contexts):
        k = dense[s, 0, :ctx].astype(np.float64)
        v = dense[s, 1, :ctx].astype(np.float64)
        k[ctx - 1], v[ctx - 1] = k_new[s], v_new[s]
        ks.append(k)
        vs.append(v)
    seqs = [(ctx - 1, 1) for ctx in contexts]
    return ref_windowed_attention(q, seqs, np.arange(T + 1), ks, vs, HD ** -0.5, window), \
        k_new, v_new


FUSED_CASES = {
    # window 4 = one partition although contexts reach 14: one launch
    "one-partition": dict(heads=(4, 2), contexts=[3, 9, 14], window=4, launches=1),
    # window 6: two partitions of 4 from the window's start, then the reduction
    "split-k": dict(heads=(8, 1), contexts=[1, 6, 7, 14], window=6, launches=2),
    "window-1": dict(heads=(2, 2), contexts=[5, 2], window=1, launches=1),
}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "three-ops"])
@pytest.mark.parametrize("case", FUSED_CASES)
def test_windowed_rope_kv_attention_equals_the_reference(case, fused):
    c = FUSED_CASES[case]
    (nh, nkv), contexts, window = c["heads"], c["contexts"], c["window"]
    qkv, batch, cache, rope, geometry, dense = _decode_step(5, nh, nkv, contexts, [window])
    ops = make_ops()
    step = ops.prepare_step(batch, geometry)
    gpu_cache = ops.to_device(cache)
    attn = AttentionMetadata(step.slot_mapping, step.block_tables, step.seq_lens,
                             step.query_start_loc, plan=step if fused else None)
    ops.reset_counters()
    got = ops.to_numpy(ops.rope_kv_attention(ops.to_device(qkv), step.positions,
                                             ops.to_device(rope), gpu_cache, attn, HD ** -0.5,
                                             nh, nkv, HD, window=window))
    if fused:
        assert ops.counters.launches == c["launches"]
    ref, k_new, v_new = ref_decode(qkv, contexts, rope, dense[0], nh, nkv, window)
    assert not np.isnan(got).any(), "a key before the window was read"
    assert rel_err(got, ref) <= F32_REL
    written = ops.to_numpy(gpu_cache)
    slots = batch.slot_mapping
    np.testing.assert_allclose(written[slots // BS, 0, slots % BS], k_new, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(written[slots // BS, 1, slots % BS], v_new.astype(np.float32))


def test_prepare_step_uploads_every_kv_group_and_each_group_reads_its_own_tables():
    """Two groups (a full one, a sliding one) of one decode step: the step's
    views carry group 1's slots and tables, checked and uploaded in the one
    copy; each group's attention reads its own blocks."""
    nh, nkv, contexts, window = 4, 2, [3, 10], 4
    qkv, batch, cache, rope, geometry, dense = _decode_step(9, nh, nkv, contexts, [0, window])
    ops = make_ops()
    ops.reset_counters()
    step = ops.prepare_step(batch, geometry)
    assert ops.counters.h2d == 1
    ((slots1, tables1),) = step.group_tables
    np.testing.assert_array_equal(ops.to_numpy(tables1), batch.group_tables[0][1])
    np.testing.assert_array_equal(ops.to_numpy(slots1), batch.group_tables[0][0])
    gpu_cache = ops.to_device(cache)
    groups = [(step.slot_mapping, step.block_tables, 0), (slots1, tables1, window)]
    for g, (slots, tables, w) in enumerate(groups):
        attn = AttentionMetadata(slots, tables, step.seq_lens, step.query_start_loc, plan=step)
        got = ops.to_numpy(ops.rope_kv_attention(ops.to_device(qkv), step.positions,
                                                 ops.to_device(rope), gpu_cache, attn,
                                                 HD ** -0.5, nh, nkv, HD, window=w))
        assert not np.isnan(got).any(), f"group {g} read a freed key"
        ref, _, _ = ref_decode(qkv, contexts, rope, dense[g], nh, nkv, w)
        assert rel_err(got, ref) <= F32_REL, f"group {g}"


def test_a_bad_block_id_of_a_second_group_is_refused_before_any_copy():
    qkv, batch, cache, rope, geometry, _ = _decode_step(9, 4, 2, [3, 10], [0, 4])
    slots, tables = batch.group_tables[0]
    bad = tables.copy()
    bad[1, -1] = geometry.num_blocks
    import dataclasses
    ops = make_ops()
    ops.reset_counters()
    with pytest.raises(ValueError, match="block id out of range"):
        ops.prepare_step(dataclasses.replace(batch, group_tables=((slots, bad),)), geometry)
    assert ops.counters.h2d == 0


# --------------------------------------------------------------------------- #
# the CUDA-graph buckets with two KV-cache groups
# --------------------------------------------------------------------------- #


class _TwoGroupModel:
    """A stand-in model of two layers, one per KV-cache group (full, then
    sliding with ``window``), whose "hidden states" are the attention
    outputs: what ``decode_run`` must hand each layer is its group's tables."""

    def __init__(self, ops, qkv_table, rope, nh, nkv, window):
        self.ops, self.qkv_table, self.rope = ops, qkv_table, rope
        self.nh, self.nkv, self.window = nh, nkv, window

    def hidden_states(self, input_ids, positions, attn, kv_caches, logits_indices):
        outs = []
        for layer, window in enumerate((0, self.window)):
            qkv = self.ops.embedding(input_ids, self.qkv_table)
            outs.append(self.ops.rope_kv_attention(qkv, positions, self.rope, kv_caches[layer],
                                                   attn[layer], HD ** -0.5, self.nh, self.nkv,
                                                   HD, window=window))
        out = self.ops.xp.concatenate([o.reshape(o.shape[0], -1) for o in outs], axis=1)
        return out[logits_indices]

    def compute_logits(self, hidden):
        return hidden


# the padding rows of a bucket read key 0 of block 0, NaN in this cache: their
# (ignored) rows are NaN and the split-K reduction warns about them
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_graph_buckets_pad_every_group_and_replay_the_eager_step():
    from kvserve.cuda.graphs import DecodeGraphs, EagerReplay, decode_run

    nh, nkv, contexts, window = 2, 1, [3, 10, 6], 4
    _, batch, cache, rope, geometry, _ = _decode_step(2, nh, nkv, contexts, [0, window])
    rng = np.random.default_rng(3)
    table = rng.standard_normal((geometry.vocab_size, (nh + 2 * nkv) * HD)).astype(np.float32)
    import dataclasses
    batch = dataclasses.replace(batch, input_ids=np.array([3, 7, 1], np.int64))
    results = {}
    for mode in ("eager", "graphs"):
        ops = make_ops()
        caches = [ops.to_device(cache), ops.to_device(cache)]  # one buffer per layer
        model = _TwoGroupModel(ops, ops.to_device(table), ops.to_device(rope), nh, nkv, window)
        run = decode_run(model, caches)
        if mode == "eager":  # each layer given its group's tables here
            step = ops.prepare_step(batch, geometry)
            tables = [(step.slot_mapping, step.block_tables), *step.group_tables]
            attn = [AttentionMetadata(slots, bt, step.seq_lens, step.query_start_loc, plan=step)
                    for slots, bt in tables]
            results[mode] = ops.to_numpy(model.hidden_states(step.input_ids, step.positions, attn,
                                                             caches, step.logits_indices))
        else:
            graphs = DecodeGraphs(ops, run, geometry, max_num_seqs=4, max_model_len=16,
                                  capture=EagerReplay(), num_groups=2)
            assert graphs.accepts(batch)
            assert not graphs.accepts(dataclasses.replace(batch, group_tables=()))
            results[mode] = ops.to_numpy(graphs.replay(batch))
    assert not np.isnan(results["graphs"]).any()
    np.testing.assert_allclose(results["graphs"], results["eager"], rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- #
# the changed kernels compile for a GPU (PTX, no device needed)
# --------------------------------------------------------------------------- #

_PTX_SCRIPT = textwrap.dedent("""
    import types
    from numba import cuda, float32, int32, int64
    from numba.cuda import dispatcher
    # device functions ask the current device for its compute capability: there is none
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
    from kvserve.cuda import kernels as k
    f2, f3 = float32[:, ::1], float32[:, :, ::1]
    f4, f5 = float32[:, :, :, ::1], float32[:, :, :, :, ::1]
    i1, i2, l1 = int32[::1], int32[:, ::1], int64[::1]
    sigs = {
        "gelu_tanh_and_mul_kernel": (f2, f2),
        "silu_and_mul_kernel": (f2, f2),
        "decode_partition_kernel": (f3, f5, i2, i1, i1, i1, float32, int32, int64, f4, f3, f3),
        "decode_reduce_kernel": (f4, f3, f3, i1, i1, int32, int64, f3),
        "prefill_attention_kernel": (f3, f5, i2, i1, i1, i1, i1, float32, int32, f3),
        "decode_fused_kernel": (f2, l1, f2, float32[::1], float32[::1], float32, f5, i2, l1,
                                i1, i1, i1, int32, float32, int32, int32, f3, f4, f3, f3),
    }
    for name, sig in sigs.items():
        cuda.compile_ptx(getattr(k, name).py_func, sig, cc=(9, 0))
        print("compiled", name)
""")


def _nvvm_available() -> bool:
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    probe = "from numba.cuda.cudadrv import nvvm; nvvm.NVVM()"
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          timeout=120).returncode == 0


@pytest.mark.slow
def test_the_attention_and_activation_kernels_compile_to_ptx():
    """The simulator types nothing: Numba's CUDA target (NVVM, no GPU needed)
    must accept the kernels with the argument types ``CudaOps`` passes."""
    if not _nvvm_available():
        pytest.skip("NVVM (libnvvm) not found: cannot compile PTX here")
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    done = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 6
