"""The block-weight x Q8 panels (``kvserve.cpu.panel_kernels``) against the
float64 NumPy reference of ``test_block_dot`` (integer block sums in int64,
written from llama.cpp's formulas, not from the kernels).

Every form of the dot product runs where the CPU has it: the generic one
always, the AVX2 one (``vpmaddubsw``) wherever AVX2 exists, VNNI CPUs
included, and the fastest (``vpdpbusd`` with AVX512-VNNI); where one is
missing the call builds the generic one, and Q8_0 weights take the generic
one for the AVX2 form. The panel width is the CPU's (``LANES``). Row
counts cover the 4-row tile and every remainder; the weights come from
gguf-py's quantizer, so the nibble layout is llama.cpp's.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_block_dot import activations, reference, weight

from kvserve.cpu import block_dot_ops as bdo
from kvserve.cpu import panel_kernels as pk
from kvserve.cpu.block_dot_ops import quantize_activations_q8

N = 3 * pk.LANES


DOTS = [pk.DOT_FAST, pk.DOT_GENERIC, pk.DOT_AVX2]


@pytest.mark.parametrize("dot", DOTS, ids=["fast", "generic", "avx2"])
@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("k", [32, 576])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 17])
def test_panel_equals_integer_reference(dot, ggml_type, k, m):
    w, codes, _ = weight(ggml_type, N, k, seed=k + 1)
    x = activations(m, k, seed=m + 3)
    ref, bound = reference(x, ggml_type, w, codes)
    xq, xd, xsum = quantize_activations_q8(x)
    packed, dpm = bdo.panels_of(w)
    out = np.full((m, N), np.nan, np.float32)
    # channels 16 .. 47 only: the first panel must stay untouched
    pk.panel_q8_range(xq, xd, xsum, packed, dpm, out, pk.LANES, N, dot)
    assert np.isnan(out[:, :pk.LANES]).all()
    got = out[:, pk.LANES:]
    err = np.abs(got - ref[:, pk.LANES:])
    assert (err <= bound[:, pk.LANES:]).all(), float((err / bound[:, pk.LANES:]).max())


def test_pack_layout():
    """Byte (b * 4 + g) * 4 L + 4 c + t of panel G holds codes 4 g + t (low
    nibble) and 16 + 4 g + t (high) of block b of channel L G + c (L =
    ``LANES``); the scales follow per block, d then m."""
    n, nb = 2 * pk.LANES, 3
    w, codes, _ = weight("Q4_1", n, 32 * nb, seed=5)
    packed, dpm = bdo.panels_of(w)
    assert packed.shape == (2, nb * pk.PANEL_BLOCK_BYTES) and dpm.shape == (2, nb * 2 * pk.LANES)
    grouped = packed.reshape(2, nb, 4, pk.LANES, 4).astype(np.int64)
    blocks = codes.reshape(2, pk.LANES, nb, 2, 4, 4)  # G, c, b, half, g, t
    np.testing.assert_array_equal(grouped & 15, blocks[:, :, :, 0].transpose(0, 2, 3, 1, 4))
    np.testing.assert_array_equal(grouped >> 4, blocks[:, :, :, 1].transpose(0, 2, 3, 1, 4))
    scales = dpm.reshape(2, nb, 2, pk.LANES)
    np.testing.assert_array_equal(scales[:, :, 0], w.d.reshape(2, pk.LANES, nb).transpose(0, 2, 1))
    np.testing.assert_array_equal(scales[:, :, 1], w.m.reshape(2, pk.LANES, nb).transpose(0, 2, 1))
    assert bdo.panels_of(w)[0] is packed  # packed once per weight


@pytest.mark.parametrize("m", [1, 33])
def test_linear_takes_panels_from_the_threshold(m, monkeypatch):
    """``linear_blocks_q8`` routes products to the panels on a CPU with
    their dot product (forced here, so the route is checked everywhere:
    without AVX2 the panels build the generic dot product), serial or in
    parallel chunks of whole panels, and equals the reference."""
    monkeypatch.setattr(pk, "HAS_PANELS", True)
    w, codes, _ = weight("Q4_1", 6 * pk.LANES, 576, seed=9)
    x = activations(m, 576, seed=m)
    calls = []
    real = bdo.panels_of
    monkeypatch.setattr(bdo, "panels_of", lambda w: (calls.append(w), real(w))[1])
    y = bdo.linear_blocks_q8(x, w, num_threads=2)
    assert calls == [w]
    ref, bound = reference(x, "Q4_1", w, codes)
    assert (np.abs(y - ref) <= bound).all()
    odd = weight("Q4_1", pk.LANES + 4, 64, seed=1)[0]
    assert not bdo.uses_panels(odd, 64)  # N not a multiple of LANES: per-row kernels


@pytest.mark.parametrize("dot", DOTS, ids=["fast", "generic", "avx2"])
@pytest.mark.parametrize("m", [1, 3, 6])
def test_q8_0_panel_equals_integer_reference(dot, m):
    """A Q8_0 weight (the LM head) through the panels, codes offset by 128
    and the offset taken back by ``m = -128 d``: the exact block sums,
    within the float32 rounding of both terms (the offset's included)."""
    k = 576
    w, codes, _ = weight("Q8_0", N, k, seed=11)
    x = activations(m, k, seed=m + 7)
    ref, bound = reference(x, "Q8_0", w, codes)
    xq, xd, xsum = quantize_activations_q8(x)
    packed, dpm = bdo.panels_of(w)
    assert packed.shape == (N // pk.LANES, k // 32 * 2 * pk.PANEL_BLOCK_BYTES)
    out = np.empty((m, N), np.float32)
    pk.panel_q8_range(xq, xd, xsum, packed, dpm, out, 0, N, dot)
    nb = k // 32
    offset_terms = (128 * np.abs(w.d[None].astype(np.float64) * xd[:, None])
                    * np.abs(xq.astype(np.float64)).reshape(m, 1, nb, 32).sum(axis=3))
    err = np.abs(out - ref)
    assert (err <= bound + (nb + 4) * 2.0**-24 * 4 * offset_terms.sum(axis=2)).all()
    assert err.max() > 0 or m == 1  # a real product, not a copy of the reference
