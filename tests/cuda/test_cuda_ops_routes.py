"""What only the CUDA backend's ops (kvserve.cuda.ops.CudaOps) do, against
float64 NumPy references (``tests/backends/ops_references.py``): the routes of
paged attention (split-K decode partitions, the prefill kernel and its
tiles), the int8 GEMV and tiled kernels called directly, the refusal of
operands the kernels cannot take (ValueError naming them), the
constructor's limits and the warm-up. What every backend must do is the
conformance suite's, ``tests/backends/test_ops_conformance.py``.

Runs under Numba's CUDA simulator on a machine without a GPU (see conftest.py),
where each CUDA thread is a Python thread: the shapes are tiny and the
split-K partition is 4 keys, so that a 17-token context already spans five
partitions.  The same file runs unchanged on a GPU.

Tolerances (relative error: max |out - ref| / max |ref|):

* float32: F32_REL = 1e-5 (float32 accumulation over at most a few dozen terms).
* float16: F16_REL = 2**-11 + F32_REL.  The references are computed from the
  float16-rounded inputs, so input rounding is not counted; what remains is
  the float32 computation (bounded by F32_REL, as the float32 cases assert)
  plus one rounding of each output to float16, at most half an ulp, 2**-11
  of the element itself and so of max |ref|.
* int8 matmul: exact where exactness is defined (see the int8 section).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))  # the references

from ops_references import BS, HD, paged_batch, reference_attention, rel_err  # noqa: E402

from kvserve.cuda import kernels  # noqa: E402
from kvserve.cuda.ops import CudaOps  # noqa: E402
from kvserve.model.ops import build_rope_cache  # noqa: E402

F32_REL = 1e-5
F16_REL = 2.0**-11 + F32_REL
DTYPES = [np.float32, np.float16]
PARTITION = 4  # split-K partition size (keys)


def make_ops(dtype=np.float32, **kw) -> CudaOps:
    return CudaOps(dtype=dtype, partition_size=kw.pop("partition_size", PARTITION), **kw)


# --------------------------------------------------------------------------- #
# paged attention
# --------------------------------------------------------------------------- #


def run_attention(seqs, nkv=2, group=1, dtype=np.float32, pad_tokens=0, seed=0, **ops_kw):
    """Relative error of CudaOps.paged_attention against the dense reference."""
    ops = make_ops(dtype, **ops_kw)
    rng = np.random.default_rng(seed)
    q, cache, bt, sl, qsl, dense = paged_batch(rng, seqs, nkv, group, pad_tokens)
    to = ops.to_device
    out = ops.to_numpy(ops.paged_attention(to(q), to(cache), to(bt), to(sl), to(qsl), HD ** -0.5))
    assert out.dtype == dtype and out.shape == q.shape
    assert not np.isnan(out).any()
    assert not out[int(qsl[-1]):].any()  # padding rows
    stored = [np.asarray(kv, dtype).astype(np.float64) for kv in dense]
    ref = reference_attention(np.asarray(q, dtype), seqs, qsl, stored, HD ** -0.5)
    return rel_err(out, ref)


#: Routes: "decode" = one new token per sequence goes to the split-K kernels,
#: longer chunks to the prefill kernel (the default split); "all-decode" /
#: "all-prefill" send every sequence to one kernel.
ROUTES = {"split": {}, "all-decode": {"prefill_min_queries": 10**6},
          "all-prefill": {"prefill_min_queries": 1}}

ATTENTION_CASES = {
    # context lengths block_size - 1, block_size, block_size + 1 (decodes)
    "block-boundaries": {"seqs": [(BS - 2, 1), (BS - 1, 1), (BS, 1)]},
    "context-1": {"seqs": [(0, 1), (0, 1)]},
    # 17 keys = 5 partitions of 4, plus a 2-partition and a 1-partition context
    "split-k": {"seqs": [(16, 1), (5, 1), (2, 1)]},
    # prefill tiles of 4 queries: 13 cached + 8 new (two full tiles, contexts
    # over two KV tiles of 16 keys) and 3 cached + 5 new (a ragged last tile)
    "prefill-over-cached-prefix": {"seqs": [(13, 8), (3, 5)], "prefill_tile_q": 4},
    "prefill-chunk-block-boundaries": {"seqs": [(1, 2), (2, 2), (3, 2)]},
    "mixed-decode-prefill": {"seqs": [(7, 1), (5, 6), (0, 3), (12, 1)], "pad_tokens": 2},
}


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_paged_attention_float32(case, route):
    kw = dict(ATTENTION_CASES[case], **ROUTES[route])
    assert run_attention(**kw) < F32_REL


@pytest.mark.parametrize("case", ["split-k", "prefill-over-cached-prefix", "mixed-decode-prefill"])
def test_paged_attention_float16(case):
    assert run_attention(dtype=np.float16, **ATTENTION_CASES[case]) < F16_REL


@pytest.mark.parametrize("route", ["split", "all-prefill"])
@pytest.mark.parametrize("nkv,group", [(2, 1), (2, 3), (2, 8)])
def test_paged_attention_gqa(nkv, group, route):
    """Query head h reads KV head h // group (two KV heads, so that h % nkv or
    a single shared head would show); a decode over 2 partitions and a chunk."""
    assert run_attention([(6, 1), (3, 3)], nkv=nkv, group=group, **ROUTES[route]) < F32_REL


# --------------------------------------------------------------------------- #
# int8 weight-only matmul
#
# What is asserted:
# * integer-valued activations (|x| <= 8, K <= 40): every product and partial
#   sum is an integer below 2**24, so float32 accumulation is exact in any
#   order; with unit scales the output EQUALS x.astype(f64) @ wq.T.astype(f64),
#   and with scales it equals float32(acc) * scale, rounded once to the output
#   dtype (bit for bit, as NumPy computes it);
# * real-valued float32 activations, unit scales: |y - ref| <= gamma_K *
#   (|x| @ |wq|.T) with gamma_K = K * 2**-24, the float32 rounding bound of a
#   K-term dot product (products included), whatever the summation order.
# --------------------------------------------------------------------------- #


def int8_problem(rows, k=40, n=10, seed=8, integer_x=True):
    rng = np.random.default_rng(seed + rows)
    wq = rng.integers(-127, 128, (n, k)).astype(np.int8)
    if integer_x:
        x = rng.integers(-8, 9, (rows, k)).astype(np.float64)
    else:
        x = rng.standard_normal((rows, k)).astype(np.float32).astype(np.float64)
    scales = rng.uniform(1e-3, 2e-2, n).astype(np.float32)
    return x, wq, scales, x @ wq.T.astype(np.float64)


#: GEMV path (rows <= GEMV_MAX_ROWS) and tiled path (more rows, ragged tiles).
INT8_ROWS = [1, 3, kernels.GEMV_MAX_ROWS, kernels.GEMV_MAX_ROWS + 1, 21]


@pytest.mark.parametrize("rows", INT8_ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.slow
def test_linear_int8_exact_on_integer_activations(rows, dtype):
    ops = make_ops(dtype)
    x, wq, scales, acc = int8_problem(rows)
    to, f32 = ops.to_device, lambda a: ops.xp.asarray(a, np.float32)
    unscaled = ops.to_numpy(ops.linear_int8(to(x), to(wq), f32(np.ones(10))))
    if dtype == np.float32:
        np.testing.assert_array_equal(unscaled, acc)
    scaled = ops.to_numpy(ops.linear_int8(to(x), to(wq), f32(scales)))
    assert scaled.dtype == dtype
    np.testing.assert_array_equal(scaled, (acc.astype(np.float32) * scales).astype(dtype))


@pytest.mark.parametrize("rows", [2, 13])
def test_linear_int8_float32_rounding_bound(rows):
    ops = make_ops()
    x, wq, _, acc = int8_problem(rows, integer_x=False)
    to = ops.to_device
    out = ops.to_numpy(ops.linear_int8(to(x), to(wq), to(np.ones(10, np.float32))))
    bound = x.shape[1] * 2.0**-24 * (np.abs(x) @ np.abs(wq.astype(np.float64)).T)
    assert (np.abs(out - acc) <= bound).all()


def test_linear_int8_bias():
    ops = make_ops()
    x, wq, scales, acc = int8_problem(4)
    bias = np.linspace(-1, 1, 10).astype(np.float32)
    out = ops.to_numpy(ops.linear_int8(*map(ops.to_device, (x, wq, scales, bias))))
    assert rel_err(out, acc * scales + bias) < F32_REL


# --------------------------------------------------------------------------- #
# argument checks: ValueError naming the argument
# --------------------------------------------------------------------------- #


class Args:
    """Valid arguments to spoil, built in the test (not at collection)."""

    def __init__(self) -> None:
        self.ops = ops = make_ops()
        to = self.to = ops.to_device
        f32 = np.float32
        self.q = to(np.ones((2, 2, HD), f32))
        self.cache = ops.allocate_kv_cache(3, BS, 1, HD)
        self.bt = to(np.array([[0, 1]], np.int32))
        self.sl = to(np.array([2], np.int32))
        self.qsl = to(np.array([0, 2], np.int32))
        self.strided_q = to(np.ones((2, HD, 2), f32)).transpose(0, 2, 1)  # not C-contiguous
        self.x = to(np.ones((2, 6), f32))
        self.w = to(np.ones(6, f32))
        self.k = to(np.ones((2, 1, HD), f32))
        self.slots = to(np.arange(2))
        self.rope = to(build_rope_cache(HD, 4, 1e4))
        self.wq = to(np.ones((3, 6), np.int8))
        self.scales = ops.xp.ones(3, f32)

    def attn(self, **spoiled):
        """paged_attention on the valid arguments, some replaced (q, cache, bt, sl, qsl)."""
        a = {"q": self.q, "cache": self.cache, "bt": self.bt, "sl": self.sl, "qsl": self.qsl}
        a.update(spoiled)
        return self.ops.paged_attention(a["q"], a["cache"], a["bt"], a["sl"], a["qsl"], 1.0)


def _f32(a, shape):
    return a.to(np.ones(shape, np.float32))


#: (id, call on an Args, message pattern): calls the wrappers must refuse.
BAD_CALLS = [
    ("attn-q-dtype", lambda a: a.attn(q=a.q.astype(np.float64)), "paged_attention: q must be"),
    ("attn-q-shape", lambda a: a.attn(q=a.q.reshape(2, -1)), "paged_attention: q must be"),
    ("attn-q-noncontig", lambda a: a.attn(q=a.strided_q),
     "paged_attention: q must be a C-contiguous"),
    ("attn-q-not-cache-dtype", lambda a: a.attn(q=a.q.astype(np.float16)),
     "paged_attention: q must be .* float32"),
    ("attn-cache-shape", lambda a: a.attn(cache=a.cache[:, 0]), "paged_attention: kv_cache"),
    ("attn-block-tables-dtype", lambda a: a.attn(bt=a.bt.astype(np.float32)),
     "paged_attention: block_tables"),
    ("attn-block-id", lambda a: a.attn(bt=a.to(np.array([[3, 1]], np.int32))),
     "block id out of range"),
    ("attn-seq-lens", lambda a: a.attn(sl=a.to(np.array([1], np.int32))), "seq_lens"),
    ("attn-qsl-length", lambda a: a.attn(qsl=a.qsl[:1]), "query_start_loc"),
    ("attn-qsl-beyond-T", lambda a: a.attn(qsl=a.to(np.array([0, 3], np.int32))),
     "query_start_loc"),
    ("write-kv-k-shape", lambda a: a.ops.write_kv(a.k[:1], a.k, a.cache, a.slots),
     "write_kv: k must be"),
    ("write-kv-v-rows", lambda a: a.ops.write_kv(a.k, _f32(a, (2, 1, 2 * HD))[:, :, ::2],
                                                 a.cache, a.slots), "write_kv: v must be"),
    ("write-kv-slot", lambda a: a.ops.write_kv(a.k, a.k, a.cache, a.to(np.array([0, 12]))),
     "write_kv: slot out of range"),
    ("write-kv-cache-noncontig", lambda a: a.ops.write_kv(a.k, a.k, a.cache[..., ::2], a.slots),
     "write_kv: kv_cache"),
    ("rms-norm-x-dtype", lambda a: a.ops.rms_norm(a.x.astype(np.float64), a.w, 1e-6),
     "rms_norm: x"),
    ("rms-norm-weight", lambda a: a.ops.rms_norm(a.x, _f32(a, 5), 1e-6), "rms_norm: weight"),
    ("fused-residual-noncontig",
     lambda a: a.ops.fused_add_rms_norm(a.x, _f32(a, (6, 2)).T, a.w, 1e-6),
     "fused_add_rms_norm: residual"),
    ("fused-overlap", lambda a: a.ops.fused_add_rms_norm(a.x, a.x, a.w, 1e-6), "overlap"),
    ("rope-q-noncontig",
     lambda a: a.ops.rotary_embedding(a.slots, a.strided_q, a.k, a.rope, HD),
     "rotary_embedding: q"),
    ("rope-position",
     lambda a: a.ops.rotary_embedding(a.to(np.array([0, 4])), a.q, a.k, a.rope, HD),
     "rotary_embedding: position out of range"),
    ("rope-head-dim", lambda a: a.ops.rotary_embedding(a.slots, a.q, a.k, a.rope, HD // 2),
     "rotary_embedding: cos_sin_cache"),
    ("embedding-id", lambda a: a.ops.embedding(a.to(np.array([0, 2])), a.x),
     "embedding: token id out of range"),
    ("embedding-ids-float", lambda a: a.ops.embedding(a.x[0], a.x), "embedding: token_ids"),
    ("silu-odd", lambda a: a.ops.silu_and_mul(_f32(a, (2, 5))), "silu_and_mul: x"),
    ("linear-inner", lambda a: a.ops.linear(a.x, _f32(a, (3, 5))), "linear: x"),
    ("int8-weight-dtype", lambda a: a.ops.linear_int8(a.x, a.wq.astype(np.float32), a.scales),
     "linear_int8: weight_q"),
    ("int8-scales-dtype", lambda a: a.ops.linear_int8(a.x, a.wq, a.scales.astype(np.float16)),
     "linear_int8: scales"),
    ("int8-x-noncontig", lambda a: a.ops.linear_int8(_f32(a, (6, 2)).T, a.wq, a.scales),
     "linear_int8: x"),
    ("int8-bias-shape", lambda a: a.ops.linear_int8(a.x, a.wq, a.scales, _f32(a, 4)),
     "linear_int8: bias"),
]


@pytest.mark.parametrize("call,pattern", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_arguments_raise_value_error(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call(Args())


@pytest.mark.parametrize("kw", [{"partition_size": 0}, {"partition_size": 10**6},
                                {"dtype": np.float64}, {"max_threads": 1024},
                                {"prefill_min_queries": 0}])
def test_constructor_rejects_bad_parameters(kw):
    with pytest.raises(ValueError, match="CudaOps"):
        make_ops(**kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_warmup_and_dtype(dtype):
    """Every kernel runs once on the backend dtype; host round trip keeps values."""
    ops = make_ops(dtype)
    ops.warmup()
    a = np.arange(6, dtype=np.float64).reshape(2, 3)
    back = ops.to_numpy(ops.to_device(a))
    assert back.dtype == dtype and ops.allocate_kv_cache(1, BS, 1, HD).dtype == dtype
    np.testing.assert_array_equal(back, a)
