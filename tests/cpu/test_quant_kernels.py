"""The CPU int8 matrix products (``kvserve.cpu.quant_ops`` over
``kvserve.cpu.quant_kernels``) against independent NumPy references.

Both loop orders (the decode/GEMV one and the cache-tiled one, forced by the
``loop_order`` fixture) run at every M of ``ROWS``, with K odd and N in
``CHANNELS`` a multiple of neither the register tile (NR) nor the cache tile
(CACHE_TILE_N), so that every clamped edge tile runs: a lone last row (M = 1,
9), 2 or 3 leftover rows (130, 3), 1 or 2 channels past a whole group.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from kvserve.cpu import parallel as cpu_parallel
from kvserve.cpu import quant_kernels as qk
from kvserve.cpu import quant_ops as qo

ROWS = [1, 3, 8, 9, 64, 130]
#: Odd K; N = 2 cache tiles and 1 or 6 (= NR + 2) channels.
K = 77
CHANNELS = [2 * qk.CACHE_TILE_N + 1, 2 * qk.CACHE_TILE_N + 6]
N = CHANNELS[1]
#: float32 unit roundoff.
U = 2.0**-24


def f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def int8_operands(m: int, seed: int = 0, k: int = K, n: int = N):
    """x float32[m, k]; (wq, scales) of a random float weight [n, k]."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    wq, scales = qo.quantize_weight(rng.standard_normal((n, k)).astype(np.float32))
    return x, wq, scales


