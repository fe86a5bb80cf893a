"""CUDA W8A8 matmul (``CudaOps.linear_w8a8``) against an independent NumPy
reference written here, under Numba's CUDA simulator (tiny shapes).

The reference quantizes as specified (``kvserve.model.quantization``): per
row and group of 64 input channels (one group per row when 64 does not
divide K), ``x_scale = max|x| / 127`` in float32 (1 for a zero group),
``xq = clip(rint(x * (1 / x_scale)), -127, 127)``; then, in float64 from the
int8 codes, ``y = scales[n] * sum_g x_scale[g] * (xq_g @ wq_g.T) (+ bias)``.

What is asserted:

* the quantization kernel's codes and scales equal the reference's (and
  ``kvserve.cpu.int8``'s) bit for bit;
* exactness: with group scales that are powers of two every float32 step
  after the int32 sums is exact, so the output EQUALS the reference rounded
  once to float32 (then to float16): an integer product off by one, or a
  group scaled by another group's scale, cannot pass;
* random activations: ``|y - ref| <= gamma_n * (|scales| * sum_g
  |x_scale_g * acc_g| + |bias|)`` with ``gamma_n = n u / (1 - n u)``,
  ``u = 2**-24``, ``n = G + 3`` roundings (G group products, G - 1 group
  sums, the channel scale, the bias), whatever the summation order; plus
  half an ulp (2**-11 relative) for a float16 output;
* bad arguments raise ValueError naming the argument.

Rows: <= GEMV_MAX_ROWS take the GEMV kernel, more the tiled kernel (ragged
tiles with N = 6). K = 128 is two groups; K = 70 is one group per row, and
not a multiple of the tiled kernel's K step.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.cpu import int8 as cpu_int8
from kvserve.cuda import kernels
from kvserve.cuda.ops import CudaOps
from kvserve.model.quantization import QuantizedWeight

DTYPES = [np.float32, np.float16]
N_OUT = 6
#: K = 128: two groups of 64; K = 70: one group of 70 (64 does not divide it).
KS = [128, 70]
GEMV_ROWS = [1, kernels.GEMV_MAX_ROWS]
TILED_ROWS = [kernels.GEMV_MAX_ROWS + 1, 13]
U = 2.0**-24


def group_of(k: int) -> int:
    return 64 if k % 64 == 0 else k


def ref_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes int64[T, K], x_scales float32[T, G]) of x (any float dtype), as specified."""
    x = np.asarray(x, np.float32)
    T, K = x.shape
    group = group_of(K)
    xg = x.reshape(T, K // group, group)
    absmax = np.abs(xg).max(axis=2)
    x_scales = np.where(absmax > 0, absmax / np.float32(127), np.float32(1)).astype(np.float32)
    inv = (np.float32(1) / x_scales).astype(np.float32)
    codes = np.clip(np.rint(xg * inv[:, :, None]), -127, 127).astype(np.int64)
    return codes.reshape(T, K), x_scales


def ref_terms(x, wq, scales):
    """float64 [T, N, G]: scales[n] * x_scale[t, g] * (exact integer group sum)."""
    codes, x_scales = ref_quantize(x)
    T, K = codes.shape
    group = group_of(K)
    G = K // group
    cg = codes.reshape(T, G, group).astype(np.float64)
    wg = wq.astype(np.float64).reshape(wq.shape[0], G, group)
    acc = np.einsum("tgk,ngk->tng", cg, wg)  # integers below 2**53: exact
    return acc * x_scales.astype(np.float64)[:, None, :] * scales.astype(np.float64)[None, :, None]


def make_ops(dtype=np.float32) -> CudaOps:
    return CudaOps(dtype=dtype)


def problem(rows, k, dtype, seed=0):
    rng = np.random.default_rng(seed + 10 * rows + k)
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.1, 4.0, (1, k))).astype(dtype)
    wq = rng.integers(-127, 128, (N_OUT, k)).astype(np.int8)
    scales = rng.uniform(1e-3, 2e-2, N_OUT).astype(np.float32)
    return x, wq, scales


