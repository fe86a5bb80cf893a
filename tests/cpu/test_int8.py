"""The CPU W8A8 kernels (``kvserve.cpu.int8``) against NumPy references
(weight-only int8: ``test_quant_kernels.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.cpu import int8
from kvserve.model.quantization import quantize_int8

ROWS = [1, 3, 8, 9, 64]


def operands(m, k=128, n=37, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    qweight, scales = quantize_int8(rng.standard_normal((n, k)).astype(np.float32))
    return x, qweight, scales


def test_activation_quantization_round_trip_within_half_a_step():
    x, _, _ = operands(6, k=128)
    xq, xs = int8.quantize_activations(x, 64)
    assert xs.shape == (6, 2) and np.abs(xq).max() <= 127
    back = xq.astype(np.float32) * np.repeat(xs, 64, axis=1)
    assert (np.abs(back - x) <= np.repeat(xs, 64, axis=1) / 2 * (1 + 1e-6)).all()


def test_w8a8_integer_accumulation_is_exact():
    """With unit activation scales and one group, the kernel's output is the
    int32 product itself (sums below 2**24, so float32 holds them exactly)."""
    rng = np.random.default_rng(2)
    xq = rng.integers(-127, 128, (7, 40)).astype(np.int8)
    qweight = rng.integers(-127, 128, (13, 40)).astype(np.int8)
    got = int8.w8a8_accumulate(xq, np.ones((7, 1), np.float32), qweight, 40)
    assert np.array_equal(got, xq.astype(np.int64) @ qweight.T.astype(np.int64))


@pytest.mark.parametrize("m", ROWS)
def test_w8a8_equals_the_product_of_its_quantized_operands(m):
    x, qweight, scales = operands(m, seed=m)
    xq, xs = int8.quantize_activations(x, int8.group_size(x.shape[1]))
    deq_x = xq.astype(np.float64) * np.repeat(xs, int8.GROUP, axis=1)
    ref = (deq_x @ qweight.T.astype(np.float64)) * scales
    bias = np.linspace(-1, 1, qweight.shape[0]).astype(np.float32)
    got = int8.linear_w8a8(x, qweight, scales, bias) - bias
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


def test_bad_operands_are_refused_naming_the_argument():
    x, qweight, scales = operands(2)
    with pytest.raises(ValueError, match="x must be"):
        int8.linear_w8a8(x.astype(np.float64), qweight, scales)
    with pytest.raises(ValueError, match="qweight must be"):
        int8.linear_w8a8(x, qweight.astype(np.int16), scales)
    with pytest.raises(ValueError, match="scales must be"):
        int8.linear_w8a8(x, qweight, scales[:-1])
    with pytest.raises(ValueError, match="do not match"):
        int8.linear_w8a8(x[:, :-1].copy(), qweight, scales)
    with pytest.raises(ValueError, match="x must be"):
        int8.linear_w8a8(np.asfortranarray(x), qweight, scales)
