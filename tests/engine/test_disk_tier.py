"""The disk KV tier (``kvserve.kv_offload.disk_tier``): blocks round-trip
byte for byte across a restart (float32, and int8 codes with their scales),
the size bound evicts the least recently used file, and a truncated, foreign,
other-layout or corrupt file is removed and never served, while another
layout's folder is left alone. Then the connector: write-through to disk,
loads of what the memory tier lacks from disk, and the scheduler's look-up
through both tiers."""

from __future__ import annotations

import os
import threading
import zlib

import numpy as np
import pytest

from kvserve.config import CacheConfig
from kvserve.core.kv_transfer import BlockTransfer
from kvserve.cpu.ops import CpuOps
from kvserve.kv_offload import disk_tier
from kvserve.kv_offload.disk_tier import HEADER_BYTES, DiskTier, layout_key
from kvserve.kv_offload.host_tier import BlockLost
from kvserve.kv_offload.kv_connector import KVLayout, TieredLookup, build_kv_connector
from kvserve.model.kv_quant import dequantize, quantize

LAYERS, BS, NKV, HD = 2, 4, 1, 8
SHAPE = (LAYERS, 2, BS, NKV, HD)
INT8_SHAPE = (LAYERS, 2, BS, NKV, HD + 4)
FILE_BYTES = HEADER_BYTES + int(np.prod(SHAPE)) * 4


def h(i: int) -> bytes:
    return bytes([i]) * 32


def block(i: int) -> np.ndarray:
    """A float32 block whose values depend on ``i``."""
    return (np.arange(np.prod(SHAPE), dtype=np.float64).reshape(SHAPE) * 0.25 + i).astype(
        np.float32)


def tier(path, shape=SHAPE, dtype=np.float32, fingerprint="model-a", blocks=8) -> DiskTier:
    file_bytes = HEADER_BYTES + int(np.prod(shape)) * np.dtype(dtype).itemsize
    return DiskTier(path, shape, dtype, fingerprint, blocks * file_bytes)


@pytest.fixture
def opened():
    tiers = []

    def make(*args, **kwargs):
        t = tier(*args, **kwargs)
        tiers.append(t)
        return t
    yield make
    for t in tiers:
        t.close()


def test_float_blocks_round_trip_across_a_restart(tmp_path, opened):
    first = opened(tmp_path)
    for i in range(3):
        first.write(h(i), block(i))
    first.close()
    again = opened(tmp_path)
    assert again.scan_report.blocks == 3 and again.scan_report.removed == {}
    assert again.lookup([h(0), h(1), h(2), h(3)]) == 3
    for i in range(3):
        assert again.read(h(i)).tobytes() == block(i).tobytes()


def test_int8_blocks_keep_their_codes_and_scales(tmp_path, opened):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(SHAPE).astype(np.float32)
    stored = quantize(x)  # the NumPy reference of the int8 format
    assert stored.shape == INT8_SHAPE and stored.dtype == np.int8
    t = opened(tmp_path, INT8_SHAPE, np.int8)
    t.write(h(7), stored)
    back = opened(tmp_path, INT8_SHAPE, np.int8).read(h(7))
    assert back.dtype == np.int8 and np.array_equal(back, stored)
    assert np.array_equal(dequantize(back), dequantize(stored))
    # a float32 tier of the same model is another layout, in another folder
    assert opened(tmp_path).lookup([h(7)]) == 0


def test_the_layout_key_covers_fingerprint_dtype_and_shape():
    base = layout_key(SHAPE, np.float32, "m")
    assert base == layout_key(list(SHAPE), "<f4", "m")
    others = [layout_key(SHAPE, np.float16, "m"), layout_key(SHAPE, np.float32, "n"),
              layout_key((LAYERS, 2, 2 * BS, NKV, HD), np.float32, "m")]
    assert len({base, *others}) == 4


def test_the_least_recently_used_file_goes_first(tmp_path, opened):
    t = opened(tmp_path, blocks=3)
    for i in range(3):
        t.write(h(i), block(i))
    t.read(h(0))  # a read is a use: 1 is now the least recently used
    t.write(h(3), block(3))
    assert not t.path_of(h(1)).exists()
    assert [t.lookup([h(i)], lease_seconds=-1) for i in range(4)] == [1, 0, 1, 1]
    t.write(h(4), block(4))  # the look-ups (no lease) used 0, 2, 3 in that order: 0 goes
    assert sorted(p.name for p in t.folder.glob("*.kv")) == sorted(
        f"{h(i).hex()}.kv" for i in (2, 3, 4))
    assert t.counters.evicted == 2


