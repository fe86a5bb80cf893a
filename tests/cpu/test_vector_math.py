"""``vector_math.exp_f32`` against float64 ``np.exp``: accuracy over float32's
range, the underflow to exactly 0 (exp(-inf) = 0, which the online softmax
needs), the clamp at the top, and the same bits whether a loop runs it
packed or one element at a time."""

from __future__ import annotations

import numpy as np

from kvserve.cpu.vector_math import EXP_OVERFLOW, EXP_UNDERFLOW, exp_f32_array


def _exp(x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    exp_f32_array(x, out)
    return out


def test_relative_error_is_under_2_to_the_minus_22_over_the_whole_range() -> None:
    x = np.concatenate([np.linspace(EXP_UNDERFLOW + 1e-3, EXP_OVERFLOW, 400_001),
                        np.linspace(-1.0, 1.0, 100_001),  # where softmax lives most
                        [0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30]]).astype(np.float32)
    ref = np.exp(x.astype(np.float64))
    rel = np.abs(_exp(x).astype(np.float64) - ref) / ref
    assert rel.max() < 2.0**-22
    assert _exp(np.float32([0.0]))[0] == 1.0


def test_underflow_is_zero_and_the_top_is_clamped() -> None:
    x = np.float32([-np.inf, -1e30, -100.0, EXP_UNDERFLOW, 88.0, 89.0, 1e30, np.inf])
    got = _exp(x)
    assert (got[:4] == 0.0).all()
    top = np.float32(np.exp(np.float64(EXP_OVERFLOW)))
    assert np.isfinite(got[4:]).all()
    np.testing.assert_allclose(got[4:], top, rtol=2.0**-22)


def test_packed_and_scalar_loops_give_the_same_bits() -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(1_031) * 20).astype(np.float32)
    packed = _exp(x)
    for n in (1, 2, 3, 5, 7):  # shorter than a vector: the scalar remainder
        for i in range(0, 64):
            assert (_exp(x[i:i + n].copy()).view(np.int32) == packed[i:i + n].view(np.int32)).all()
