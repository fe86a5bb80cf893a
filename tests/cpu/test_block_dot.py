"""Block weights times Q8 activations (``kvserve.cpu.block_dot_ops`` over
``kvserve.cpu.block_dot_kernels``) against a float64 NumPy reference.

The reference is written here from the formulas: the activation blocks are
quantized in NumPy float32 (``xd = max|x| / 127``, codes ``rint(x * (1 / xd))``
half to even, clipped to +-127, ``xsum = xd * sum(codes)``) and must match
the kernel's bit for bit; the weight codes are unpacked from the blocks
(checked against gguf-py's dequantization) and each block's integer dot
product is summed exactly in int64. The kernels' output must equal
``sum_b d * xd * I_b (+ m * xsum)`` within the float32 rounding of those
terms, and the float product ``x @ W.T`` within the activation quantization
bound ``sum_b (xd_b / 2) sum_k |W[n, k]|`` (plus float32 rounding).
"""

from __future__ import annotations

import gguf
import numba
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from kvserve.cpu import block_dot_kernels as bdk
from kvserve.cpu import block_dot_ops as bdo
from kvserve.model import ggml_blocks as gb

TYPES = ["Q4_0", "Q4_1", "Q8_0"]
ROWS = [1, 2, 5, 7, 13]  # tiles of 4 rows, then 2, then 1: 7 = 4 + 2 + 1
N = 4 * 5 + 3  # not a multiple of the 4-channel chunk panels
U = 2.0**-24


def weight(ggml_type: str, n: int, k: int, seed: int):
    """(BlockQuantizedWeight, integer codes int64[N, K], dense float64[N, K])."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[ggml_type]
    raw = gguf_quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    w = gb.from_gguf_bytes(raw, ggml_type, (n, k))
    dense = gguf_dequantize(raw, qtype).reshape(n, k).astype(np.float64)
    if ggml_type == "Q8_0":
        codes = w.qs.astype(np.int64)
    else:  # byte j of a block: channel j low nibble, channel j + 16 high nibble
        pairs = w.qs.reshape(n, k // 32, 16).astype(np.int64)
        codes = np.concatenate([pairs & 15, pairs >> 4], axis=2).reshape(n, k)
        if ggml_type == "Q4_0":
            codes = codes - 8
    # The codes and scales reproduce llama.cpp's own dequantization.
    blocks = codes.reshape(n, k // 32, 32) * w.d[:, :, None].astype(np.float64)
    if ggml_type == "Q4_1":
        blocks = blocks + w.m[:, :, None]
    np.testing.assert_array_equal(blocks.reshape(n, k), dense)
    return w, codes, dense


def quantize_reference(x: np.ndarray):
    """NumPy float32 Q8 blocks: (xq int64[M, K], xd float32[M, B], xsum float32[M, B])."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    xd = np.abs(blocks).max(axis=2) / np.float32(127)
    inv = np.where(xd > 0, np.float32(1) / np.where(xd > 0, xd, 1), 0).astype(np.float32)
    codes = np.clip(np.rint(blocks * inv[:, :, None]), -127, 127)
    xsum = codes.sum(axis=2, dtype=np.float32) * xd
    return codes.reshape(m, k).astype(np.int64), xd.astype(np.float32), xsum.astype(np.float32)


def reference(x, ggml_type, w, codes):
    """(float64 sum of the block terms, float64 bound of their float32 rounding)."""
    xq, xd, xsum = quantize_reference(x)
    m, k = x.shape
    n, b = w.d.shape
    ints = np.einsum("nbj,mbj->mnb", codes.reshape(n, b, 32), xq.reshape(m, b, 32))
    scale = w.d[None].astype(np.float64) * xd[:, None].astype(np.float64)
    terms = scale * ints
    # The kernels convert partial sums of a block's products to float (8
    # lanes of 4 products in the AVX2 form), so their rounding scales with
    # the absolute products, not with |I_b| (a block sum may cancel).
    magnitude = np.abs(scale) * np.einsum("nbj,mbj->mnb", np.abs(codes.reshape(n, b, 32)),
                                          np.abs(xq.reshape(m, b, 32)))
    if ggml_type == "Q4_1":
        tail = w.m[None].astype(np.float64) * xsum[:, None].astype(np.float64)
        terms, magnitude = terms + tail, magnitude + np.abs(tail)
    return terms.sum(axis=2), (b + 4) * U * magnitude.sum(axis=2) + 1e-30


