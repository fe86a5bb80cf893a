"""GGUF block weights (``kvserve.model.ggml_blocks``) against ``gguf-py``'s own
quantize and dequantize (llama.cpp's reference implementation in Python),
which the code under test does not use."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from kvserve.model import ggml_blocks as gb
from kvserve.model.default_model import permute_qk, unpermute_qk

TYPES = ["Q4_0", "Q4_1", "Q8_0"]


def blocks(ggml_type: str, n: int = 12, k: int = 96, seed: int = 0):
    """(float weight, its GGUF bytes, gguf-py's dequantized float64 values)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[ggml_type]
    raw = gguf_quantize(w, qtype)
    return w, raw, gguf_dequantize(raw, qtype).reshape(n, k).astype(np.float64)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_dequantize_equals_gguf_reference(ggml_type):
    _, raw, ref = blocks(ggml_type)
    weight = gb.from_gguf_bytes(raw, ggml_type, ref.shape)
    assert weight.shape == ref.shape
    np.testing.assert_array_equal(gb.dequantize(weight), ref.astype(np.float32))


@pytest.mark.parametrize("ggml_type", TYPES)
def test_round_trip_error_within_the_block_scale(ggml_type):
    """Quantize-dequantize moves each weight by at most half a code step
    (|d| / 2, plus float16 rounding of d and m), Q4_0's lowest code aside:
    ggml maps the block's largest magnitude to -8, so the opposite extreme
    can land a full step short (clamped to +7)."""
    w, raw, _ = blocks(ggml_type, seed=1)
    weight = gb.from_gguf_bytes(raw, ggml_type, w.shape)
    err = np.abs(gb.dequantize(weight) - w).reshape(w.shape[0], -1, gb.QK)
    step = np.abs(weight.d)[:, :, None]
    bound = (1.0 if ggml_type == "Q4_0" else 0.5) * step + 1e-3 * np.abs(w).max()
    assert (err <= bound).all(), float((err - bound).max())
    assert err.max() > 0.1 * step.max()  # quantized, not passed through


def test_q4_codes_keep_the_file_bytes():
    """Q4 codes are the file's bytes, unchanged: byte j of a block holds
    channel j (low nibble) and j + 16 (high nibble)."""
    _, raw, _ = blocks("Q4_1", n=2, k=64)
    weight = gb.from_gguf_bytes(raw, "Q4_1", (2, 64))
    file_codes = raw.reshape(2, 2, 20)[:, :, 4:].reshape(2, 32)
    np.testing.assert_array_equal(weight.qs, file_codes)
    codes = gb.unpack_codes(weight)
    np.testing.assert_array_equal(codes[0, :16], file_codes[0, :16] & 15)
    np.testing.assert_array_equal(codes[0, 16:32], file_codes[0, :16] >> 4)


def test_weights_bytes():
    _, raw, _ = blocks("Q4_1", n=4, k=64)
    weight = gb.from_gguf_bytes(raw, "Q4_1", (4, 64))
    assert raw.size == 4 * 2 * 20  # the file: 20 bytes per 32 weights
    assert weight.nbytes == 4 * 2 * (16 + 4 + 4)  # codes + float32 d and m


def test_row_permutation_moves_whole_blocks():
    """Un-permuting Q/K rows of the blocks equals un-permuting the dense values."""
    _, raw, ref = blocks("Q4_1", n=16, k=64)
    weight = gb.from_gguf_bytes(raw, "Q4_1", (16, 64))
    moved = weight.map(lambda a: unpermute_qk(a, 2))
    np.testing.assert_array_equal(gb.dequantize(moved), unpermute_qk(ref, 2).astype(np.float32))
    back = moved.map(lambda a: permute_qk(a, 2))
    np.testing.assert_array_equal(back.qs, weight.qs)


def test_concat_rows_and_mixed_kinds():
    _, raw_a, ref_a = blocks("Q4_1", n=3, k=64, seed=2)
    _, raw_b, ref_b = blocks("Q4_0", n=5, k=64, seed=3)
    a = gb.from_gguf_bytes(raw_a, "Q4_1", (3, 64))
    b = gb.from_gguf_bytes(raw_b, "Q4_0", (5, 64))
    fused = gb.concat_rows([a, b])
    assert fused.shape == (8, 64)
    np.testing.assert_array_equal(gb.dequantize(fused),
                                  np.concatenate([ref_a, ref_b]).astype(np.float32))
    _, raw_c, _ = blocks("Q8_0", n=2, k=64)
    with pytest.raises(ValueError, match="different kinds"):
        gb.concat_rows([a, gb.from_gguf_bytes(raw_c, "Q8_0", (2, 64))])


def test_bad_bytes_and_types():
    _, raw, _ = blocks("Q4_1", n=2, k=64)
    with pytest.raises(ValueError, match="bytes, expected"):
        gb.from_gguf_bytes(raw[:-1], "Q4_1", (2, 64))
    with pytest.raises(ValueError, match="multiple of 32"):
        gb.from_gguf_bytes(raw, "Q4_1", (2, 60))
    with pytest.raises(ValueError, match="Q6_K is not a block type"):
        gb.from_gguf_bytes(raw, "Q6_K", (2, 64))
