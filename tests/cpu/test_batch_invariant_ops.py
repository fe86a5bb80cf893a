"""``CpuOps(batch_invariant=True)``: a product's row does not depend on the
other rows, at any row count (the per-row kernels replace BLAS and the
2-row tile), for float32 weights and GGUF blocks; and the configurations
that cannot be batch-invariant are refused."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import quantize as gguf_quantize

from kvserve.config import EngineConfig
from kvserve.cpu.ops import CpuOps
from kvserve.model.ggml_blocks import from_gguf_bytes
from kvserve.model.quantization import QuantizedWeight

ROWS = (1, 2, 3, 12, 13, 64, 300)  # 300: past block_ops.GEMV_MAX_ROWS


def _weights(rng):
    dense = rng.standard_normal((72, 96), dtype=np.float32)
    out = {"dense": dense}
    for kind in ("Q4_1", "Q4_0", "Q8_0"):
        raw = gguf_quantize(dense, gguf.GGMLQuantizationType[kind])
        out[kind] = from_gguf_bytes(np.asarray(raw).reshape(-1), kind, dense.shape)
    return out


@pytest.mark.parametrize("form", ["dense", "Q4_1", "Q4_0", "Q8_0"])
def test_each_row_is_the_row_alone(form):
    rng = np.random.default_rng(3)
    w = _weights(rng)[form]
    x = rng.standard_normal((max(ROWS), 96), dtype=np.float32)
    ops = CpuOps(num_threads=2, batch_invariant=True)
    alone = np.concatenate([ops.linear(x[i:i + 1], w) for i in range(len(x))])
    for m in ROWS:
        assert np.array_equal(ops.linear(x[:m], w), alone[:m]), m
        # and not by accident of a zero bias or layout: a row in the middle
        assert np.array_equal(ops.linear(x[m // 2:m], w), alone[m // 2:m]), m
    # the same values as the default kernels, to rounding
    ref = CpuOps(num_threads=2).linear(x, w)
    np.testing.assert_allclose(alone, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_int8_weights_are_refused():
    ops = CpuOps(num_threads=1, batch_invariant=True)
    w = QuantizedWeight(np.ones((8, 32), np.int8), np.ones(8, np.float32), "int8")
    with pytest.raises(ValueError, match="batch-invariant"):
        ops.linear(np.ones((1, 32), np.float32), w)


@pytest.mark.parametrize("kwargs", [dict(quantization="int8"), dict(quantization="w8a8"),
                                    dict(quantization="w4a8"), dict(backend="cuda")])
def test_configurations_without_invariant_kernels_are_refused(kwargs):
    with pytest.raises(ValueError, match="--batch-invariant"):
        EngineConfig(model="m", batch_invariant=True, **kwargs)


def test_w4a8_is_a_cpu_scheme():
    with pytest.raises(ValueError, match="w4a8"):
        EngineConfig(model="m", backend="cuda", quantization="w4a8")