def activations(m: int, k: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)
    x[:, :32] *= 8  # blocks of different scales
    return x


@pytest.mark.parametrize("k", [32, 576, 1536])
@pytest.mark.parametrize("m", [1, 13])
def test_quantize_matches_numpy(m, k):
    x = activations(m, k, seed=k + m)
    x[0, 32:64] = 0 if k > 32 else x[0, 32:64]  # an all-zero block: xd 0, codes 0
    xq, xd, xsum = bdo.quantize_activations_q8(x)
    rq, rd, rs = quantize_reference(x)
    np.testing.assert_array_equal(xq, rq)
    np.testing.assert_array_equal(xd, rd)
    np.testing.assert_array_equal(xsum, rs)
    # |x - xq * xd| <= xd / 2: the activation error every product inherits.
    err = np.abs(x - xq * np.repeat(xd, 32, axis=1))
    assert (err <= np.repeat(xd, 32, axis=1) * (0.5 + 2 * U)).all()


def test_quantize_rounds_half_to_even():
    x = np.zeros((1, 32), np.float32)
    x[0, :5] = [127.0, 2.5, 3.5, -2.5, -0.5]  # xd = 1: ties at x / xd
    xq, xd, xsum = bdo.quantize_activations_q8(x)
    assert xd[0, 0] == 1.0
    assert xq[0, :5].tolist() == [127, 2, 4, -2, 0]
    assert xsum[0, 0] == 131.0


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("k", [32, 576, 1536])
@pytest.mark.parametrize("m", ROWS)
def test_linear_q8_equals_integer_reference(ggml_type, k, m):
    w, codes, dense = weight(ggml_type, N, k, seed=k)
    x = activations(m, k, seed=m)
    ref, bound = reference(x, ggml_type, w, codes)
    y = bdo.linear_blocks_q8(x, w, num_threads=1)
    assert y.dtype == np.float32 and y.shape == (m, N)
    assert (np.abs(y - ref) <= bound).all(), float((np.abs(y - ref) / bound).max())
    # Against the float product: the Q8 activation error, at most half a
    # code step per activation, times the weights' magnitudes.
    _, xd, _ = quantize_reference(x)
    exact = x.astype(np.float64) @ dense.T
    step = np.repeat(xd.astype(np.float64), 32, axis=1)
    q8_bound = 0.5 * (step * (1 + 4 * U)) @ np.abs(dense).T + bound
    assert (np.abs(y - exact) <= q8_bound).all()


