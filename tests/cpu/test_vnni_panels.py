"""The 16-channel q4 x Q8 panels (``kvserve.cpu.vnni_kernels``) against the
float64 NumPy reference of ``test_block_dot`` (integer block sums in int64,
written from llama.cpp's formulas, not from the kernels).

Both dot products run on every machine: the generic one always, the
``vpdpbusd`` one where the CPU has AVX512-VNNI (elsewhere the same call
builds the generic one, so the test checks that fallback instead). Row
counts cover the 4-row tile and every remainder; the weights come from
gguf-py's quantizer, so the nibble layout is llama.cpp's.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_block_dot import activations, reference, weight

from kvserve.cpu import block_dot_ops as bdo
from kvserve.cpu import vnni_kernels as vk
from kvserve.cpu.block_dot_ops import quantize_activations_q8

N = 3 * vk.LANES


@pytest.mark.parametrize("generic", [True, False])
@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("k", [32, 576])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 17])
def test_panel_equals_integer_reference(generic, ggml_type, k, m):
    w, codes, _ = weight(ggml_type, N, k, seed=k + 1)
    x = activations(m, k, seed=m + 3)
    ref, bound = reference(x, ggml_type, w, codes)
    xq, xd, xsum = quantize_activations_q8(x)
    packed, dpm = bdo.panels_of(w)
    out = np.full((m, N), np.nan, np.float32)
    # channels 16 .. 47 only: the first panel must stay untouched
    vk.panel_q8_range(xq, xd, xsum, packed, dpm, out, vk.LANES, N, generic)
    assert np.isnan(out[:, :vk.LANES]).all()
    got = out[:, vk.LANES:]
    err = np.abs(got - ref[:, vk.LANES:])
    assert (err <= bound[:, vk.LANES:]).all(), float((err / bound[:, vk.LANES:]).max())


def test_pack_layout():
    """Byte (b * 4 + g) * 64 + 4 c + t of panel G holds codes 4 g + t (low
    nibble) and 16 + 4 g + t (high) of block b of channel 16 G + c; the
    scales follow per block, d then m."""
    n, nb = 2 * vk.LANES, 3
    w, codes, _ = weight("Q4_1", n, 32 * nb, seed=5)
    packed, dpm = bdo.panels_of(w)
    assert packed.shape == (2, nb * 256) and dpm.shape == (2, nb * 32)
    grouped = packed.reshape(2, nb, 4, vk.LANES, 4).astype(np.int64)
    blocks = codes.reshape(2, vk.LANES, nb, 2, 4, 4)  # G, c, b, half, g, t
    np.testing.assert_array_equal(grouped & 15, blocks[:, :, :, 0].transpose(0, 2, 3, 1, 4))
    np.testing.assert_array_equal(grouped >> 4, blocks[:, :, :, 1].transpose(0, 2, 3, 1, 4))
    scales = dpm.reshape(2, nb, 2, vk.LANES)
    np.testing.assert_array_equal(scales[:, :, 0], w.d.reshape(2, vk.LANES, nb).transpose(0, 2, 1))
    np.testing.assert_array_equal(scales[:, :, 1], w.m.reshape(2, vk.LANES, nb).transpose(0, 2, 1))
    assert bdo.panels_of(w)[0] is packed  # packed once per weight


@pytest.mark.parametrize("m", [1, 33])
def test_linear_takes_panels_from_the_threshold(m, monkeypatch):
    """``linear_blocks_q8`` routes products to the panels on a VNNI CPU
    (forced here, so the route is checked everywhere: off VNNI the panels
    build the generic dot product), serial or in parallel chunks of whole
    panels, and equals the reference."""
    monkeypatch.setattr(vk, "HAS_VNNI", True)
    w, codes, _ = weight("Q4_1", 6 * vk.LANES, 576, seed=9)
    x = activations(m, 576, seed=m)
    calls = []
    real = bdo.panels_of
    monkeypatch.setattr(bdo, "panels_of", lambda w: (calls.append(w), real(w))[1])
    y = bdo.linear_blocks_q8(x, w, num_threads=2)
    assert calls == [w]
    ref, bound = reference(x, "Q4_1", w, codes)
    assert (np.abs(y - ref) <= bound).all()
    odd = weight("Q4_1", vk.LANES + 4, 64, seed=1)[0]
    assert not bdo.uses_panels(odd, 64)  # N not a multiple of 16: per-row kernels


@pytest.mark.parametrize("generic", [True, False])
@pytest.mark.parametrize("m", [1, 3, 6])
def test_q8_0_panel_equals_integer_reference(generic, m):
    """A Q8_0 weight (the LM head) through the panels, codes offset by 128
    and the offset taken back by ``m = -128 d``: the exact block sums,
    within the float32 rounding of both terms (the offset's included)."""
    k = 576
    w, codes, _ = weight("Q8_0", N, k, seed=11)
    x = activations(m, k, seed=m + 7)
    ref, bound = reference(x, "Q8_0", w, codes)
    xq, xd, xsum = quantize_activations_q8(x)
    packed, dpm = bdo.panels_of(w)
    assert packed.shape == (N // vk.LANES, k // 32 * 512)
    out = np.empty((m, N), np.float32)
    vk.panel_q8_range(xq, xd, xsum, packed, dpm, out, 0, N, generic)
    nb = k // 32
    offset_terms = (128 * np.abs(w.d[None].astype(np.float64) * xd[:, None])
                    * np.abs(xq.astype(np.float64)).reshape(m, 1, nb, 32).sum(axis=3))
    err = np.abs(out - ref)
    assert (err <= bound + (nb + 4) * 2.0**-24 * 4 * offset_terms.sum(axis=2)).all()
    assert err.max() > 0 or m == 1  # a real product, not a copy of the reference