def test_a_leased_block_is_not_evicted(tmp_path, opened):
    t = opened(tmp_path, blocks=2)
    t.write(h(0), block(0))
    t.write(h(1), block(1))
    assert t.lookup([h(0)]) == 1
    t.lookup([h(1)])  # 0 is the least recently used, but leased
    t._leases.pop(h(1))
    t.write(h(2), block(2))
    assert t.path_of(h(0)).exists() and not t.path_of(h(1)).exists()


def test_a_smaller_tier_never_evicts_a_live_tiers_files(tmp_path, opened):
    """Issue 47 item 10: two servers share a folder; the one with the smaller
    bound started second (its scan finds the first's files) and writes past
    its bound: it evicts only its own files, and serves the first's."""
    big = opened(tmp_path, blocks=20)
    for i in range(12):
        big.write(h(i), block(i))
    small = opened(tmp_path, blocks=3)
    assert small.lookup([h(i) for i in range(12)], lease_seconds=-1) == 12  # indexed, served
    for i in range(100, 110):
        small.write(h(i), block(i))
        if i % 4 == 0:
            small.rescan()
    for i in range(12):
        assert big.read(h(i)).tobytes() == block(i).tobytes()
    assert small.read(h(5)).tobytes() == block(5).tobytes()
    own = [i for i in range(100, 110) if small.path_of(h(i)).exists()]
    assert own == [107, 108, 109]  # its bound, least recently used out first
    big.rescan()  # the big one sees the small one's files as foreign too
    assert big.lookup([h(109)], lease_seconds=-1) == 1
    for i in range(12, 40):
        big.write(h(i), block(i))
    assert all(small.path_of(h(i)).exists() for i in own)
    assert sum(big.path_of(h(i)).exists() for i in range(40)) == 20


def test_a_stopped_tiers_files_are_adopted_and_bounded(tmp_path, opened):
    first = tier(tmp_path, blocks=10)
    for i in range(10):
        first.write(h(i), block(i))
    first.close()  # gone: its files belong to whoever scans them next
    later = opened(tmp_path, blocks=4)
    assert later.scan_report.blocks == 4
    assert later.scan_report.removed == {"over_size": 6}
    assert not list(tmp_path.glob("*/.owner-*"))[1:]  # only the live tier's lock


def _hold_a_tier_then_die(path: str, ready, go) -> None:
    t = tier(path, blocks=10)
    for i in range(10):
        t.write(h(i), block(i))
    ready.set()
    go.wait(60)
    os._exit(0)  # killed: no close, the kernel drops the lock


def test_a_killed_tiers_files_are_adopted_when_rescanned(tmp_path, opened):
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    ready, go = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold_a_tier_then_die, args=(str(tmp_path), ready, go))
    proc.start()
    assert ready.wait(120)
    small = opened(tmp_path, blocks=4)
    assert small.scan_report.blocks == 10  # alive: all foreign, none evicted
    small.write(h(50), block(50))
    assert sum(small.path_of(h(i)).exists() for i in range(10)) == 10
    go.set()
    proc.join(60)
    small.rescan()  # the owner died: its files are this tier's now, bounded
    assert sum(small.path_of(h(i)).exists() for i in (*range(10), 50)) == 4
    assert len(list(small.folder.glob(".owner-*.lock"))) == 1


def test_the_scan_removes_truncated_foreign_and_other_layout_files(tmp_path, opened):
    t = opened(tmp_path)
    for i in range(5):
        t.write(h(i), block(i))
    other = opened(tmp_path, fingerprint="model-b")
    other.write(h(0), block(0))
    t.close()
    other.close()
    with open(t.path_of(h(0)), "r+b") as f:  # truncated
        f.truncate(FILE_BYTES - 10)
    with open(t.path_of(h(1)), "r+b") as f:  # bad magic
        f.write(b"NOTKVSRV")
    t.path_of(h(2)).write_bytes(other.path_of(h(0)).read_bytes())  # other layout's header
    t.path_of(h(3)).rename(t.path_of(h(9)))  # a name that is not its hash
    (t.folder / "notes.txt").write_text("hello")
    (t.folder / ".tmp-999999999-abcd-" f"{h(5).hex()}").write_bytes(b"partial")

    again = opened(tmp_path)
    assert again.scan_report.blocks == 1
    assert again.scan_report.removed == {"truncated": 1, "foreign": 3, "other_layout": 1,
                                         "stale_temp": 1}
    assert [again.lookup([h(i)]) for i in (0, 1, 2, 3, 9)] == [0, 0, 0, 0, 0]
    assert again.lookup([h(4)]) == 1
    assert sorted(p.name for p in again.folder.iterdir()) == sorted(
        ["layout.json", f"{h(4).hex()}.kv", again.owner.path.name])  # the live tier's lock
    assert other.path_of(h(0)).exists()  # another layout's folder is not touched