def test_q8_activation_error_figure():
    """The Q8 error of a 576-wide product is small against |x| |W|: a random
    Q4_1 576 x 576 product stays within 1% of the float one's scale."""
    w, codes, dense = weight("Q4_1", 576, 576, seed=3)
    x = activations(4, 576, seed=4)
    y = bdo.linear_blocks_q8(x, w, num_threads=1)
    exact = x.astype(np.float64) @ dense.T
    rel = np.abs(y - exact).max() / np.abs(exact).max()
    scale = (np.abs(x).astype(np.float64) @ np.abs(dense).T).max()
    assert rel < 1e-2 and np.abs(y - exact).max() < 2e-3 * scale, (rel, scale)


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("m", [1, 5])
def test_parallel_paths(ggml_type, m, monkeypatch):
    """Numba's threads split the channels into ranges of whole 4-channel panels."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.fail("needs NUMBA_NUM_THREADS >= 2 to run the parallel kernels")
    monkeypatch.setattr(bdo, "parallel_chunks", lambda shape, n, threads: 2)
    w, codes, _ = weight(ggml_type, 4 * 5 + 1, 576, seed=9)
    x = activations(m, 576, seed=10)
    ref, bound = reference(x, ggml_type, w, codes)
    bias = np.linspace(-1, 1, w.shape[0]).astype(np.float32)
    y = bdo.linear_blocks_q8(x, w, bias)
    assert (np.abs(y - bias - ref) <= bound + 2 * U * np.abs(y)).all()


def test_q4_0_weight_through_the_q4_1_kernel():
    """A fused weight of mixed types takes the Q4_1 kernel; Q4_0 blocks there
    carry ``m = -8 d`` and give the same sums, rounded differently."""
    w, codes, _ = weight("Q4_0", N, 576, seed=5)
    fused = gb.BlockQuantizedWeight("q4", w.qs, w.d, w.m, "Q4_0+Q4_1")
    x = activations(5, 576, seed=6)
    ref, bound = reference(x, "Q4_0", w, codes)
    y = bdo.linear_blocks_q8(x, fused, num_threads=1)
    q4_1_terms = np.abs(w.m).sum(axis=1)[None] * np.abs(quantize_reference(x)[2]).max()
    assert (np.abs(y - ref) <= 4 * bound + 64 * U * q4_1_terms).all()


@pytest.mark.parametrize("ggml_type", TYPES)
def test_portable_loop_kernels(ggml_type):
    """The plain-loop dot products (used where the target has no AVX2)."""
    w, codes, _ = weight(ggml_type, N, 576, seed=11)
    x = activations(5, 576, seed=12)
    ref, bound = reference(x, ggml_type, w, codes)
    xq, xd, xsum = bdo.quantize_activations_q8(x)
    for n in (0, N - 1):
        if ggml_type == "Q4_1":
            one = bdk.loop_q4_1(w.qs, n, xq, 4, w.d, xd, w.m, xsum)
            two = bdk.loop_q4_1_x2(w.qs, n, xq, 0, w.d, xd, w.m, xsum)
            four = bdk.loop_q4_1_x4(w.qs, n, xq, 1, w.d, xd, w.m, xsum)
        elif ggml_type == "Q4_0":
            one = bdk.loop_q4_0(w.qs, n, xq, 4, w.d, xd)
            two = bdk.loop_q4_0_x2(w.qs, n, xq, 0, w.d, xd)
            four = bdk.loop_q4_0_x4(w.qs, n, xq, 1, w.d, xd)
        else:
            one = bdk.loop_q8_0(w.qs, n, xq, 4, w.d, xd)
            two = bdk.loop_q8_0_x2(w.qs, n, xq, 0, w.d, xd)
            four = bdk.loop_q8_0_x4(w.qs, n, xq, 1, w.d, xd)
        got = np.array([one, *two, *four])
        rows = [4, 0, 1, 1, 2, 3, 4]
        want, tol = ref[rows, n], bound[rows, n]
        assert (np.abs(got - want) <= tol).all()


def test_bad_operands():
    w, _, _ = weight("Q4_1", N, 64, seed=1)
    x = activations(2, 64, seed=2)
    with pytest.raises(ValueError, match="x: .* does not match"):
        bdo.linear_blocks_q8(x[:, :32].copy(), w)
    with pytest.raises(ValueError, match="x: expected a C-contiguous float32"):
        bdo.linear_blocks_q8(x.astype(np.float64), w)
    with pytest.raises(ValueError, match="x: expected a C-contiguous float32"):
        bdo.linear_blocks_q8(np.asfortranarray(x), w)
    with pytest.raises(ValueError, match="bias: shape"):
        bdo.linear_blocks_q8(x, w, np.zeros(N + 1, np.float32))
    with pytest.raises(ValueError, match="w.qs: shape"):
        bdo.linear_blocks_q8(x, gb.BlockQuantizedWeight("q4", w.qs[:, :-2].copy(), w.d, w.m,
                                                        "Q4_1"))
    with pytest.raises(ValueError, match="w: expected a q4 or q8"):
        bdo.linear_blocks_q8(x, np.zeros((N, 64), np.float32))
    with pytest.raises(ValueError, match="num_threads"):
        bdo.linear_blocks_q8(x, w, num_threads=0)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        bdo.quantize_activations_q8(np.zeros((1, 48), np.float32))
