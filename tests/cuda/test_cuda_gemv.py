"""The warp GEMV kernels of ``kvserve.cuda.gemv_kernels`` (int8 weight-only and
W8A8: weights read as int32 words, warp reductions), launched directly at
every block shape a GPU or the simulator may use, and through ``CudaOps``.

What is asserted:

* exactness: integer activations (int8) or int8 codes (W8A8), power-of-two
  scales and dyadic biases make every float32 step exact (all sums are
  integers, or multiples of 2**-3, below 2**24), so the outputs EQUAL the
  float64 references, bit for bit, whatever the summation order: a lost
  lane, a wrong reduction offset, a byte unpacked without its sign, a
  product with another channel's or group's operand cannot pass;
* both reduction paths (``warp_reduction``: shared memory under the
  simulator, and the GPU's shuffle tree on an emulated ``shfl_down_sync``);
* the launch shapes of ``gemv_block``: power-of-two lanes, whole warps and
  at most 256 threads on a GPU, at most ``max_threads`` under the simulator;
* K not a multiple of 4 (no int32 view) takes the tiled kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import config as numba_config

from kvserve.cuda import gemv_kernels, kernels
from kvserve.cuda.ops import CudaOps

#: (lanes, rows) blocks of 16 threads (the simulator's budget) and one
#: ragged shape: every tree depth from 0 to 4 offsets.
BLOCKS = [(1, 16), (2, 8), (4, 4), (8, 2), (16, 1), (4, 3)]
ROWS = [1, 3, kernels.GEMV_MAX_ROWS]
N_OUT = 10


def launch(kernel, n_out, block, *args):
    grid = (-(-n_out // block[1]),)
    kernel[grid, block](*args)


def int8_case(rows, k, seed=0):
    """x integer in [-8, 8], weights over all of int8 (-128 included),
    power-of-two scales, quarter-integer bias: the exact float64 result."""
    rng = np.random.default_rng(seed + 31 * rows + k)
    x = rng.integers(-8, 9, (rows, k)).astype(np.float32)
    wq = rng.integers(-128, 128, (N_OUT, k)).astype(np.int8)
    wq[0, :4] = [-128, -1, 127, 0]
    scales = (2.0 ** -rng.integers(0, 4, N_OUT)).astype(np.float32)
    bias = (rng.integers(-8, 9, N_OUT) / 4).astype(np.float32)
    ref = (x.astype(np.float64) @ wq.T.astype(np.float64)) * scales + bias
    return x, wq, scales, bias, ref


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b[0]}x{b[1]}" for b in BLOCKS])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.slow
def test_int8_gemv_kernel_exact_at_every_block_shape(block, rows, warp_reduction):
    x, wq, scales, bias, ref = int8_case(rows, k=72)  # 18 words: several strides
    out = np.full((rows, N_OUT), np.nan, np.float32)
    launch(gemv_kernels.int8_gemv_kernel, N_OUT, block, x, wq.view(np.int32), scales, scales,
           bias, out)
    np.testing.assert_array_equal(out, ref)


def w8a8_case(rows, k, seed=1):
    """int8 codes in [-15, 15] and weights over all of int8, group scales
    2**j (j in -1..1, two groups of one row with different ones), dyadic
    channel scales and bias: the exact float64 result."""
    rng = np.random.default_rng(seed + 31 * rows + k)
    group = 64 if k % 64 == 0 else k
    G = k // group
    xq = rng.integers(-15, 16, (rows, k)).astype(np.int8)
    x_scales = (2.0 ** rng.integers(-1, 2, (rows, G))).astype(np.float32)
    if G > 1:
        x_scales[0, :2] = [0.5, 2.0]
    wq = rng.integers(-128, 128, (N_OUT, k)).astype(np.int8)
    scales = (2.0 ** -rng.integers(0, 3, N_OUT)).astype(np.float32)
    bias = (rng.integers(-8, 9, N_OUT) / 2).astype(np.float32)
    acc = np.einsum("tgk,ngk->tng", xq.astype(np.float64).reshape(rows, G, group),
                    wq.astype(np.float64).reshape(N_OUT, G, group))
    ref = (acc * x_scales[:, None, :]).sum(axis=2) * scales + bias
    return xq, x_scales, group, wq, scales, bias, ref


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b[0]}x{b[1]}" for b in BLOCKS])
@pytest.mark.parametrize("k", [256, 72])  # four groups of 64; one group of 72
@pytest.mark.slow
def test_w8a8_gemv_kernel_exact_at_every_block_shape(block, k, warp_reduction):
    rows = kernels.GEMV_MAX_ROWS if block[0] in (2, 16) else 3
    xq, x_scales, group, wq, scales, bias, ref = w8a8_case(rows, k)
    out = np.full((rows, N_OUT), np.nan, np.float32)
    launch(gemv_kernels.w8a8_gemv_kernel, N_OUT, block, xq.view(np.int32), x_scales,
           group // 4, wq.view(np.int32), scales, bias, out)
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("k", [72, 42])  # the word GEMV; K % 4 != 0: the tiled kernel
def test_linear_int8_through_ops_at_both_k(dtype, k):
    ops = CudaOps(dtype=dtype)
    x, wq, scales, bias, ref = int8_case(3, k)
    to = ops.to_device
    out = ops.to_numpy(ops.linear_int8(to(x), to(wq), ops.xp.asarray(scales),
                                       ops.xp.asarray(bias.astype(dtype))))
    assert out.dtype == dtype
    np.testing.assert_array_equal(out, ref.astype(np.float32).astype(dtype))


@pytest.mark.skipif(not numba_config.ENABLE_CUDASIM, reason="calls a device function on the host")
def test_unpack_sbytes_of_little_endian_words():
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, 64, dtype=np.uint8)
    raw[:4] = [0x80, 0xFF, 0x7F, 0x00]
    signed = np.empty(4, np.int32)
    for i, word in enumerate(raw.view(np.int32)):
        gemv_kernels._unpack_sbytes(word, signed)
        np.testing.assert_array_equal(signed, raw[4 * i: 4 * i + 4].view(np.int8))


@pytest.mark.parametrize("work", [1, 2, 3, 9, 16, 31, 32, 33, 144, 5000])
@pytest.mark.parametrize("n_out", [1, 5, 64, 49152])
@pytest.mark.parametrize("max_threads", [1, 16, 100, 256])
def test_gemv_block_shapes(work, n_out, max_threads):
    lanes, rows = gemv_kernels.gemv_block(work, n_out, max_threads, simulator=False)
    assert lanes & (lanes - 1) == 0 and lanes <= gemv_kernels.WARP_SIZE
    assert lanes >= min(work, gemv_kernels.WARP_SIZE)
    threads = lanes * rows
    assert threads % gemv_kernels.WARP_SIZE == 0
    assert threads <= max(gemv_kernels.WARP_SIZE, max_threads)
    assert threads <= kernels.MAX_BLOCK_THREADS
    lanes, rows = gemv_kernels.gemv_block(work, n_out, max_threads, simulator=True)
    assert lanes & (lanes - 1) == 0
    assert lanes <= min(gemv_kernels.SIMULATOR_LANES, max_threads)
    assert 1 <= rows <= n_out and lanes * rows <= max_threads


def test_w8a8_group_of_k_and_k_not_a_multiple_of_4_through_ops():
    ops = CudaOps()
    rng = np.random.default_rng(9)
    for k in (72, 70):  # one group of 72 (word GEMV); 70: the tiled kernel
        x = rng.standard_normal((2, k)).astype(np.float32)
        wq = rng.integers(-127, 128, (N_OUT, k)).astype(np.int8)
        scales = np.ones(N_OUT, np.float32)
        to = ops.to_device
        got = ops.to_numpy(ops.linear_w8a8(to(x), to(wq), ops.xp.asarray(scales)))
        xs = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
        codes = np.clip(np.rint(x * (np.float32(1) / xs)), -127, 127)
        ref = (codes.astype(np.float64) @ wq.T.astype(np.float64)) * xs
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
