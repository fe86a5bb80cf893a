"""K-quant weights (Q4_K, Q5_K, Q6_K) times Q8_K activations
(``kvserve.cpu.kquant_kernels`` / ``kquant_ops``) against references written here.

- Decoding: the super-blocks are random bytes (with sane float16 scales), and
  the kernels' values must equal gguf-py's ``dequantize`` (llama.cpp's
  ``dequantize_row_q*_K`` in NumPy) exactly.
- Q8_K: a NumPy float32 version of ``quantize_row_q8_K_ref`` (the value of
  largest magnitude maps to -127) must match the kernel's codes bit for bit.
- Products: every dot form the CPU has (the generic one everywhere, AVX2
  wherever it exists, the fastest), 1 to 9 rows (the 4-row tile and its
  remainders), against float64 products of the exactly dequantized weight
  and activations, within the float32 rounding of the per-super-block terms.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from kvserve.cpu import kquant_kernels as kk
from kvserve.cpu import kquant_ops as ko
from kvserve.model.ggml_blocks import BlockQuantizedWeight, KQuantWeight, StackedWeight
from kvserve.model.gguf_weights import pack_tensor, q5_0_as_q8_0

TYPES = ["Q4_K", "Q5_K", "Q6_K"]
DOTS = [kk.DOT_FAST, kk.DOT_GENERIC, kk.DOT_AVX2]


def random_blocks(ggml_type: str, n: int, k: int, seed: int) -> np.ndarray:
    """uint8[n, k / 256, block bytes]: random codes, scales and mins, float16 d
    (and dmin) in [1e-3, 2e-3]."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 256, kk.BLOCK_BYTES[ggml_type]), dtype=np.uint8)

    def f16(shape):
        return rng.uniform(1e-3, 2e-3, shape).astype(np.float16).view(np.uint8).reshape(*shape, 2)

    if ggml_type == "Q6_K":
        raw[:, :, 208:210] = f16(raw.shape[:2])
    else:
        raw[:, :, 0:2] = f16(raw.shape[:2])
        raw[:, :, 2:4] = f16(raw.shape[:2])
    return raw


def gguf_values(raw: np.ndarray, ggml_type: str) -> np.ndarray:
    """float64[n, k]: gguf-py's dequantization of the blocks."""
    n = raw.shape[0]
    qtype = gguf.GGMLQuantizationType[ggml_type]
    return gguf_dequantize(raw.reshape(n, -1), qtype).reshape(n, -1).astype(np.float64)


def weight(ggml_type: str, n: int, k: int, seed: int) -> tuple[KQuantWeight, np.ndarray]:
    raw = random_blocks(ggml_type, n, k, seed)
    p = pack_tensor(raw, ggml_type, None)
    w = KQuantWeight(ggml_type, n, k, p["codes"], p["scales"], p["mins"], p["dd"], raw)
    return w, gguf_values(raw, ggml_type)


def q8_k_reference(x: np.ndarray):
    """NumPy float32 Q8_K: (codes int64[M, K], d float32[M, K / 256])."""
    m, k = x.shape
    blocks = x.reshape(m, k // 256, 256)
    idx = np.abs(blocks).argmax(axis=2)
    vmax = np.take_along_axis(blocks, idx[:, :, None], axis=2)[:, :, 0]
    safe = np.where(vmax == 0, np.float32(1), vmax)
    iscale = (np.float32(-127.0) / safe).astype(np.float32)
    codes = np.minimum(np.rint(blocks * iscale[:, :, None]), 127).astype(np.int64)
    d = (np.float32(1) / iscale).astype(np.float32)
    codes[vmax == 0] = 0
    d[vmax == 0] = 0
    return codes.reshape(m, k), d


@pytest.mark.parametrize("ggml_type", TYPES)
def test_decoding_equals_gguf_dequantize(ggml_type):
    raw = random_blocks(ggml_type, 5, 512, seed=1)
    d, dmin = ko.scales_of(raw, ggml_type)
    out = np.empty((5, 512), np.float32)
    kk.dequantize_rows(raw, d, dmin, kk.KIND_OF[ggml_type], out)
    np.testing.assert_array_equal(out.astype(np.float64), gguf_values(raw, ggml_type))


def test_q8_k_matches_llamacpp_rule():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 768)).astype(np.float32)
    x[1, 256:512] = 0  # an all-zero super-block
    x[2, 3] = -9.0  # a negative extreme: iscale > 0
    xq, xd, bsums = ko.quantize_activations(x)
    codes, d = q8_k_reference(x)
    np.testing.assert_array_equal(xq.astype(np.int64), codes)
    np.testing.assert_array_equal(xd, d)
    np.testing.assert_array_equal(bsums, codes.reshape(3, -1, 16).sum(axis=2))
    assert xq.min() >= -127 and xq.max() <= 127


