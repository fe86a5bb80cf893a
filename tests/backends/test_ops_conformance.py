"""One conformance suite for every backend: each ``Ops`` method
(``kvserve.model.ops``) against a float64 NumPy reference (here and in
``ops_references.py``), run over every registered backend and dtype (the
``backend_ops`` fixture, ``conftest.py``).

The shapes are tiny: under Numba's CUDA simulator each CUDA thread is a
Python thread. What only one backend does (the CPU's attention routes and
thread policy, CUDA's split-K partitions, launch shapes, refusals of
non-contiguous operands) is tested in ``tests/cpu`` and ``tests/cuda``.

Tolerances (``backend_ops.rel``, relative error max |out - ref| / max |ref|):
``F32_REL`` = 1e-5 in float32; in float16 half an ulp more, the references
being computed from the float16-rounded inputs. Products of integer-valued
operands are exact in any summation order and are compared as such.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from ops_references import (BS, HD, paged_batch, ref_gelu_tanh_and_mul, ref_rms_norm, ref_rope,
                            reference_attention, rel_err)

from kvserve.model import kv_quant
from kvserve.model.ggml_blocks import dequantize, from_gguf_bytes
from kvserve.model.input_batch import BatchInputs
from kvserve.model.llama import AttentionMetadata
from kvserve.model.ops import Ops, StepGeometry, build_rope_cache
from kvserve.model.quantization import quantize_weight

U = 2.0**-24  # float32 unit roundoff


def test_every_ops_method_has_a_conformance_test():
    """A method added to ``Ops`` fails here until a ``test_<method>...`` exists."""
    methods = {name for name, member in vars(Ops).items()
               if callable(member) and not name.startswith("_")}
    assert {"embedding", "linear", "paged_attention", "prepare_step", "to_numpy"} <= methods
    tests = [name for name in globals() if name.startswith("test_")]
    missing = sorted(m for m in methods
                     if not any(re.match(rf"test_(.*_and_)?{m}(_|$)", t) for t in tests))
    assert not missing, f"Ops methods without a conformance test: {missing}"


def test_to_device_and_to_numpy_round_trip(backend_ops):
    be = backend_ops
    assert isinstance(be.ops, Ops)
    a = np.random.default_rng(0).standard_normal((4, 6))
    d = be.to(a)
    assert d.dtype == be.dtype and d.shape == (4, 6)
    back = be.back(d)
    assert isinstance(back, np.ndarray) and back.dtype == be.dtype
    np.testing.assert_array_equal(back, a.astype(be.dtype))
    np.testing.assert_array_equal(be.back(be.to(a.T)), a.T.astype(be.dtype))  # not contiguous
    ids = np.array([5, 0, 2**40], np.int64)
    assert be.back(be.to(ids)).dtype == np.int64  # integers keep their dtype
    np.testing.assert_array_equal(be.back(be.to(ids)), ids)
    read_only = a.astype(be.dtype)
    read_only.flags.writeable = False
    d = be.to(read_only)
    d[0, 0] = 123.0  # a device array the caller may write
    assert be.back(d)[0, 0] == 123.0 and read_only[0, 0] != 123.0


def test_allocate_kv_cache_is_zeroed_with_the_paged_layout(backend_ops):
    be = backend_ops
    cache = be.ops.allocate_kv_cache(3, BS, 2, HD)
    assert cache.shape == (3, 2, BS, 2, HD) and cache.dtype == be.dtype
    host = be.back(cache)
    assert not host.any()
    cache[...] = 1.0
    assert not be.back(be.ops.allocate_kv_cache(3, BS, 2, HD)).any()  # a fresh buffer each call
    with pytest.raises(ValueError):
        be.ops.allocate_kv_cache(0, BS, 2, HD)


# --------------------------------------------------------------------------- #
# dense ops
# --------------------------------------------------------------------------- #


def test_embedding_gathers_rows(backend_ops):
    be = backend_ops
    table = np.random.default_rng(2).standard_normal((11, 6))
    ids = np.array([3, 0, 10, 3], np.int64)
    out = be.back(be.ops.embedding(be.to(ids), be.to(table)))
    np.testing.assert_array_equal(out, table.astype(be.dtype)[ids])
    with pytest.raises(ValueError):
        be.ops.embedding(be.to(np.array([0, 11])), be.to(table))


def test_rms_norm(backend_ops):
    be = backend_ops
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 20)) * 3
    w = rng.standard_normal(20)
    out = be.back(be.ops.rms_norm(be.to(x), be.to(w), 1e-3))
    assert out.dtype == be.dtype and out.shape == (3, 20)
    assert rel_err(out, ref_rms_norm(be.rounded(x), be.rounded(w), 1e-3)) < be.rel


def test_fused_add_rms_norm_in_place(backend_ops):
    """vLLM's convention: residual += x (one rounding to the dtype), then
    x = rms_norm(residual); x and residual must not overlap."""
    be = backend_ops
    rng = np.random.default_rng(4)
    x, r, w = rng.standard_normal((3, 20)), rng.standard_normal((3, 20)), rng.standard_normal(20)
    dx, dr = be.to(x), be.to(r)
    assert be.ops.fused_add_rms_norm(dx, dr, be.to(w), 1e-3) is None
    total = be.rounded(x) + be.rounded(r)
    stored = be.rounded(total)
    np.testing.assert_array_equal(be.back(dr), stored.astype(be.dtype))
    ref_x = stored / np.sqrt((total**2).mean(-1, keepdims=True) + 1e-3) * be.rounded(w)
    assert rel_err(be.back(dx), ref_x) < be.rel
    with pytest.raises(ValueError):
        be.ops.fused_add_rms_norm(dx, dx, be.to(w), 1e-3)


def test_rotary_embedding_in_place(backend_ops):
    """q flat [T, nh*hd], k [T, nkv, hd]; positions up to 2047 at theta 1e5
    (the default model's), where the angles are large."""
    be = backend_ops
    rng = np.random.default_rng(5)
    positions = np.array([0, 7, 2047, 1000], np.int64)
    table = build_rope_cache(HD, 2048, 100000.0)
    q = rng.standard_normal((4, 3 * HD))
    k = rng.standard_normal((4, 1, HD))
    dq, dk = be.to(q), be.to(k)
    assert be.ops.rotary_embedding(be.to(positions), dq, dk, be.to(table), HD) is None
    table64 = be.rounded(table)
    ref_q = ref_rope(be.rounded(q).reshape(4, 3, HD), positions, table64)
    assert rel_err(be.back(dq).reshape(4, 3, HD), ref_q) < be.rel
    assert rel_err(be.back(dk), ref_rope(be.rounded(k), positions, table64)) < be.rel
    with pytest.raises(ValueError):
        be.ops.rotary_embedding(be.to(np.array([0, 1, 2, 2048])), dq, dk, be.to(table), HD)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # simulator
def test_silu_and_mul(backend_ops):
    be = backend_ops
    x = np.random.default_rng(6).standard_normal((3, 2 * 9)) * 3
    x[0, 0], x[1, 0] = -200.0, 200.0  # exp overflows in float32 (and float16)
    a, b = be.rounded(x)[:, :9], be.rounded(x)[:, 9:]
    out = be.back(be.ops.silu_and_mul(be.to(x)))
    assert out.shape == (3, 9) and out.dtype == be.dtype and np.isfinite(out).all()
    assert rel_err(out, a / (1 + np.exp(-a)) * b) < be.rel
    with pytest.raises(ValueError):
        be.ops.silu_and_mul(be.to(np.ones((2, 5))))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # a**3, simulator
def test_gelu_tanh_and_mul(backend_ops):
    """GeGLU with PyTorch's tanh GELU; the rows of moderate values and the
    row of large ones (a**3 overflows float16 from |a| = 41 and float32 at
    1e13: tanh is then +-1 and the result a * b or 0) each against their
    own scale."""
    be = backend_ops
    x = np.random.default_rng(16).standard_normal((4, 2 * 9)) * 3
    x[3, :5] = [-200.0, 200.0, -30.0, 30.0, -7.0]
    if be.dtype == np.float32:
        x[3, 2:4] = [-1e13, 1e13]
    ref = ref_gelu_tanh_and_mul(be.rounded(x))
    out = be.back(be.ops.gelu_tanh_and_mul(be.to(x)))
    assert out.shape == (4, 9) and out.dtype == be.dtype and np.isfinite(out).all()
    assert rel_err(out[:3], ref[:3]) < be.rel
    assert rel_err(out[3], ref[3]) < be.rel
    with pytest.raises(ValueError):
        be.ops.gelu_tanh_and_mul(be.to(np.ones((2, 5))))


# --------------------------------------------------------------------------- #
# linear: float, and every quantized weight of kvserve.model.quantization
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("rows", [1, 5])
def test_linear_dense(backend_ops, rows):
    be = backend_ops
    rng = np.random.default_rng(7 + rows)
    x, w, b = (rng.standard_normal(s) for s in ((rows, 12), (7, 12), (7,)))
    dx, dw = be.to(x), be.to(w)
    out = be.back(be.ops.linear(dx, dw, be.to(b)))
    assert out.dtype == be.dtype and out.shape == (rows, 7)
    assert rel_err(out, be.rounded(x) @ be.rounded(w).T + be.rounded(b)) < be.rel
    no_bias = be.ops.linear(dx, dw)
    assert rel_err(be.back(no_bias), be.rounded(x) @ be.rounded(w).T) < be.rel
    no_bias[...] = 0  # a new array: neither input is aliased
    assert be.back(dx).any() and be.back(dw).any()
    assert be.back(be.ops.linear(be.to(x[:0]), dw)).shape == (0, 7)
    with pytest.raises(ValueError):
        be.ops.linear(dx, be.to(w[:, :11]))


def exact_activations(rows: int, k: int, seed: int) -> np.ndarray:
    """float [rows, k]: integers in [-127, 127] (halves of them in the
    second group of 64 channels), +-127 (+-63.5) at every 4th channel. The
    w8a8 scheme's groups of 64 channels (``kvserve.model.quantization``)
    then have the scales 1 and 1/2 exactly, and quantize without error."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-127, 128, (rows, k)).astype(np.float64)
    x[:, ::4] = rng.choice([-127.0, 127.0], (rows, -(-k // 4)))
    x[:, 64:128] /= 2
    return x


@pytest.mark.parametrize("scheme", ["int8", "w8a8"])
@pytest.mark.parametrize("rows", [1, 5])
def test_linear_int8_weights_exact_on_exact_activations(backend_ops, scheme, rows):
    """``quantize_weight(w, scheme)``'s int8 codes and float32 scales: with
    activations that w8a8 quantizes exactly, every product and sum is a
    multiple of 1/2 below 2**22, exact in float32 in any order; the output
    is the exact sum times the scale (+ bias), rounded once or twice."""
    be = backend_ops
    k, n = 128, 7
    rng = np.random.default_rng(8 + rows)
    weight = quantize_weight(rng.standard_normal((n, k)).astype(np.float32), scheme, be.to)
    codes = be.back(weight.qweight).astype(np.float64)
    scales = be.back(weight.scales).astype(np.float64)
    x = exact_activations(rows, k, seed=rows)
    bias = np.linspace(-1, 1, n)
    out = be.back(be.ops.linear(be.to(x), weight, be.to(bias)))
    assert out.dtype == be.dtype and out.shape == (rows, n)
    ref = (x @ codes.T) * scales + be.rounded(bias)
    assert rel_err(out, ref) < max(be.rel, 4 * U)


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 5])
def test_linear_gguf_blocks(backend_ops, ggml_type, rows):
    """A GGUF block weight (``--quantization q4``) against x @ W.T in float64
    on its dequantized values: within (K + 2) u (|x| @ |W|.T) in float32,
    plus 2**-10 of it in float16 (weights and output rounded once each)."""
    be = backend_ops
    n, k = 7, 64
    rng = np.random.default_rng(9 + rows)
    raw = gguf_quantize(rng.standard_normal((n, k)).astype(np.float32),
                        GGMLQuantizationType[ggml_type])
    host = from_gguf_bytes(raw, ggml_type, (n, k))
    dense = dequantize(host).astype(np.float64)
    x = be.rounded(rng.standard_normal((rows, k)))
    out = be.back(be.ops.linear(be.to(x), quantize_weight(host, "q4", be.to)))
    assert out.dtype == be.dtype and out.shape == (rows, n)
    gamma = (k + 2) * U + (2.0**-10 if be.dtype == np.float16 else 0.0)
    assert (np.abs(out - x @ dense.T) <= gamma * (np.abs(x) @ np.abs(dense).T)).all()


def test_embedding_of_a_gguf_block_table(backend_ops):
    """The rows of a block table, dequantized (rounded once to the dtype)."""
    be = backend_ops
    raw = gguf_quantize(np.random.default_rng(10).standard_normal((9, 32)).astype(np.float32),
                        GGMLQuantizationType.Q8_0)
    host = from_gguf_bytes(raw, "Q8_0", (9, 32))
    ids = np.array([4, 0, 8, 4], np.int64)
    out = be.back(be.ops.embedding(be.to(ids), quantize_weight(host, "q4", be.to)))
    np.testing.assert_array_equal(out, dequantize(host)[ids].astype(be.dtype))


# --------------------------------------------------------------------------- #
# the paged KV cache
# --------------------------------------------------------------------------- #


def test_write_kv_scatters_by_slot_and_skips_negative(backend_ops):
    """K/V rows that are views of a fused qkv output (token stride 3 nkv hd)."""
    be = backend_ops
    nkv, T = 2, 5
    qkv = np.random.default_rng(11).standard_normal((T, 3 * nkv * HD))
    slots = np.array([5, -1, 0, 11, -7], np.int64)
    cache = be.ops.allocate_kv_cache(3, BS, nkv, HD)
    d_qkv = be.to(qkv)
    assert be.ops.write_kv(d_qkv[:, :nkv * HD].reshape(T, nkv, HD),
                           d_qkv[:, 2 * nkv * HD:].reshape(T, nkv, HD), cache,
                           be.to(slots)) is None
    stored = qkv.astype(be.dtype)
    expected = np.zeros((3, 2, BS, nkv, HD), be.dtype)
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected[slot // BS, 0, slot % BS] = stored[t, :nkv * HD].reshape(nkv, HD)
            expected[slot // BS, 1, slot % BS] = stored[t, 2 * nkv * HD:].reshape(nkv, HD)
    np.testing.assert_array_equal(be.back(cache), expected)
    k = be.to(stored[:1, :nkv * HD].reshape(1, nkv, HD))
    with pytest.raises(ValueError):
        be.ops.write_kv(k, k, cache, be.to(np.array([3 * BS], np.int64)))


ATTENTION_CASES = {
    # contexts of block_size - 1, block_size, block_size + 1 tokens, and 1
    "decode-block-boundaries": {"seqs": [(BS - 2, 1), (BS - 1, 1), (BS, 1), (0, 1)]},
    # chunks over a cached prefix and within a block; one spans 3 blocks
    "prefill-over-cached-prefix": {"seqs": [(5, 6), (1, 2), (0, 3)]},
    "mixed-decode-prefill-padding": {"seqs": [(7, 1), (5, 4), (0, 3), (9, 1)], "pad_tokens": 2},
    "gqa-3": {"seqs": [(6, 1), (3, 3)], "group": 3},
    "gqa-8": {"seqs": [(5, 1), (2, 2)], "group": 8},
}


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_paged_attention(backend_ops, case):
    be = backend_ops
    kw = {"group": 1, "pad_tokens": 0, **ATTENTION_CASES[case]}
    rng = np.random.default_rng(12)
    q, cache, bt, sl, qsl, dense = paged_batch(rng, kw["seqs"], 2, kw["group"], kw["pad_tokens"])
    out = be.back(be.ops.paged_attention(be.to(q), be.to(cache), be.to(bt), be.to(sl),
                                         be.to(qsl), HD ** -0.5))
    assert out.dtype == be.dtype and out.shape == q.shape
    assert not np.isnan(out).any()
    assert not out[int(qsl[-1]):].any()  # padding rows
    dense = [be.rounded(kv) for kv in dense]
    ref = reference_attention(be.rounded(q), kw["seqs"], qsl, dense, HD ** -0.5)
    assert rel_err(out, ref) < be.rel


#: Sliding-window cases (Gemma 3): the blocks wholly before a sequence's
#: first window are NaN (``ops_references.stale_blocks``).
WINDOW_CASES = {
    # one sequence within its window, the others beyond; window 5 is no
    # multiple of the block size
    "decode-beyond-window": {"seqs": [(9, 1), (3, 1), (3 * BS, 1), (0, 1)], "window": 5},
    # chunks whose queries' windows start in different blocks; a fresh
    # prompt longer than the window
    "prefill-across-window": {"seqs": [(6, 7), (0, 9), (2, 3)], "window": 4},
    "window-of-one": {"seqs": [(5, 2), (0, 3)], "window": 1},
    "window-of-a-block-gqa-3": {"seqs": [(10, 2), (1, 5)], "group": 3, "window": BS},
    # 17 new tokens: the CPU's BLAS prefill route
    "long-chunk-and-padding": {"seqs": [(20, 17), (11, 1)], "window": 6, "pad_tokens": 2},
}


@pytest.mark.parametrize("case", sorted(WINDOW_CASES))
def test_paged_attention_windowed(backend_ops, case):
    """The query at position p sees keys p - window < j <= p, and no NaN of
    the blocks before a sequence's window reaches the output."""
    be = backend_ops
    kw = {"group": 1, "pad_tokens": 0, **WINDOW_CASES[case]}
    rng = np.random.default_rng(15)
    q, cache, bt, sl, qsl, dense = paged_batch(rng, kw["seqs"], 2, kw["group"], kw["pad_tokens"],
                                               window=kw["window"])
    out = be.back(be.ops.paged_attention(be.to(q), be.to(cache), be.to(bt), be.to(sl),
                                         be.to(qsl), HD ** -0.5, window=kw["window"]))
    assert out.dtype == be.dtype and out.shape == q.shape
    assert not np.isnan(out).any()
    assert not out[int(qsl[-1]):].any()
    dense = [be.rounded(kv) for kv in dense]
    ref = reference_attention(be.rounded(q), kw["seqs"], qsl, dense, HD ** -0.5,
                              window=kw["window"])
    assert rel_err(out, ref) < be.rel
    full = reference_attention(be.rounded(q), kw["seqs"], qsl, dense, HD ** -0.5)
    assert rel_err(full, ref) > 100 * be.rel or kw["window"] > max(c + n for c, n in kw["seqs"])


def _int8_cache(cache: np.ndarray) -> np.ndarray:
    """``paged_batch``'s float64 cache stored as int8 (``kv_quant.quantize``);
    its NaN vectors (slots outside every context, stale blocks) keep zero
    codes and the scale NaN, so that reading one still shows."""
    x = cache.astype(np.float32)
    nan = np.isnan(x).any(axis=-1)
    stored = kv_quant.quantize(np.where(np.isnan(x), np.float32(0.0), x))
    stored[nan, HD:] = np.array([np.nan], "<f4").view(np.int8)
    return stored


#: int8 KV cache cases: decode and chunks, GQA, windows (the CPU's BLAS route too).
INT8_CASES = {
    "mixed-decode-prefill-padding": ATTENTION_CASES["mixed-decode-prefill-padding"],
    "gqa-3": ATTENTION_CASES["gqa-3"],
    "prefill-across-window": WINDOW_CASES["prefill-across-window"],
    "long-chunk-and-padding": WINDOW_CASES["long-chunk-and-padding"],
}


def test_allocate_kv_cache_int8_and_write_kv_quantizes(backend_ops):
    """``--kv-cache-dtype int8``: a zeroed int8 [..., HD + 4] cache; write_kv
    stores ``kv_quant.quantize`` of the (dtype-rounded) rows byte for byte."""
    be = backend_ops
    nkv, T = 2, 5
    cache = be.ops.allocate_kv_cache(3, BS, nkv, HD, kv_cache_dtype="int8")
    host = be.back(cache)
    assert host.dtype == np.int8 and host.shape == (3, 2, BS, nkv, HD + 4) and not host.any()
    rng = np.random.default_rng(21)
    k, v = (rng.standard_normal((T, nkv, HD)) * rng.uniform(0.01, 100, (T, nkv, 1))
            for _ in range(2))
    k[2, 1] = 0.0  # a zero vector: scale 0, codes 0
    slots = np.array([5, -1, 0, 11, -7], np.int64)
    assert be.ops.write_kv(be.to(k), be.to(v), cache, be.to(slots)) is None
    expected = np.zeros((3, 2, BS, nkv, HD + 4), np.int8)
    for t, slot in enumerate(slots):
        if slot >= 0:
            for i, x in enumerate((k, v)):
                expected[slot // BS, i, slot % BS] = kv_quant.quantize(
                    be.rounded(x[t]).astype(np.float32))
    np.testing.assert_array_equal(be.back(cache), expected)
    with pytest.raises(ValueError):
        be.ops.allocate_kv_cache(3, BS, nkv, HD, kv_cache_dtype="bf16")


@pytest.mark.parametrize("case", sorted(INT8_CASES))
def test_paged_attention_int8(backend_ops, case):
    """Attention over an int8 cache is attention over its dequantized K/V;
    the NaN scales of slots outside the contexts and of the blocks before
    a window never reach the output."""
    be = backend_ops
    kw = {"group": 1, "pad_tokens": 0, "window": 0, **INT8_CASES[case]}
    rng = np.random.default_rng(16)
    q, cache, bt, sl, qsl, _ = paged_batch(rng, kw["seqs"], 2, kw["group"], kw["pad_tokens"],
                                           window=kw["window"])
    stored = _int8_cache(cache)
    windowed = {"window": kw["window"]} if kw["window"] else {}
    out = be.back(be.ops.paged_attention(be.to(q), be.to(stored), be.to(bt), be.to(sl),
                                         be.to(qsl), HD ** -0.5, **windowed))
    assert out.dtype == be.dtype and not np.isnan(out).any()
    assert not out[int(qsl[-1]):].any()
    deq = kv_quant.dequantize(stored).astype(np.float64)  # NaN where never to be read
    dense = []
    for s, (c, n) in enumerate(kw["seqs"]):
        pos = np.arange(c + n)
        dense.append(deq[bt[s, pos // BS], :, pos % BS].transpose(1, 0, 2, 3))
    ref = reference_attention(be.rounded(q), kw["seqs"], qsl, dense, HD ** -0.5,
                              window=kw["window"])
    assert rel_err(out, ref) < be.rel


def test_paged_attention_no_sequences_and_bad_metadata(backend_ops):
    be = backend_ops
    q = be.to(np.ones((3, 2, HD)))
    cache = be.ops.allocate_kv_cache(2, BS, 1, HD)
    empty = be.ops.paged_attention(q, cache, be.to(np.zeros((0, 1), np.int32)),
                                   be.to(np.zeros(0, np.int32)), be.to(np.zeros(1, np.int32)), 1.0)
    assert not be.back(empty).any()
    meta = [np.array([[0, 1]], np.int32), np.array([5], np.int32), np.array([0, 2], np.int32)]
    for spoiled in ({0: np.array([[0, 2]], np.int32)},  # a block id beyond the cache
                    {1: np.array([1], np.int32)},  # fewer context tokens than new ones
                    {2: np.array([0, 4], np.int32)}):  # beyond the tokens
        bt, sl, qsl = (be.to(spoiled.get(i, a)) for i, a in enumerate(meta))
        with pytest.raises(ValueError):
            be.ops.paged_attention(q, cache, bt, sl, qsl, 1.0)


# --------------------------------------------------------------------------- #
# a step: prepare_step, then the fused attention block
# --------------------------------------------------------------------------- #


def step_case(rng, seqs, nkv, block_size=BS):
    """A step of ``seqs`` = [(cached, n_new), ...] over a random cache (the
    cached tokens' K/V already in it): (batch, cache, geometry)."""
    blocks = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(blocks) + 1
    tables = np.full((len(seqs), max(blocks)), -1, np.int32)
    perm, used = rng.permutation(num_blocks), 0
    positions, slots = [], []
    for s, ((c, n), nb) in enumerate(zip(seqs, blocks, strict=True)):
        tables[s, :nb] = perm[used:used + nb]
        used += nb
        pos = np.arange(c, c + n)
        positions.append(pos)
        slots.append(tables[s, pos // block_size] * block_size + pos % block_size)
    qsl = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    T = int(qsl[-1])
    batch = BatchInputs(
        input_ids=rng.integers(0, 16, T).astype(np.int64),
        positions=np.concatenate(positions).astype(np.int64),
        slot_mapping=np.concatenate(slots).astype(np.int64), block_tables=tables,
        seq_lens=np.array([c + n for c, n in seqs], np.int32), query_start_loc=qsl,
        logits_indices=(qsl[1:] - 1).astype(np.int64), sample_ids=tuple(map(str, range(len(seqs)))))
    cache = rng.standard_normal((num_blocks, 2, block_size, nkv, HD))
    return batch, cache, StepGeometry(16, 64, num_blocks, block_size)


STEP_FIELDS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens",
               "query_start_loc", "logits_indices")


def test_prepare_step_puts_the_batch_on_the_backend(backend_ops):
    be = backend_ops
    batch, _, geometry = step_case(np.random.default_rng(13), [(3, 1), (0, 4)], 1)
    plan = be.ops.prepare_step(batch, geometry)
    for name in STEP_FIELDS:
        np.testing.assert_array_equal(be.back(getattr(plan, name)), getattr(batch, name),
                                      err_msg=name)


@pytest.mark.parametrize("seqs, heads, window", [
    ([(3, 1), (8, 1), (0, 1)], (6, 2), 0),   # a decode step (CUDA: the fused kernel)
    ([(5, 1), (2, 3)], (4, 4), 0),           # decode and prefill mixed: the three ops
    ([(9, 1), (12, 1), (2, 1)], (6, 2), 5),  # a sliding layer's decode step
    ([(9, 1), (7, 4)], (4, 2), 3),           # ... and a mixed one
], ids=["decode", "mixed", "windowed-decode", "windowed-mixed"])
def test_rope_kv_attention_equals_rope_write_and_attention(backend_ops, seqs, heads, window):
    """On a step planned by ``prepare_step``: RoPE of q and k, k and v
    written at their slots, paged attention over the whole context (over
    the last ``window`` positions when ``window`` > 0)."""
    be = backend_ops
    nh, nkv = heads
    windowed = {"window": window} if window else {}
    rng = np.random.default_rng(14)
    batch, cache, geometry = step_case(rng, seqs, nkv)
    T = batch.input_ids.shape[0]
    qkv = rng.standard_normal((T, (nh + 2 * nkv) * HD))
    table = build_rope_cache(HD, 64, 1000.0)
    plan = be.ops.prepare_step(batch, geometry)
    attn = AttentionMetadata(plan.slot_mapping, plan.block_tables, plan.seq_lens,
                             plan.query_start_loc, plan=plan)
    d_cache = be.to(cache)
    out = be.back(be.ops.rope_kv_attention(be.to(qkv), plan.positions, be.to(table), d_cache,
                                           attn, HD ** -0.5, nh, nkv, HD, **windowed))
    assert out.dtype == be.dtype and out.shape == (T, nh, HD)

    pos, table64, qkv64 = batch.positions, be.rounded(table), be.rounded(qkv)
    q = ref_rope(qkv64[:, :nh * HD].reshape(T, nh, HD), pos, table64)
    k = ref_rope(qkv64[:, nh * HD:(nh + nkv) * HD].reshape(T, nkv, HD), pos, table64)
    v = qkv64[:, (nh + nkv) * HD:].reshape(T, nkv, HD)
    expected = be.rounded(cache)
    slots = batch.slot_mapping
    expected[slots // BS, 0, slots % BS] = k
    expected[slots // BS, 1, slots % BS] = v
    assert rel_err(be.back(d_cache), expected) < be.rel
    dense = []
    for s, (c, n) in enumerate(seqs):
        ctx = np.arange(c + n)
        rows = expected[batch.block_tables[s, ctx // BS], :, ctx % BS]  # [L, 2, nkv, hd]
        dense.append(be.rounded(rows.transpose(1, 0, 2, 3)))
    ref = reference_attention(q, seqs, batch.query_start_loc, dense, HD ** -0.5, window=window)
    assert rel_err(out, ref) < 2 * be.rel



def test_decode_path_and_decode_layers(backend_ops, tmp_path):
    """``decode_path`` names a path and a reason; where it says ``fused``,
    ``decode_layers`` on a decode step of two sequences leaves the op path's
    ``(x, residual)`` (the op path is the float64-checked one of
    ``tests/model/test_forward_reference.py``); where it says ``ops``,
    ``decode_layers`` takes no step (None)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from tiny_llama import SPECS, load_tiny

    from kvserve.model.llama import LlamaModel

    be = backend_ops
    config, weights = load_tiny(tmp_path, SPECS[0])
    model = LlamaModel(config, {k: v.astype(be.dtype) if v.dtype.kind == "f" else v
                                for k, v in weights.items()}, be.ops)
    path = be.ops.decode_path(model)
    assert path.path in ("fused", "ops") and path.reason and path == model.decode_path
    rng = np.random.default_rng(4)
    def caches():  # a fresh cache each path (its earlier keys zero)
        return [be.ops.allocate_kv_cache(4, BS, config.num_key_value_heads, config.head_dim)
                for _ in range(config.num_hidden_layers)]

    attn = AttentionMetadata(slot_mapping=be.to(np.array([5, 2 * BS + 1], np.int64)),
                             block_tables=be.to(np.array([[0, 1], [2, 3]], np.int32)),
                             seq_lens=be.to(np.array([6, BS + 2], np.int32)),
                             query_start_loc=be.to(np.array([0, 1, 2], np.int32)))
    positions = be.to(np.array([5, BS + 1], np.int64))
    hidden = rng.standard_normal((2, config.hidden_size)).astype(be.dtype)
    fused = be.ops.decode_layers(be.to(hidden.copy()), model, positions, attn, caches())
    if not path.fused:
        assert fused is None
        return
    x, residual = model._layers(be.to(hidden.copy()), positions, attn, caches())
    for got, want in zip(fused, (x, residual)):
        assert rel_err(be.back(got), be.back(want)) < 1e-5