def reference_quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row symmetric int8 in NumPy, float32 as the kernel computes it."""
    absmax = np.abs(x).max(axis=1, initial=np.float32(0))
    xs = np.where(absmax > 0, absmax / np.float32(127), np.float32(1)).astype(np.float32)
    xq = np.clip(np.rint(x / xs[:, None]), -127, 127).astype(np.int8)
    return xq, xs


@pytest.fixture(params=["gemv", "tiled"])
def loop_order(request, monkeypatch):
    """Forces quant_ops onto one loop order whatever M is."""
    monkeypatch.setattr(qo, "GEMV_MAX_ROWS", 10**9 if request.param == "gemv" else 0)
    return request.param


def test_shapes_reach_every_edge_tile_and_both_default_orders():
    assert min(ROWS) <= qo.GEMV_MAX_ROWS < max(ROWS)
    assert K % 2 and sorted(n % qk.NR for n in CHANNELS) == [1, 2]
    assert {1, 2, 3} <= {m % qk.MR for m in ROWS}


# --------------------------------------------------------------------------- #
# quantization
# --------------------------------------------------------------------------- #


def test_quantize_weight_round_trip_within_half_a_step():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((N, K)).astype(np.float32)
    w[5] = 0.0
    w[6] *= 1e-30
    wq, scales = qo.quantize_weight(w)
    assert wq.dtype == np.int8 and wq.shape == (N, K) and wq.flags.c_contiguous
    assert scales.dtype == np.float32 and scales.shape == (N,)
    # Half a step, plus the float32 rounding of w / scale (|w / scale| <= 127).
    bound = f64(scales)[:, None] * (0.5 + 128 * U)
    assert (np.abs(f64(wq) * f64(scales)[:, None] - f64(w)) <= bound).all()
    assert (np.abs(wq).max(axis=1)[np.arange(N) != 5] == 127).all()
    assert not wq[5].any() and scales[5] == qo.ZERO_ROW_SCALE


def test_quantize_weight_rounds_half_to_even():
    wq, scales = qo.quantize_weight(np.array([[127.0, 2.5, -3.5, 0.5, 1.5, -0.5]], np.float32))
    assert scales[0] == 1.0
    assert wq.tolist() == [[127, 2, -4, 0, 2, 0]]


@pytest.mark.parametrize("w", [np.ones(4, np.float32), np.ones((2, 2), np.int32),
                               np.array([[1.0, np.nan]], np.float32)],
                         ids=["1-D", "integer", "nan"])
def test_quantize_weight_refuses_bad_weights(w):
    with pytest.raises(ValueError, match=r"^w:"):
        qo.quantize_weight(w)


def test_activation_quantization_matches_the_numpy_reference():
    x, _, _ = int8_operands(9, seed=2)
    x[3] = 0.0
    x[4, 7] = 300.0  # an outlier flattens its row's other codes
    xq, xs = qo.quantize_activations(x)
    ref_q, ref_s = reference_quantize_rows(x)
    assert np.array_equal(xs, ref_s) and np.array_equal(xq, ref_q)
    bound = f64(xs)[:, None] * (0.5 + 128 * U)
    assert (np.abs(f64(xq) * f64(xs)[:, None] - f64(x)) <= bound).all()
    assert not xq[3].any() and xq[4, 7] == 127


# --------------------------------------------------------------------------- #
# int8 weight-only
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("n", CHANNELS)
@pytest.mark.parametrize("m", ROWS)
def test_int8_weight_only_equals_the_float64_product(m, n, loop_order):
    """Within float32 accumulation: K terms summed in any order (the kernel
    reassociates) and one product by the scale err by at most
    (K + 1) * u * sum_k |x[m, k] * wq[n, k]| * scales[n], u = 2**-24."""
    x, wq, scales = int8_operands(m, seed=m, n=n)
    ref = (f64(x) @ f64(wq).T) * f64(scales)
    got = qo.linear_int8(x, wq, scales)
    assert got.dtype == np.float32 and got.shape == (m, n)
    bound = (K + 1) * U * (np.abs(f64(x)) @ np.abs(f64(wq)).T) * f64(scales)
    assert (np.abs(got - ref) <= bound).all()


@pytest.mark.parametrize("n", CHANNELS)
@pytest.mark.parametrize("m", ROWS)
def test_int8_weight_only_is_exact_on_small_integer_activations(m, n, loop_order):
    """Integer x in [-8, 8]: every partial sum is an integer below
    K * 8 * 127 < 2**24, exact in float32 in any order; power-of-two scales
    keep the product exact."""
    rng = np.random.default_rng(m)
    x = rng.integers(-8, 9, (m, K)).astype(np.float32)
    wq = rng.integers(-127, 128, (n, K)).astype(np.int8)
    scales = (2.0 ** rng.integers(-3, 4, n)).astype(np.float32)
    got = qo.linear_int8(x, wq, scales)
    assert np.array_equal(got, (x.astype(np.int64) @ wq.T.astype(np.int64)) * f64(scales))


# --------------------------------------------------------------------------- #
# w8a8
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("n", CHANNELS)
@pytest.mark.parametrize("m", ROWS)
def test_w8a8_int32_accumulator_is_exact(m, n, loop_order):
    """Full-range codes (weights down to -128) and a K whose extreme sum
    127 * 127 * K exceeds 2**24: exact in int32, not in float32."""
    k = 1101
    rng = np.random.default_rng(m)
    xq = rng.integers(-127, 128, (m, k)).astype(np.int8)
    wq = rng.integers(-128, 128, (n, k)).astype(np.int8)
    xq[0], wq[0], wq[1] = 127, 127, -128
    acc = qo.w8a8_accumulate(xq, wq)
    assert acc.dtype == np.int32 and acc.shape == (m, n)
    assert acc[0, 0] == 127 * 127 * k > 2**24
    assert np.array_equal(acc, xq.astype(np.int64) @ wq.T.astype(np.int64))


@pytest.mark.parametrize("n", CHANNELS)
@pytest.mark.parametrize("m", ROWS)
def test_w8a8_equals_the_product_of_its_quantized_operands(m, n, loop_order):
    """After the exact int32 sum, three float32 roundings (int32 -> float32,
    times xs, times scales): within 3 u of the float64 product."""
    x, wq, scales = int8_operands(m, seed=10 + m, n=n)
    xq, xs = reference_quantize_rows(x)
    ref = (f64(xq) @ f64(wq).T) * f64(xs)[:, None] * f64(scales)
    got = qo.linear_w8a8(x, wq, scales)
    assert got.dtype == np.float32 and got.shape == (m, n)
    assert (np.abs(got - ref) <= 3 * U * np.abs(ref)).all()


# --------------------------------------------------------------------------- #
# both schemes
# --------------------------------------------------------------------------- #

LINEARS = [qo.linear_int8, qo.linear_w8a8]


@pytest.mark.parametrize("linear", LINEARS)
@pytest.mark.parametrize("m", [3, 130])
def test_bias_is_added(linear, m):
    x, wq, scales = int8_operands(m, seed=3)
    bias = np.linspace(-2, 2, N, dtype=np.float32)
    assert np.array_equal(linear(x, wq, scales, bias), linear(x, wq, scales) + bias)


@pytest.mark.parametrize("linear", LINEARS)
@pytest.mark.parametrize("m", [3, 130])
@pytest.mark.parametrize("n", CHANNELS)
def test_parallel_path_equals_the_serial_one(linear, m, n, loop_order, monkeypatch):
    """Each output is computed by the same tile whichever thread runs it."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs 2 Numba threads")
    x, wq, scales = int8_operands(m, seed=4, n=n)
    before = numba.get_num_threads()
    try:
        serial = linear(x, wq, scales, num_threads=1)
        monkeypatch.setattr(cpu_parallel, "PARALLEL_MIN_MACS", 0)
        parallel = linear(x, wq, scales, num_threads=2)
    finally:
        numba.set_num_threads(before)
    assert np.array_equal(parallel, serial)