@pytest.mark.parametrize("dot", DOTS, ids=["fast", "generic", "avx2"])
@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
def test_product_equals_float64_reference(dot, ggml_type, m):
    n, k = 48, 512
    w, dense = weight(ggml_type, n, k, seed=m + 7)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    xq, xd, bsums = ko.quantize_activations(x)
    xdeq = xq.reshape(m, -1, 256).astype(np.float64) * xd[:, :, None].astype(np.float64)
    xdeq = xdeq.reshape(m, k)
    want = xdeq @ dense.T
    bound = 1e-6 * (np.abs(xdeq) @ np.abs(dense).T) + 1e-6
    out = np.full((m, n), np.nan, np.float32)
    # channels 16 .. 47 only: the first panel must stay untouched
    kk.kquant_range(xq, xd, bsums, w.codes, w.scales, w.mins, w.dd, out, 16, n,
                    kk.KIND_OF[ggml_type], dot)
    assert np.isnan(out[:, :16]).all()
    err = np.abs(out[:, 16:] - want[:, 16:])
    assert (err <= bound[:, 16:]).all(), float((err / bound[:, 16:]).max())


def test_q4_k_panels_are_a_byte_permutation():
    """Byte (32 s + 8 k + g) * 64 + 4 c + t of panel G holds byte 32 k + 4 g + t
    of the nibbles of super-block s of channel 16 G + c."""
    raw = random_blocks("Q4_K", 32, 512, seed=3)
    p = pack_tensor(raw, "Q4_K", None)
    codes = p["codes"].reshape(2, 2, 4, 8, 16, 4)  # G, s, k, g, c, t
    nibbles = raw[:, :, 16:].reshape(2, 16, 2, 4, 8, 4)  # G, c, s, k, g, t
    np.testing.assert_array_equal(codes, nibbles.transpose(0, 2, 3, 4, 1, 5))


def test_linear_pads_rows_and_stacks_parts():
    """N not a multiple of 16 (zero channels padded and cut), a bias, and a
    stack of a Q4_K, a Q6_K and a dense part: one product."""
    k = 256
    a, da = weight("Q4_K", 20, k, seed=4)
    b, db = weight("Q6_K", 16, k, seed=5)
    dense = np.random.default_rng(6).standard_normal((8, k)).astype(np.float32)
    x = np.random.default_rng(7).standard_normal((3, k)).astype(np.float32)
    bias = np.arange(44, dtype=np.float32)
    stacked = StackedWeight((a, b, dense))
    assert stacked.shape == (44, k)
    out = ko.linear_kquant(x, stacked, bias, None, other=lambda x, w: x @ w.T)
    want = x.astype(np.float64) @ np.concatenate([da, db, dense]).T + bias
    np.testing.assert_allclose(out, want, rtol=0.05, atol=0.05 * np.abs(want).max())


@pytest.mark.parametrize("ggml_type", TYPES)
def test_embedding_rows(ggml_type):
    w, dense = weight(ggml_type, 40, 512, seed=8)
    ids = np.array([39, 0, 7, 7], np.int64)
    np.testing.assert_array_equal(ko.embedding_kquant(ids, w).astype(np.float64), dense[ids])


def test_q5_0_as_q8_0_is_exact():
    rng = np.random.default_rng(9)
    n, k = 4, 64
    raw = rng.integers(0, 256, (n, k // 32, 22), dtype=np.uint8)
    raw[:, :, 0:2] = rng.uniform(1e-3, 2e-3, (n, k // 32)).astype(np.float16).view(
        np.uint8).reshape(n, k // 32, 2)
    w = q5_0_as_q8_0(raw.reshape(-1), (n, k))
    assert isinstance(w, BlockQuantizedWeight) and w.kind == "q8"
    values = w.qs.reshape(n, k // 32, 32).astype(np.float64) * w.d[:, :, None]
    want = gguf_dequantize(raw.reshape(n, -1), gguf.GGMLQuantizationType.Q5_0)
    np.testing.assert_array_equal(values.reshape(n, k), want.reshape(n, k))
