"""The int8 KV cache on the CUDA backend (issue 31, ``--kv-cache-dtype int8``).

``CudaOps.allocate_kv_cache(..., "int8")`` gives int8 [num_blocks, 2,
block_size, nkv, hd + 4] (``kvserve.model.kv_quant``); ``write_kv`` and the
fused decode kernel quantize as they write, the attention kernels
dequantize as they read. References: ``kv_quant.quantize`` for the stored
bytes, and float64 attention written here over ``kv_quant.dequantize`` of
the same cache. Unreadable slots (before a window, freed blocks) hold a NaN
scale: a kernel that reads such a key, even to mask it, puts NaN in its
output.

Runs under Numba's CUDA simulator (tiny shapes: head_dim 8, blocks of 4
keys, split-K partitions of 4 keys); the PTX test compiles the int8
kernels with Numba's CUDA target when NVVM is found. Tolerances: float32
1e-5 relative (the kernels scale a key's dot product once where the
reference multiplies each value), float16 q plus half an ulp.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))  # the references
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))  # the tiny checkpoint

from ops_references import ref_rope, rel_err  # noqa: E402

from kvserve.cuda.ops import CudaOps  # noqa: E402
from kvserve.model import kv_quant  # noqa: E402
from kvserve.model.input_batch import BatchInputs  # noqa: E402
from kvserve.model.llama import AttentionMetadata  # noqa: E402
from kvserve.model.ops import StepGeometry, build_rope_cache  # noqa: E402

F32_REL = 1e-5
F16_REL = 2.0**-11 + F32_REL
BS = 4  # KV block size (tokens)
HD = 8  # head dim
W = HD + kv_quant.SCALE_BYTES  # a stored vector's bytes
PARTITION = 4  # split-K partition (keys)
#: The stored bytes of a vector nobody may read: codes 1, scale NaN.
NAN_VECTOR = np.concatenate([np.ones(HD, np.int8),
                             np.array([np.nan], "<f4").view(np.int8)])


def make_ops(dtype=np.float32, **kw) -> CudaOps:
    return CudaOps(dtype=dtype, partition_size=kw.pop("partition_size", PARTITION), **kw)


def window_start(pos: int, window: int) -> int:
    """First key a query at ``pos`` sees (keys pos - window < j <= pos)."""
    return max(0, pos + 1 - window) if window else 0


# --------------------------------------------------------------------------- #
# allocation and checks
# --------------------------------------------------------------------------- #


def test_allocate_int8_gives_zeroed_codes_and_scales_and_auto_is_unchanged():
    ops = make_ops(np.float16)
    cache = ops.allocate_kv_cache(3, BS, 2, HD, kv_cache_dtype="int8")
    assert cache.dtype == np.int8 and cache.shape == (3, 2, BS, 2, W)
    assert not cache.any() and not kv_quant.dequantize(cache).any()
    auto = ops.allocate_kv_cache(3, BS, 2, HD)
    assert auto.dtype == np.float16 and auto.shape == (3, 2, BS, 2, HD)
    assert ops.allocate_kv_cache(3, BS, 2, HD, kv_cache_dtype="auto").dtype == np.float16


@pytest.mark.parametrize(("kv_dtype", "head_dim", "match"), [
    ("fp8", HD, "fp8 is not built"), ("int4", HD, "must be one of"),
    ("int8", 6, "head_dim divisible by 4")])
def test_allocate_refuses_other_dtypes_and_an_unaligned_head_dim(kv_dtype, head_dim, match):
    with pytest.raises(ValueError, match=match):
        make_ops().allocate_kv_cache(2, BS, 1, head_dim, kv_cache_dtype=kv_dtype)


@pytest.mark.parametrize("shape", [(2, 2, BS, 1, 10), (2, 2, BS, 1, 4), (2, 2, BS, 12)])
def test_a_malformed_int8_cache_is_refused_naming_the_op(shape):
    ops = make_ops()
    xp = ops.xp
    k, slots = xp.zeros((1, 1, HD), np.float32), xp.zeros(1, np.int64)
    with pytest.raises(ValueError, match="write_kv: an int8 kv_cache must be"):
        ops.write_kv(k, k, xp.zeros(shape, np.int8), slots)
    with pytest.raises(ValueError, match="write_kv: kv_cache must be"):
        ops.write_kv(k, k, xp.zeros((2, 2, BS, 1, W), np.int16), slots)


def test_int8_ops_take_float_operands_only():
    ops = make_ops()
    cache = ops.allocate_kv_cache(2, BS, 1, HD, "int8")
    xp = ops.xp
    k = xp.zeros((1, 1, HD), np.float64)
    with pytest.raises(ValueError, match="write_kv: k must be"):
        ops.write_kv(k, k, cache, xp.zeros(1, np.int64))
    meta = [ops.to_device(np.array(a, np.int32)) for a in ([[0]], [1], [0, 1])]
    with pytest.raises(ValueError, match="paged_attention: q must be"):
        ops.paged_attention(xp.zeros((1, 1, HD), np.int8), cache, *meta, 0.5)


# --------------------------------------------------------------------------- #
# write_kv: byte for byte kv_quant.quantize
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_write_kv_stores_kv_quant_bytes_exactly(dtype):
    """Vectors of every kind: random, all zero, one ± extreme, rounding ties
    (max 127 makes the codes x itself: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> 0),
    a tiny one; k and v as strided views of a fused qkv row; a padding slot."""
    rng = np.random.default_rng(1)
    T, nkv = 5, 2
    qkv = (rng.standard_normal((T, 3 * nkv * HD)) * 3).astype(dtype)
    k = qkv[:, nkv * HD:2 * nkv * HD].reshape(T, nkv, HD)
    v = qkv[:, 2 * nkv * HD:].reshape(T, nkv, HD)
    k[0, 1] = 0.0
    v[1, 0] = [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49]
    k[2, 0] = [0, 0, 0, -40, 0, 0, 1e-3, 0]
    v[3, 1] = 1e-4
    slots = np.array([9, 0, 14, 3, -1])
    ops = make_ops(dtype)
    cache = ops.allocate_kv_cache(4, BS, nkv, HD, "int8")
    before = ops.to_numpy(cache)
    row = ops.to_device(qkv)
    views = [row[:, a * nkv * HD:(a + 1) * nkv * HD].reshape(T, nkv, HD) for a in (1, 2)]
    ops.write_kv(*views, cache, ops.to_device(slots))
    got = ops.to_numpy(cache)
    for t, slot in enumerate(slots[:-1]):
        b, o = divmod(int(slot), BS)
        np.testing.assert_array_equal(got[b, 0, o], kv_quant.quantize(k[t].astype(np.float32)))
        np.testing.assert_array_equal(got[b, 1, o], kv_quant.quantize(v[t].astype(np.float32)))
    assert got[0, 1, 0, 0, :HD].tolist() == [127, 0, 2, 2, 0, -2, -2, 3]  # v[1, 0], slot 0
    assert not got[2, 0, 1, 1].any()  # k[0, 1], slot 9: the zero vector, scale 0 too
    written = {divmod(int(s), BS) for s in slots[:-1]}
    untouched = [(b, o) for b in range(4) for o in range(BS) if (b, o) not in written]
    for b, o in untouched:  # the padding token wrote nothing
        np.testing.assert_array_equal(got[b, :, o], before[b, :, o])


def test_int8_blocks_move_as_stored_through_the_host():
    """The KV connector's copies (``to_numpy`` of a block, ``to_device``
    back): int8 stays int8, scales included, never converted to floats."""
    ops = make_ops(np.float16)
    cache = ops.allocate_kv_cache(3, BS, 1, HD, "int8")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 1, HD)).astype(np.float16)
    ops.write_kv(ops.to_device(x), ops.to_device(x), cache, ops.to_device(np.array([1, 6])))
    blocks = ops.to_numpy(cache[[0, 1]])
    back = ops.to_device(blocks)
    assert back.dtype == np.int8
    cache[[2, 0]] = back
    np.testing.assert_array_equal(ops.to_numpy(cache[2]), blocks[0])
    np.testing.assert_array_equal(ops.to_numpy(cache[0]), blocks[1])


# --------------------------------------------------------------------------- #
# paged attention: split-K decode and prefill tiles, with windows
# --------------------------------------------------------------------------- #


def int8_batch(rng, seqs, nkv: int, group: int, window: int, pad_tokens: int = 0):
    """A paged batch of ``seqs`` = [(cached, n_new), ...] in an int8 cache,
    each stored vector ``kv_quant.quantize`` of a random one, and every slot
    no query may read a NaN-scale vector: those before the window of a
    sequence's first new token, whole blocks before it (table entries 0, a
    NaN block), and the slots past each context. Returns (q, cache,
    block_tables, seq_lens, query_start_loc, K, V) with K, V float64
    ``kv_quant.dequantize`` of each sequence's stored vectors [L, nkv, HD]
    (NaN where unreadable)."""
    blocks = [-(-(c + n) // BS) for c, n in seqs]
    num_blocks = sum(blocks) + 1  # block 0: NaN
    perm = 1 + rng.permutation(num_blocks - 1).astype(np.int32)
    cache = np.empty((num_blocks, 2, BS, nkv, W), np.int8)
    cache[...] = NAN_VECTOR
    bt = np.zeros((len(seqs), max(blocks) + 1), np.int32)
    ks, vs, used = [], [], 0
    for s, ((c, n), nb) in enumerate(zip(seqs, blocks, strict=True)):
        bt[s, :nb] = perm[used:used + nb]
        used += nb
        lo = window_start(c, window)
        bt[s, :lo // BS] = 0
        stored = kv_quant.quantize(rng.standard_normal((2, c + n, nkv, HD)) * 2)
        pos = np.arange(lo, c + n)
        cache[bt[s, pos // BS], :, pos % BS] = stored[:, lo:].transpose(1, 0, 2, 3)
        kv = kv_quant.dequantize(stored).astype(np.float64)
        kv[:, :lo] = np.nan
        ks.append(kv[0])
        vs.append(kv[1])
    qsl = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    q = rng.standard_normal((int(qsl[-1]) + pad_tokens, nkv * group, HD))
    seq_lens = np.array([c + n for c, n in seqs], np.int32)
    return q, cache, bt, seq_lens, qsl, ks, vs


def ref_attention(q, seqs, qsl, ks, vs, scale: float, window: int) -> np.ndarray:
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

CASES = {
    # decodes of contexts 1 .. 17 over split-K partitions of 4, and chunks
    "full": dict(seqs=[(0, 1), (5, 1), (16, 1), (3, 6), (0, 5)], window=0),
    # contexts around the window (6) and the partitions; chunks crossing it
    "window": dict(seqs=[(2, 1), (7, 1), (12, 1), (5, 7), (13, 2)], window=6),
    "gqa4-window-padded": dict(seqs=[(9, 1), (4, 6), (0, 1)], window=5, nkv=1, group=4,
                               pad_tokens=2),
}


def run_case(case: dict, dtype=np.float32, seed: int = 0, **ops_kw):
    seqs, window = case["seqs"], case["window"]
    rng = np.random.default_rng(seed)
    q, cache, bt, sl, qsl, ks, vs = int8_batch(rng, seqs, case.get("nkv", 2),
                                               case.get("group", 1), window,
                                               case.get("pad_tokens", 0))
    ops = make_ops(dtype, **ops_kw)
    to = ops.to_device
    gpu_cache = to(cache)
    out = ops.to_numpy(ops.paged_attention(to(q.astype(dtype)), gpu_cache, to(bt), to(sl),
                                           to(qsl), HD ** -0.5, window=window))
    np.testing.assert_array_equal(ops.to_numpy(gpu_cache), cache)  # read only
    ref = ref_attention(q.astype(dtype), seqs, qsl, ks, vs, HD ** -0.5, window)
    return out, ref, qsl


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", CASES)
def test_int8_paged_attention_equals_the_reference_on_the_dequantized_cache(case, route):
    out, ref, qsl = run_case(CASES[case], **ROUTES[route])
    assert not np.isnan(out).any(), "a key before the window was read"
    assert not out[int(qsl[-1]):].any()  # padding rows
    assert rel_err(out, ref) <= F32_REL


def test_int8_paged_attention_with_a_float16_query():
    out, ref, _ = run_case(CASES["window"], np.float16)
    assert out.dtype == np.float16 and not np.isnan(out).any()
    assert rel_err(out, ref) <= F16_REL


# --------------------------------------------------------------------------- #
# rope_kv_attention: the fused decode kernel, the three-op path
# --------------------------------------------------------------------------- #


def int8_decode_step(seed: int, num_heads: int, num_kv_heads: int, contexts: list[int],
                     window: int):
    """A decode step of ``len(contexts)`` sequences whose earlier K/V are
    stored quantized in an int8 cache, NaN-scale wherever a query must not
    read. Returns (qkv, batch, cache, rope table, geometry)."""
    rng = np.random.default_rng(seed)
    T = len(contexts)
    per_seq = -(-max(contexts) // BS)
    num_blocks = T * per_seq + 1
    cache = np.empty((num_blocks, 2, BS, num_kv_heads, W), np.int8)
    cache[...] = NAN_VECTOR
    table = (1 + rng.permutation(num_blocks - 1)).reshape(T, per_seq).astype(np.int32)
    positions = np.array(contexts, np.int64) - 1
    for s, ctx in enumerate(contexts):
        lo = window_start(ctx - 1, window)
        table[s, :lo // BS] = 0
        pos = np.arange(lo, ctx - 1)  # the new token's K/V: written by the step
        stored = kv_quant.quantize(rng.standard_normal((pos.size, 2, num_kv_heads, HD)))
        cache[table[s, pos // BS], :, pos % BS] = stored
    slots = (table[np.arange(T), positions // BS] * BS + positions % BS).astype(np.int64)
    batch = BatchInputs(
        input_ids=np.zeros(T, np.int64), positions=positions, slot_mapping=slots,
        block_tables=table, seq_lens=np.array(contexts, np.int32),
        query_start_loc=np.arange(T + 1, dtype=np.int32),
        logits_indices=np.arange(T, dtype=np.int64), sample_ids=tuple(map(str, range(T))))
    qkv = rng.standard_normal((T, (num_heads + 2 * num_kv_heads) * HD)).astype(np.float32)
    return qkv, batch, cache, build_rope_cache(HD, 64, 1000.0), \
        StepGeometry(16, 64, num_blocks, BS)


FUSED_CASES = {
    "one-partition": dict(heads=(4, 2), contexts=[3, 4, 1], window=0, launches=1),
    "split-k": dict(heads=(8, 1), contexts=[1, 6, 7, 14], window=0, launches=2),
    "window-split-k": dict(heads=(4, 2), contexts=[2, 9, 14], window=6, launches=2),
}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "three-ops"])
@pytest.mark.parametrize("case", FUSED_CASES)
def test_int8_rope_kv_attention_writes_quantized_and_attends_to_the_dequantized_cache(case,
                                                                                     fused):
    """The new V stored byte for byte as ``kv_quant.quantize``; the new K as
    the quantization of the float64-rotated key (codes within 1, scale
    within float32 rounding); the output equal to float64 attention over
    ``kv_quant.dequantize`` of the cache as the step left it."""
    c = FUSED_CASES[case]
    (nh, nkv), contexts, window = c["heads"], c["contexts"], c["window"]
    qkv, batch, cache, rope, geometry = int8_decode_step(5, nh, nkv, contexts, window)
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
    written = ops.to_numpy(gpu_cache)
    T, x = len(contexts), qkv.astype(np.float64)
    pos = batch.positions
    q = ref_rope(x[:, :nh * HD].reshape(T, nh, HD), pos, rope)
    k_new = ref_rope(x[:, nh * HD:(nh + nkv) * HD].reshape(T, nkv, HD), pos, rope)
    v_new = qkv[:, (nh + nkv) * HD:].reshape(T, nkv, HD)
    b, o = batch.slot_mapping // BS, batch.slot_mapping % BS
    np.testing.assert_array_equal(written[b, 1, o], kv_quant.quantize(v_new))
    k_ref = kv_quant.quantize(k_new)
    assert np.abs(written[b, 0, o, :, :HD].astype(int) - k_ref[..., :HD]).max() <= 1
    np.testing.assert_allclose(kv_quant.scales(written[b, 0, o]), kv_quant.scales(k_ref),
                               rtol=1e-6)
    dense = kv_quant.dequantize(written).astype(np.float64)
    ks, vs = [], []
    for s, ctx in enumerate(contexts):
        lo = window_start(ctx - 1, window)
        keys = np.full((ctx, nkv, HD), np.nan)
        vals = np.full((ctx, nkv, HD), np.nan)
        j = np.arange(lo, ctx)
        blocks = batch.block_tables[s, j // BS]
        keys[lo:], vals[lo:] = dense[blocks, 0, j % BS], dense[blocks, 1, j % BS]
        ks.append(keys)
        vs.append(vals)
    ref = ref_attention(q, [(ctx - 1, 1) for ctx in contexts], np.arange(T + 1), ks, vs,
                        HD ** -0.5, window)
    assert not np.isnan(got).any(), "a key before the window was read"
    assert rel_err(got, ref) <= F32_REL


# --------------------------------------------------------------------------- #
# the model: CUDA-graph buckets over int8 caches, and the CPU backend
# --------------------------------------------------------------------------- #


def test_graph_buckets_replay_the_eager_steps_over_int8_caches(tmp_path):
    """The CUDA-graph path (``EagerReplay`` standing in for the capture the
    simulator cannot do) over int8 caches: the same tokens as eager steps,
    and the same cache bytes."""
    from test_forward_reference import make_runner
    from tiny_llama import SPECS, load_tiny

    from kvserve.core.request import Request
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.cuda.graphs import DecodeGraphs, EagerReplay, decode_run

    spec = dataclasses.replace(SPECS[0], name="int8-kv", num_hidden_layers=1, hidden_size=32,
                               num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=48)
    config, weights = load_tiny(tmp_path, spec)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (4, 7)]
    outputs, caches = {}, {}
    for mode in ("eager", "graphs"):
        ops = CudaOps(partition_size=4)
        runner, scheduler = make_runner(config, weights, ops, num_blocks=8, block_size=BS,
                                        budget=64, kv_cache_dtype="int8")
        assert runner.kv_caches[0].dtype == np.int8
        if mode == "graphs":
            cache = runner.kv_caches[0]
            geometry = StepGeometry(config.vocab_size, int(runner.model.rope_cache.shape[0]),
                                    int(cache.shape[0]), int(cache.shape[2]))
            runner.graphs = DecodeGraphs(ops, decode_run(runner.model, runner.kv_caches),
                                         geometry, max_num_seqs=2, max_model_len=16,
                                         capture=EagerReplay())
        requests = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=3))
                    for i, p in enumerate(prompts)]
        for request in requests:
            scheduler.add_request(request)
        while scheduler.has_unfinished_requests():
            output = scheduler.schedule()
            scheduler.update_from_output(output, runner.execute(output).sampled)
        outputs[mode] = [r.output_token_ids for r in requests]
        caches[mode] = ops.to_numpy(runner.kv_caches[0])
    assert outputs["graphs"] == outputs["eager"]
    assert all(len(tokens) == 3 for tokens in outputs["eager"])
    np.testing.assert_array_equal(caches["graphs"], caches["eager"])


def _cpu_int8_ops():
    from kvserve.cpu.ops import CpuOps

    ops = CpuOps()
    if "kv_cache_dtype" not in inspect.signature(ops.allocate_kv_cache).parameters:
        pytest.skip("the CPU backend has no int8 KV cache yet (issue 31, part A)")
    return ops


def test_cpu_and_cuda_int8_caches_agree():
    """The same K/V written and attended (decodes and a chunk, a window) on
    both backends: the same stored vectors (dequantized, float32
    tolerance) and the same attention outputs."""
    cpu = _cpu_int8_ops()
    rng = np.random.default_rng(4)
    nkv, nh, window = 2, 4, 5
    seqs = [(6, 1), (2, 5), (11, 1)]
    blocks = [-(-(c + n) // BS) for c, n in seqs]
    bt = np.zeros((len(seqs), max(blocks)), np.int32)
    used = 0
    for s, nb in enumerate(blocks):
        bt[s, :nb] = 1 + np.arange(used, used + nb)
        used += nb
    slots = np.concatenate([bt[s, np.arange(c + n) // BS] * BS + np.arange(c + n) % BS
                            for s, (c, n) in enumerate(seqs)]).astype(np.int64)
    L = slots.size
    k = rng.standard_normal((L, nkv, HD)).astype(np.float32)
    v = rng.standard_normal((L, nkv, HD)).astype(np.float32)
    ends = np.cumsum([c + n for c, n in seqs])
    new = np.concatenate([np.arange(e - n, e) for e, (_, n) in zip(ends, seqs, strict=True)])
    q = rng.standard_normal((new.size, nh, HD)).astype(np.float32)
    sl = np.array([c + n for c, n in seqs], np.int32)
    qsl = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    results = {}
    for name, ops in (("cpu", cpu), ("cuda", make_ops())):
        to = ops.to_device
        cache = ops.allocate_kv_cache(used + 1, BS, nkv, HD, kv_cache_dtype="int8")
        ops.write_kv(to(k), to(v), cache, to(slots))
        out = ops.paged_attention(to(q), cache, to(bt), to(sl), to(qsl), HD ** -0.5,
                                  window=window)
        results[name] = (np.asarray(ops.to_numpy(cache)), np.asarray(ops.to_numpy(out)))
    (cpu_cache, cpu_out), (cuda_cache, cuda_out) = results["cpu"], results["cuda"]
    assert cpu_cache.dtype == cuda_cache.dtype == np.int8
    np.testing.assert_allclose(kv_quant.dequantize(cuda_cache), kv_quant.dequantize(cpu_cache),
                               rtol=1e-6, atol=1e-6)
    assert rel_err(cuda_out, cpu_out) <= F32_REL


# --------------------------------------------------------------------------- #
# the int8 kernels compile for a GPU (PTX, no device needed)
# --------------------------------------------------------------------------- #

_PTX_SCRIPT = textwrap.dedent("""
    import types
    from numba import cuda, float32, int8, int32, int64
    from numba.core.types import float16
    from numba.cuda import dispatcher
    # device functions ask the current device for its compute capability: there is none
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
    from kvserve.cuda import kernels as k
    f2, f3 = float32[:, ::1], float32[:, :, ::1]
    f4, f5, c5 = float32[:, :, :, ::1], float32[:, :, :, :, ::1], int8[:, :, :, :, ::1]
    h2, h3 = float16[:, ::1], float16[:, :, ::1]
    i1, i2, l1 = int32[::1], int32[:, ::1], int64[::1]
    sigs = [
        ("write_kv_int8_kernel", (f3, float32[:, :, :], c5, f5, l1)),
        ("write_kv_int8_kernel", (h3, float16[:, :, :], c5, f5, l1)),
        ("decode_partition_int8_kernel", (h3, c5, f5, i2, i1, i1, i1, float32, int32, int64,
                                          f4, f3, f3)),
        ("prefill_attention_int8_kernel", (f3, c5, f5, i2, i1, i1, i1, i1, float32, int32,
                                           f3)),
        ("decode_fused_int8_kernel", (h2, l1, h2, float16[::1], float16[::1], float32, c5, f5,
                                      i2, l1, i1, i1, i1, int32, float32,
                                      int32, int32, h3, f4, f3, f3)),
    ]
    for name, sig in sigs:
        ptx, _ = cuda.compile_ptx(getattr(k, name).py_func, sig, cc=(9, 0))
        print("compiled", name, "cvt.rni" in ptx)
""")


@pytest.mark.slow
def test_the_int8_kernels_compile_to_ptx():
    """The simulator types nothing: Numba's CUDA target (NVVM, no GPU) must
    accept the int8 kernels with the argument types ``CudaOps`` passes, and
    the codes round to nearest even (``cvt.rni``)."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    probe = "from numba.cuda.cudadrv import nvvm; nvvm.NVVM()"
    if subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                      timeout=120).returncode:
        pytest.skip("NVVM (libnvvm) not found: cannot compile PTX here")
    done = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split("\n")
    assert sum(line.startswith("compiled") for line in lines) == 5
    assert "compiled write_kv_int8_kernel True" in lines
    assert "compiled decode_fused_int8_kernel True" in lines