def _corrupt_payload(path) -> None:
    """Flip one bit of the payload of the block file at ``path`` (its size and
    header stay valid)."""
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 5] ^= 0x40
    assert zlib.crc32(raw[HEADER_BYTES:]) != zlib.crc32(block(0).tobytes())
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("background", [False, True], ids=["at-open", "in-background"])
def test_the_start_up_check_removes_a_corrupt_payload_with_a_log_line(tmp_path, opened,
                                                                      background):
    from structlog.testing import capture_logs

    t = opened(tmp_path)
    for i in range(3):
        t.write(h(i), block(i))
    t.close()
    _corrupt_payload(t.path_of(h(1)))
    with capture_logs() as logs:
        again = DiskTier(tmp_path, SHAPE, np.float32, "model-a", 8 * FILE_BYTES,
                         verify_in_background=background)
        try:
            assert again.wait_verified(timeout=60)
            assert again.scan_report.removed == {"checksum": 1}
            assert again.scan_report.blocks == 2 and again.scan_report.unverified == 0
            assert [again.lookup([h(i)]) for i in range(3)] == [1, 0, 1]
            assert not again.path_of(h(1)).exists()
            assert again.read(h(2)).tobytes() == block(2).tobytes()
        finally:
            again.close()
    verified = [e for e in logs if e["event"] == "kv_offload_disk_verified"]
    assert len(verified) == (1 if background else 0)
    if background:
        assert verified[0]["removed"] == {"checksum": 1} and verified[0]["num_blocks"] == 2


def test_a_payload_corrupted_after_the_check_is_removed_on_read_and_never_served(tmp_path,
                                                                                opened):
    t = opened(tmp_path)
    t.write(h(0), block(0))
    t.write(h(1), block(1))
    t.close()
    again = opened(tmp_path)
    path = again.path_of(h(0))
    _corrupt_payload(path)
    assert again.lookup([h(0), h(1)]) == 2  # checked at start-up, corrupted since
    with pytest.raises(BlockLost, match="checksum"):
        again.read(h(0))
    assert not path.exists() and again.counters.corrupt == 1
    assert again.lookup([h(0)]) == 0
    assert again.read(h(1)).tobytes() == block(1).tobytes()


def test_a_file_removed_by_another_process_is_a_lost_block(tmp_path, opened):
    a, b = opened(tmp_path), opened(tmp_path)
    a.write(h(0), block(0))
    b.rescan()  # b learns a's block from the folder
    assert b.lookup([h(0)]) == 1
    os.unlink(a.path_of(h(0)))
    with pytest.raises(BlockLost):
        b.read(h(0))
    assert b.counters.lost == 1 and b.lookup([h(0)]) == 0


def test_writes_beyond_the_queue_are_dropped_and_counted(tmp_path, opened, monkeypatch):
    monkeypatch.setattr(disk_tier, "WRITE_QUEUE_BYTES", 1)  # a queue of one block
    t = opened(tmp_path)
    entered, release = threading.Event(), threading.Event()
    real_write = t.write

    def slow_write(block_hash, data):
        entered.set()
        release.wait(10)
        real_write(block_hash, data)
    t.write = slow_write
    assert t.put(h(0), block(0))
    assert entered.wait(10)  # the writer holds block 0
    assert t.put(h(1), block(1))  # queued
    assert not t.put(h(2), block(2))  # dropped
    release.set()
    t.flush()
    assert t.counters.dropped[0] == 1 and t.counters.writes[0] == 2
    assert t.lookup([h(0), h(1), h(2)]) == 2
    assert t.read(h(1)).tobytes() == block(1).tobytes()


# ---------------------------------------------------------------- connector

def caches(num_blocks: int = 6):
    """Layer l, block b holds block(b) + 100 * l."""
    return [np.stack([block(b)[layer] + 100 * layer for b in range(num_blocks)])
            for layer in range(LAYERS)]


def output(saves=(), loads=(), queries=0, hits=0):
    from kvserve.core.outputs import SchedulerOutput
    return SchedulerOutput(
        step_id=0, scheduled=(), new_requests=(), finished_request_ids=(),
        preemptions=(), rejected=(), num_batched_tokens=0, num_prefill_tokens=0,
        num_decode_tokens=0, first_scheduled_request_ids=(), prefix_cache_queries=0,
        prefix_cache_hits=0, kv_cache_usage=0.0, num_running=0, num_waiting=0,
        kv_saves=tuple(saves), kv_exports=(), kv_export_ids=(), kv_loads=tuple(loads),
        kv_offload_queries=queries, kv_offload_hits=hits)