def test_group_size_is_the_cpu_backends():
    assert kernels.W8A8_GROUP == cpu_int8.GROUP


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_kernel_equals_reference_and_cpu(k, dtype):
    x, _, _ = problem(3, k, dtype)
    x[1, : group_of(k)] = 0  # an all-zero group: scale 1, codes 0
    x[2, 5] = -np.abs(x[2]).max() * 1.5  # the group's absmax is negative
    group = group_of(k)
    xq = np.empty(x.shape, np.int8)
    x_scales = np.empty((3, k // group), np.float32)
    kernels.quantize_groups_kernel[(3, k // group), (5,)](x, group, xq, x_scales)
    codes, ref_scales = ref_quantize(x)
    np.testing.assert_array_equal(x_scales, ref_scales)
    np.testing.assert_array_equal(xq, codes)
    assert x_scales[1, 0] == 1.0 and (xq[1, :group] == 0).all()
    assert xq[2, 5] == -127
    cpu_xq, cpu_scales = cpu_int8.quantize_activations(x.astype(np.float32), group)
    np.testing.assert_array_equal(xq, cpu_xq)
    np.testing.assert_array_equal(x_scales, cpu_scales)


def power_of_two_problem(rows, k, dtype, seed=3):
    """x whose group absmaxes are 127 * 2**j, j in {-1, 0, 1} per (row, group):
    the group scales are 2**j and the codes the chosen integers, so that every
    float32 step after the int32 sums is exact (|sum| < 2**23 halves)."""
    rng = np.random.default_rng(seed + rows + k)
    group = group_of(k)
    G = k // group
    codes = rng.integers(-127, 128, (rows, G, group))
    codes[:, :, 0] = rng.choice([-127, 127], (rows, G))
    exps = rng.integers(-1, 2, (rows, G))
    if rows > 1 and G > 1:
        exps[0] = [-1, 1]  # two groups of one row with different scales
    x = (codes * 2.0 ** exps[:, :, None]).reshape(rows, k).astype(dtype)
    wq = rng.integers(-127, 128, (N_OUT, k)).astype(np.int8)
    scales = rng.uniform(1e-3, 2e-2, N_OUT).astype(np.float32)
    return x, wq, scales


@pytest.mark.parametrize("rows", [3, kernels.GEMV_MAX_ROWS + 1])
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_w8a8_exact_on_power_of_two_group_scales(rows, k, dtype):
    ops = make_ops(dtype)
    x, wq, scales = power_of_two_problem(rows, k, dtype)
    to = ops.to_device
    out = ops.to_numpy(ops.linear_w8a8(to(x), to(wq), ops.xp.asarray(scales)))
    assert out.dtype == dtype and out.shape == (rows, N_OUT)
    unscaled = ref_terms(x, wq, np.ones(N_OUT, np.float32)).sum(axis=2)
    assert (unscaled.astype(np.float32) == unscaled).all()  # the premise: exact in float32
    expected = (unscaled.astype(np.float32) * scales).astype(dtype)
    np.testing.assert_array_equal(out, expected)


def check_rounding_bound(out, x, wq, scales, bias, dtype):
    terms = ref_terms(x, wq, scales)
    b = np.zeros(N_OUT) if bias is None else bias.astype(np.float64)
    ref = terms.sum(axis=2) + b
    n = terms.shape[2] + 3
    gamma = n * U / (1 - n * U)
    bound = gamma * (np.abs(terms).sum(axis=2) + np.abs(b))
    if dtype == np.float16:
        bound = bound * (1 + 2.0**-11) + 2.0**-11 * np.abs(ref)
    err = np.abs(out.astype(np.float64) - ref)
    assert (err <= bound).all(), float((err / np.maximum(bound, 1e-300)).max())


@pytest.mark.parametrize("rows, with_bias", [
    (GEMV_ROWS[0], True), (GEMV_ROWS[1], False), (TILED_ROWS[0], True), (TILED_ROWS[1], False)])
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.slow
def test_linear_w8a8_within_float32_rounding_of_reference(rows, with_bias, k, dtype):
    ops = make_ops(dtype)
    x, wq, scales = problem(rows, k, dtype)
    bias = np.linspace(-2, 3, N_OUT).astype(np.float32) if with_bias else None
    to = ops.to_device
    dev_bias = None if bias is None else ops.xp.asarray(bias)
    out = ops.to_numpy(ops.linear_w8a8(to(x), to(wq), ops.xp.asarray(scales), dev_bias))
    assert out.dtype == dtype and out.shape == (rows, N_OUT)
    check_rounding_bound(out, x, wq, scales, bias, dtype)


def test_linear_dispatches_w8a8_and_matches_the_cpu_backend():
    ops = make_ops()
    x, wq, scales = problem(3, 128, np.float32, seed=7)
    to = ops.to_device
    weight = QuantizedWeight(to(wq), ops.xp.asarray(scales), "w8a8")
    out = ops.to_numpy(ops.linear(to(x), weight))
    np.testing.assert_array_equal(out, ops.to_numpy(ops.linear_w8a8(to(x), to(wq),
                                                                    ops.xp.asarray(scales))))
    cpu = cpu_int8.linear_w8a8(x, wq, scales)
    check_rounding_bound(out, x, wq, scales, None, np.float32)
    check_rounding_bound(cpu, x, wq, scales, None, np.float32)
    with pytest.raises(ValueError, match="unknown quantization scheme"):
        ops.linear(to(x), QuantizedWeight(to(wq), ops.xp.asarray(scales), "w4a16"))


def test_zero_rows_and_zero_activations():
    ops = make_ops()
    to = ops.to_device
    wq, scales = to(np.ones((N_OUT, 64), np.int8)), ops.xp.ones(N_OUT, np.float32)
    assert ops.linear_w8a8(to(np.zeros((0, 64), np.float32)), wq, scales).shape == (0, N_OUT)
    bias = np.arange(N_OUT, dtype=np.float32)
    out = ops.linear_w8a8(to(np.zeros((2, 64), np.float32)), wq, scales, ops.xp.asarray(bias))
    np.testing.assert_array_equal(ops.to_numpy(out), np.tile(bias, (2, 1)))


#: (id, call(ops, x, weight_q, scales), the message's start).
BAD = [
    ("x-dtype", lambda o, x, w, s: o.linear_w8a8(x.astype(np.float64), w, s), "x"),
    ("x-ndim", lambda o, x, w, s: o.linear_w8a8(x.reshape(-1), w, s), "x"),
    ("x-noncontig", lambda o, x, w, s: o.linear_w8a8(o.to_device(np.ones((64, 2))).T, w, s), "x"),
    ("weight-dtype", lambda o, x, w, s: o.linear_w8a8(x, w.astype(np.int16), s), "weight_q"),
    ("weight-k", lambda o, x, w, s: o.linear_w8a8(x, w[:, :63].copy(), s), "weight_q"),
    ("weight-noncontig", lambda o, x, w, s: o.linear_w8a8(x, w.T.copy().T, s), "weight_q"),
    ("scales-dtype", lambda o, x, w, s: o.linear_w8a8(x, w, s.astype(np.float16)), "scales"),
    ("scales-shape", lambda o, x, w, s: o.linear_w8a8(x, w, s[:2]), "scales"),
    ("bias-shape", lambda o, x, w, s: o.linear_w8a8(x, w, s, o.xp.ones(4, np.float32)), "bias"),
    ("bias-dtype", lambda o, x, w, s: o.linear_w8a8(x, w, s, o.xp.ones(3, np.float64)), "bias"),
]


@pytest.mark.parametrize("call, what", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_arguments_raise_value_error_naming_them(call, what):
    ops = make_ops()
    x, wq = ops.to_device(np.ones((2, 64), np.float32)), ops.to_device(np.ones((3, 64), np.int8))
    with pytest.raises(ValueError, match=f"^linear_w8a8: {what} "):
        call(ops, x, wq, ops.xp.ones(3, np.float32))
