"""SharedHostTier: a bounded, shared-memory store of KV blocks by hash."""

import multiprocessing
import os

import numpy as np
import pytest

from kvserve.kv_offload.host_tier import BlockLost, SharedHostTier, remove_stale_tiers

SHAPE = (2, 2, 4, 1, 2)  # layers, K/V, block size, kv heads, head dim
SLOT = int(np.prod(SHAPE)) * 4


def h(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8  # 32 bytes


def block(i: int) -> np.ndarray:
    return np.full(SHAPE, i, dtype=np.float32)


@pytest.fixture
def tier(tmp_path):
    t = SharedHostTier.create(3 * SLOT, SHAPE, np.float32, "model-a", directory=tmp_path)
    yield t
    t.unlink()


def store(tier, ids):
    blocks = [block(i) for i in ids]

    def write(slots, indices):
        for slot, index in zip(slots, indices):
            tier.data[slot] = blocks[index]
    return tier.store([h(i) for i in ids], write)


def read(tier, ids):
    out = []
    tier.read_into([h(i) for i in ids], lambda slots: out.extend(tier.data[s].copy()
                                                                 for s in slots))
    return out


def test_stored_blocks_are_found_in_order_and_read_back(tier):
    assert tier.num_slots == 3 and tier.num_used() == 0
    assert store(tier, [1, 2]) == 2
    assert tier.lookup([h(1), h(2), h(3)], lease_seconds=0) == 2
    assert tier.lookup([h(2), h(1)], lease_seconds=0) == 2
    assert tier.lookup([h(3), h(1)], lease_seconds=0) == 0  # a chain stops at the first miss
    got = read(tier, [2, 1])
    assert float(got[0].mean()) == 2.0 and float(got[1].mean()) == 1.0
    assert store(tier, [1]) == 0  # held already


def test_the_least_recently_used_unleased_block_is_evicted(tier):
    store(tier, [1, 2, 3])
    tier.lookup([h(1)], lease_seconds=0)  # 1 used more recently than 2 and 3
    tier.lookup([h(3)], lease_seconds=0)
    assert store(tier, [4]) == 1
    assert tier.lookup([h(2)], lease_seconds=0) == 0
    assert tier.lookup([h(1)], lease_seconds=0) == tier.lookup([h(4)], lease_seconds=0) == 1


def test_leased_blocks_are_not_evicted(tier):
    store(tier, [1, 2, 3])
    assert tier.lookup([h(1), h(2), h(3)]) == 3  # leased for a minute
    assert store(tier, [4]) == 0
    assert tier.lookup([h(4)], lease_seconds=0) == 0


def test_clear_forgets_every_block(tier):
    store(tier, [1, 2])
    tier.clear()
    assert tier.num_used() == 0 and tier.lookup([h(1)]) == 0
    assert store(tier, [1]) == 1


def test_a_block_overwritten_while_read_raises_block_lost(tier):
    store(tier, [1])

    def overwrite_during_read(slots):
        tier._meta[slots[0], 1] += 1  # what a writer's claim does
    with pytest.raises(BlockLost, match="overwritten"):
        tier.read_into([h(1)], overwrite_during_read)
    with pytest.raises(BlockLost, match="1 of 2"):
        tier.read_into([h(1), h(9)], lambda slots: None)


def test_attach_shares_blocks_and_checks_the_fingerprint(tier):
    store(tier, [7])
    other = SharedHostTier.attach(tier.path, SHAPE, np.float32, "model-a")
    try:
        assert other.lookup([h(7)]) == 1
        assert float(read(other, [7])[0].mean()) == 7.0
    finally:
        other.close()
    with pytest.raises(ValueError, match="model"):
        SharedHostTier.attach(tier.path, SHAPE, np.float32, "model-b")
    with pytest.raises(ValueError, match="shape"):
        SharedHostTier.attach(tier.path, (1, 2, 4, 1, 2), np.float32, "model-a")


def test_a_size_below_one_block_is_refused(tmp_path):
    with pytest.raises(ValueError, match="holds no block"):
        SharedHostTier.create(SLOT - 1, SHAPE, np.float32, "m", directory=tmp_path)


def test_files_of_dead_owners_are_removed(tmp_path):
    dead = tmp_path / "kvserve-kv-999999999-ab12"
    alive = tmp_path / f"kvserve-kv-{os.getpid()}-cd34"
    dead.write_bytes(b"x")
    alive.write_bytes(b"x")
    assert remove_stale_tiers(tmp_path) == [dead]
    assert alive.exists()


def _store_in_child(path, ids):
    tier = SharedHostTier.attach(path, SHAPE, np.float32, "model-a")
    store(tier, ids)
    tier.close()


def test_another_process_reads_what_one_stored(tier):
    child = multiprocessing.get_context("spawn").Process(target=_store_in_child,
                                                         args=(str(tier.path), [5, 6]))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert tier.lookup([h(5), h(6)]) == 2
    assert [float(b.mean()) for b in read(tier, [5, 6])] == [5.0, 6.0]


def test_a_tier_larger_than_the_free_space_is_refused_and_leaves_no_file(tmp_path):
    with pytest.raises(ValueError, match="does not fit"):
        SharedHostTier.create(10**18, SHAPE, np.float32, "m", directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_tier_needs_prefix_caching():
    from kvserve.config import CacheConfig
    with pytest.raises(ValueError, match="prefix caching"):
        CacheConfig(kv_offloading_size=0.1, enable_prefix_caching=False)
