"""The CPU products on GGUF blocks (``kvserve.cpu.block_ops`` over
``kvserve.cpu.block_kernels``) against dequantize-then-matmul in float64,
with the dequantization done by ``gguf-py`` (llama.cpp's Python reference).

Both paths run: the panel kernel (M <= GEMV_MAX_ROWS, lowered to 8 here) and
dequantized panels + sgemm (more rows, with a panel smaller than N so that several run),
serially and on Numba's threads; N is not a multiple of the 4-channel panel.
"""

from __future__ import annotations

import gguf
import numba
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from kvserve.cpu import block_ops as bo
from kvserve.cpu.ops import CpuOps
from kvserve.model import ggml_blocks as gb

ROWS = [1, 3, 8, 9, 40]
N, K = 4 * 9 + 3, 96
U = 2.0**-24


def operands(ggml_type: str, m: int, n: int = N, k: int = K, seed: int = 0):
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[ggml_type]
    raw = gguf_quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    weight = gb.from_gguf_bytes(raw, ggml_type, (n, k))
    dense = gguf_dequantize(raw, qtype).reshape(n, k).astype(np.float64)
    x = rng.standard_normal((m, k)).astype(np.float32)
    return x, weight, dense


def assert_close(y, x, dense, bias=None):
    """Within the float32 summation bound (K + 2) u |x| |W|^T of the exact product."""
    ref = x.astype(np.float64) @ dense.T
    if bias is not None:
        ref += bias
    bound = (K + 2) * U * (np.abs(x).astype(np.float64) @ np.abs(dense).T) + 1e-30
    assert y.dtype == np.float32 and y.shape == ref.shape
    assert (np.abs(y - ref) <= bound).all(), float((np.abs(y - ref) / bound).max())


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", ROWS)
def test_linear_equals_dequantize_then_matmul(ggml_type, m, monkeypatch):
    monkeypatch.setattr(bo, "GEMV_MAX_ROWS", 8)  # 9 and 40 rows: the prefill path
    monkeypatch.setattr(bo, "PREFILL_PANEL_FLOATS", 8 * K)  # several prefill panels
    x, weight, dense = operands(ggml_type, m, seed=m)
    bias = np.linspace(-1, 1, N).astype(np.float32)
    assert_close(bo.linear_blocks(x, weight, num_threads=1), x, dense)
    assert_close(bo.linear_blocks(x, weight, bias, num_threads=1), x, dense, bias)


@pytest.mark.parametrize("ggml_type", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 40])
def test_parallel_paths(ggml_type, m, monkeypatch):
    """Numba's threads split the channels into ranges of whole panels."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.fail("needs NUMBA_NUM_THREADS >= 2 to run the parallel kernels")
    monkeypatch.setattr(bo, "parallel_chunks", lambda shape, n, threads: 2)
    monkeypatch.setattr(bo, "GEMV_MAX_ROWS", 8)
    monkeypatch.setattr(bo, "PREFILL_PANEL_FLOATS", 8 * K)
    x, weight, dense = operands(ggml_type, m, n=4 * 5 + 1, seed=7)
    assert_close(bo.linear_blocks(x, weight), x, dense)


def test_embedding_rows():
    _, weight, dense = operands("Q8_0", 1)
    ids = np.array([3, 0, N - 1, 3], dtype=np.int64)
    np.testing.assert_array_equal(bo.embedding_blocks(ids, weight), dense[ids].astype(np.float32))
    np.testing.assert_array_equal(CpuOps(num_threads=1).embedding(ids, weight),
                                  dense[ids].astype(np.float32))
    with pytest.raises(ValueError, match="token ids"):
        bo.embedding_blocks(np.array([N]), weight)


def test_cpu_ops_linear_dispatches_blocks():
    x, weight, dense = operands("Q4_1", 2)
    assert_close(CpuOps(num_threads=1).linear(x, weight), x, dense)


def test_bad_operands():
    x, weight, _ = operands("Q4_1", 2)
    with pytest.raises(ValueError, match="x: .* does not match"):
        bo.linear_blocks(x[:, :64].copy(), weight)
    with pytest.raises(ValueError, match="x: expected a C-contiguous float32"):
        bo.linear_blocks(x.astype(np.float64), weight)
    with pytest.raises(ValueError, match="bias: shape"):
        bo.linear_blocks(x, weight, np.zeros(N + 1, np.float32))
    with pytest.raises(ValueError, match="w.m: expected"):
        bo.linear_blocks(x, weight.map(lambda a: a.astype(np.float64) if a.dtype == np.float32
                                       and a is weight.m else a))
    with pytest.raises(ValueError, match="w.qs: shape"):
        bo.linear_blocks(x, gb.BlockQuantizedWeight("q4", weight.qs[:, :-2].copy(), weight.d,
                                                    weight.m, "Q4_1"))
