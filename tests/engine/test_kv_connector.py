"""KVConnector on NumPy caches: saves, exports, loads from the tier and from
imports, in the step's order; a lost tier block fails the load."""

import numpy as np
import pytest

from kvserve.config import CacheConfig
from kvserve.core.kv_transfer import BlockTransfer
from kvserve.core.outputs import SchedulerOutput
from kvserve.cpu.ops import CpuOps
from kvserve.kv_offload.host_tier import BlockLost
from kvserve.kv_offload.kv_connector import KVLayout, build_kv_connector

LAYERS, BLOCKS, BS, NKV, HD = 3, 6, 4, 1, 2


def caches():
    """Layer l, block b holds the value 100 * l + b everywhere."""
    return [np.stack([np.full((2, BS, NKV, HD), 100 * layer + b, np.float32)
                      for b in range(BLOCKS)]) for layer in range(LAYERS)]


def h(i):
    return bytes([i]) * 32


def output(saves=(), exports=(), loads=(), finished=()):
    export_ids = tuple(dict.fromkeys(e.request_id for e in exports))
    return SchedulerOutput(
        step_id=0, scheduled=(), new_requests=(), finished_request_ids=tuple(finished),
        preemptions=(), rejected=(), num_batched_tokens=0, num_prefill_tokens=0,
        num_decode_tokens=0, first_scheduled_request_ids=(), prefix_cache_queries=0,
        prefix_cache_hits=0, kv_cache_usage=0.0, num_running=0, num_waiting=0,
        kv_saves=tuple(saves), kv_exports=tuple(exports), kv_export_ids=export_ids,
        kv_loads=tuple(loads))


@pytest.fixture
def connector(tmp_path, monkeypatch):
    monkeypatch.setattr("kvserve.kv_offload.host_tier.default_directory", lambda: tmp_path)
    block_bytes = LAYERS * 2 * BS * NKV * HD * 4
    config = CacheConfig(kv_offloading_size=4 * block_bytes / 2**30)
    c = build_kv_connector(CpuOps(), KVLayout.of(caches(), "test-model"), config)
    yield c
    c.close()


def test_saved_blocks_load_back_into_other_blocks(connector):
    kv = caches()
    assert connector.tier.num_slots == 4
    result = connector.run(kv, output(saves=[BlockTransfer("", 1, h(1)), BlockTransfer("", 2, h(2))]))
    assert result.stats.by_direction["offload"][:2] == [2, 2 * connector.tier.slot_bytes]
    assert connector.tier.lookup([h(1), h(2), h(3)]) == 2
    connector.run(kv, output(loads=[BlockTransfer("r", 4, h(1)), BlockTransfer("r", 5, h(2))]))
    for layer in range(LAYERS):
        assert (kv[layer][4] == 100 * layer + 1).all() and (kv[layer][5] == 100 * layer + 2).all()
        assert (kv[layer][0] == 100 * layer).all()  # untouched


def test_saves_run_before_loads_into_the_same_block(connector):
    kv = caches()
    connector.run(kv, output(saves=[BlockTransfer("", 3, h(3))]))
    # block 3 is evicted (saved as h(9)) and refilled with h(3)'s K/V in one step
    connector.run(kv, output(saves=[BlockTransfer("", 3, h(9))],
                             loads=[BlockTransfer("r", 3, h(3))]))
    connector.run(kv, output(loads=[BlockTransfer("q", 0, h(9))]))
    assert (kv[1][0] == 103).all() and (kv[1][3] == 103).all()


def test_blocks_of_a_failed_step_are_not_saved(connector):
    connector.poison([1])
    connector.run(caches(), output(saves=[BlockTransfer("", 1, h(1)), BlockTransfer("", 2, h(2))]))
    assert connector.tier.lookup([h(1)]) == 0 and connector.tier.lookup([h(2)]) == 1


def test_exports_gather_blocks_in_order_and_imports_load_them(connector):
    kv = caches()
    result = connector.run(kv, output(exports=[BlockTransfer("p", 5, h(5)),
                                               BlockTransfer("p", 0, h(0))]))
    exported = result.exports["p"]
    assert exported.block_hashes == (h(5), h(0))
    data = exported.data
    assert data.shape == (2, LAYERS, 2, BS, NKV, HD)
    assert data[0, 2].mean() == 205 and data[1, 2].mean() == 200
    other = [np.zeros_like(c) for c in caches()]
    connector.add_import("d", [h(5), h(0)], data)
    stats = connector.run(other, output(loads=[BlockTransfer("d", 1, h(5)),
                                               BlockTransfer("d", 2, h(0))])).stats
    assert stats.by_direction["import"][:2] == [2, data.nbytes]
    assert other[2][1].mean() == 205 and other[2][2].mean() == 200
    assert connector.num_imports == 0  # consumed


def test_an_import_loads_its_blocks_by_hash_when_some_were_cached(connector):
    exported = connector.run(caches(), output(exports=[BlockTransfer("p", 5, h(5)),
                                                       BlockTransfer("p", 1, h(1))])).exports["p"]
    other = [np.zeros_like(c) for c in caches()]
    connector.add_import("d", exported.block_hashes, exported.data)
    connector.run(other, output(loads=[BlockTransfer("d", 3, h(1))]))  # h(5) was cached there
    assert other[2][3].mean() == 201 and other[2][0].mean() == 0


def test_imports_of_finished_requests_are_dropped(connector):
    connector.add_import("gone", [h(1)], np.zeros((1, LAYERS, 2, BS, NKV, HD), np.float32))
    connector.run(caches(), output(finished=["gone"]))
    assert connector.num_imports == 0


def test_a_block_missing_from_the_tier_fails_the_load(connector):
    with pytest.raises(BlockLost):
        connector.run(caches(), output(loads=[BlockTransfer("r", 0, h(7))]))


def test_without_a_tier_no_connector_is_built_and_a_lazy_one_loads_only_imports():
    layout = KVLayout.of(caches(), "m")
    assert build_kv_connector(CpuOps(), layout, CacheConfig()) is None
    c = layout.connector(CpuOps())
    assert c.tier is None
    with pytest.raises(BlockLost, match="imported"):
        c.run(caches(), output(loads=[BlockTransfer("r", 0, h(1))]))