@pytest.fixture
def connector(tmp_path, monkeypatch):
    monkeypatch.setattr("kvserve.kv_offload.host_tier.default_directory", lambda: tmp_path)
    config = CacheConfig(kv_offloading_size=2 * int(np.prod(SHAPE)) * 4 / 2**30,
                         kv_offloading_backend="disk", kv_offloading_path=str(tmp_path / "kv"))
    c = build_kv_connector(CpuOps(), KVLayout.of(caches(), "test-model"), config)
    yield c
    c.close()


def test_saves_are_written_through_and_misses_of_memory_load_from_disk(connector):
    kv = caches()
    assert connector.tier.num_slots == 2
    saves = [BlockTransfer("", b, h(b)) for b in (1, 2, 3)]
    result = connector.run(kv, output(saves=saves))
    connector.disk.flush()
    assert result.stats.by_direction["offload"][0] == 2  # memory holds two blocks
    assert connector.disk.num_blocks == 3  # disk all three
    view = connector.lookup_view()
    try:
        assert isinstance(view, TieredLookup)
        assert view.lookup_tiers([h(1), h(2), h(3), h(4)]) == (2, 1)
        assert view.lookup([h(3)]) == 1  # memory misses it, disk has it
    finally:
        view.close()
    loads = [BlockTransfer("r", 4, h(1)), BlockTransfer("r", 5, h(3))]
    result = connector.run(kv, output(loads=loads, queries=3 * BS, hits=2 * BS))
    assert result.stats.by_direction["onload"][0] == 1
    assert result.stats.by_direction["disk_read"][0] == 1
    assert result.stats.by_direction["disk_write"][0] == 3
    assert result.stats.offload_tiers == {"disk": [BS, BS]}
    for layer in range(LAYERS):
        np.testing.assert_array_equal(kv[layer][4], block(1)[layer] + 100 * layer)
        np.testing.assert_array_equal(kv[layer][5], block(3)[layer] + 100 * layer)


def test_a_restarted_connector_finds_the_blocks_on_disk(connector, tmp_path, monkeypatch):
    kv = caches()
    connector.run(kv, output(saves=[BlockTransfer("", 2, h(2))]))
    connector.close()
    config = CacheConfig(kv_offloading_size=2 * int(np.prod(SHAPE)) * 4 / 2**30,
                         kv_offloading_backend="disk", kv_offloading_path=str(tmp_path / "kv"))
    fresh = build_kv_connector(CpuOps(), KVLayout.of(caches(), "test-model"), config)
    try:
        assert fresh.disk.wait_verified(timeout=60)  # the start-up check, in the background
        assert fresh.tier.lookup([h(2)]) == 0 and fresh.disk.lookup([h(2)]) == 1
        kv2 = [np.zeros_like(c) for c in kv]
        fresh.run(kv2, output(loads=[BlockTransfer("r", 0, h(2))]))
        for layer in range(LAYERS):
            np.testing.assert_array_equal(kv2[layer][0], kv[layer][2])
    finally:
        fresh.close()


def test_a_corrupt_disk_block_fails_the_load(connector):
    kv = caches()
    connector.disk.write(h(5), block(5))
    path = connector.disk.path_of(h(5))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(BlockLost):
        connector.run(kv, output(loads=[BlockTransfer("r", 0, h(5))]))
    assert not path.exists()


def _write_many(path: str, order: int) -> None:
    """A separate process: write blocks 0..29 (in some order) with a bound of 6."""
    t = tier(path, blocks=6)
    for i in (range(30) if order == 0 else reversed(range(30))):
        t.write(h(i), block(i))
        if i % 5 == 0:
            t.rescan()
    t.close()


def test_processes_sharing_a_folder_never_serve_a_wrong_block(tmp_path):
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_many, args=(str(tmp_path), k)) for k in (0, 1)]
    for p in procs:
        p.start()
    reader = tier(tmp_path, blocks=64)
    served = 0
    while any(p.is_alive() for p in procs):  # read whatever is there while they write
        reader.rescan()
        for i in range(30):
            if reader.lookup([h(i)], lease_seconds=-1):
                try:
                    assert reader.read(h(i)).tobytes() == block(i).tobytes()
                    served += 1
                except BlockLost:
                    pass  # removed by a writer's bound: a miss, never wrong bytes
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    reader.close()
    assert reader.counters.corrupt == 0
    again = tier(tmp_path, blocks=64)
    assert again.scan_report.removed == {}  # no torn or temp file left behind
    assert 1 <= again.scan_report.blocks <= 12
    for i in range(30):
        if again.lookup([h(i)]):
            assert again.read(h(i)).tobytes() == block(i).tobytes()
    again.close()