@pytest.mark.parametrize("linear", LINEARS)
@pytest.mark.parametrize("m,k,n", [(0, K, N), (3, 0, N), (3, K, 0)])
def test_empty_dimensions(linear, m, k, n):
    x, wq, scales = int8_operands(m, k=k, n=n)
    got = linear(x, wq, scales)
    assert got.shape == (m, n) and not got.any()


def _bad_argument_cases():
    """(argument name, change to the good arguments) pairs."""
    x, wq, scales = int8_operands(2)
    return [
        ("x", dict(x=x.astype(np.float64))),
        ("x", dict(x=x[0])),
        ("x", dict(x=np.asfortranarray(x))),
        ("x", dict(x=x.tolist())),
        ("wq", dict(wq=wq.astype(np.float32))),
        ("wq", dict(wq=wq[:, :-1].copy())),
        ("scales", dict(scales=scales.astype(np.float64))),
        ("scales", dict(scales=scales[:-1])),
        ("bias", dict(bias=np.zeros(N + 1, np.float32))),
        ("bias", dict(bias=np.zeros(N, np.float64))),
        ("num_threads", dict(num_threads=0)),
        ("num_threads", dict(num_threads=numba.config.NUMBA_NUM_THREADS + 1)),
        ("num_threads", dict(num_threads=1.0)),
    ]


@pytest.mark.parametrize("linear", LINEARS)
@pytest.mark.parametrize("name,change", _bad_argument_cases(),
                         ids=[f"{n}-{i}" for i, (n, _) in enumerate(_bad_argument_cases())])
def test_bad_arguments_are_refused_naming_them(linear, name, change):
    x, wq, scales = int8_operands(2)
    args = dict(x=x, wq=wq, scales=scales, bias=None, num_threads=None) | change
    with pytest.raises(ValueError, match=rf"^{name}:"):
        linear(**args)


@pytest.mark.parametrize("x", [np.zeros((2, 3)), np.zeros(3, np.float32),
                               np.zeros((3, 2), np.float32).T], ids=["float64", "1-D", "strided"])
def test_quantize_activations_refuses_other_than_float32_rows(x):
    with pytest.raises(ValueError, match=r"^x:"):
        qo.quantize_activations(x)


def test_w8a8_accumulate_refuses_float_activations_and_overflowing_k():
    with pytest.raises(ValueError, match=r"^xq:"):
        qo.w8a8_accumulate(np.zeros((1, 4), np.float32), np.zeros((1, 4), np.int8))
    k = qk.W8A8_MAX_K + 1
    with pytest.raises(ValueError, match=r"^xq: K = .* exceeds"):
        qo.w8a8_accumulate(np.zeros((1, k), np.int8), np.zeros((1, k), np.int8))
