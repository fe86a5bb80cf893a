"""An int8 KV cache (``--kv-cache-dtype int8``) in the offload tier: a block
moves as stored, codes and scales byte for byte, and a tier made for one
cache dtype refuses an engine of the other (``kvserve.model.kv_quant``)."""

import numpy as np
import pytest
from test_kv_connector import output

from kvserve.config import CacheConfig
from kvserve.core.kv_transfer import BlockTransfer
from kvserve.cpu.ops import CpuOps
from kvserve.kv_offload.kv_connector import KVLayout, build_kv_connector
from kvserve.model import kv_quant

LAYERS, BLOCKS, BS, NKV, HD = 2, 5, 4, 2, 8


def int8_caches(seed: int) -> list[np.ndarray]:
    """Per layer, int8 [BLOCKS, 2, BS, NKV, HD + 4]: random K/V quantized by
    the reference (distinct scales in every vector)."""
    rng = np.random.default_rng(seed)
    return [kv_quant.quantize(rng.standard_normal((BLOCKS, 2, BS, NKV, HD)).astype(np.float32))
            for _ in range(LAYERS)]


def h(i):
    return bytes([i]) * 32


@pytest.fixture
def tier_dir(tmp_path, monkeypatch):
    monkeypatch.setattr("kvserve.kv_offload.host_tier.default_directory", lambda: tmp_path)
    return tmp_path


def test_int8_blocks_round_trip_through_the_tier_with_their_scales(tier_dir):
    kv = int8_caches(0)
    layout = KVLayout.of(kv, "test-model")
    assert layout.dtype == "|i1" and layout.block_shape == (LAYERS, 2, BS, NKV, HD + 4)
    block_bytes = LAYERS * 2 * BS * NKV * (HD + 4)
    connector = build_kv_connector(CpuOps(), layout,
                                   CacheConfig(kv_offloading_size=3 * block_bytes / 2**30))
    try:
        assert connector.tier.slot_bytes >= block_bytes and connector.tier.num_slots == 3
        saved = [layer[[1, 3]].copy() for layer in kv]
        connector.run(kv, output(saves=[BlockTransfer("", 1, h(1)), BlockTransfer("", 3, h(3))]))
        connector.run(kv, output(loads=[BlockTransfer("r", 0, h(1)), BlockTransfer("r", 4, h(3))]))
        for layer, before in zip(kv, saved):
            np.testing.assert_array_equal(layer[0], before[0])
            np.testing.assert_array_equal(layer[4], before[1])
            np.testing.assert_array_equal(kv_quant.scales(layer[4]), kv_quant.scales(before[1]))
    finally:
        connector.close()


def test_a_tier_of_one_cache_dtype_refuses_the_other(tier_dir):
    float_caches = [np.zeros((BLOCKS, 2, BS, NKV, HD), np.float32) for _ in range(LAYERS)]
    float_layout = KVLayout.of(float_caches, "test-model")
    connector = build_kv_connector(CpuOps(), float_layout,
                                   CacheConfig(kv_offloading_size=1 / 1024))
    try:
        int8_layout = KVLayout.of(int8_caches(1), "test-model")
        with pytest.raises(ValueError, match="holds blocks of shape, dtype and model"):
            int8_layout.attach_tier(str(connector.tier.path))
    finally:
        connector.close()
