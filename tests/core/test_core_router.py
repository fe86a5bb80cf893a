"""The prefix-aware router and the KV events that feed it, with plain
integers: a replica's cache reports its block hashes, the router sends a
prompt where its prefix is cached unless that replica is overloaded."""

import pytest

from kvserve.core.block_hash import hash_request_blocks
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                    KVEventLog)
from kvserve.core.request import Request
from kvserve.core.router import PrefixAwareRouter, ReplicaLoad
from kvserve.core.sampling_params import SamplingParams

BLOCK = 4
IDLE = [ReplicaLoad(), ReplicaLoad(), ReplicaLoad()]


def test_event_log_keeps_order_and_merges_runs():
    log = KVEventLog()
    for h in (b"a", b"b"):
        log.stored(h)
    log.removed(b"a")
    log.stored(b"c")
    assert log.drain() == (BlockStored((b"a", b"b")), BlockRemoved((b"a",)),
                           BlockStored((b"c",)))
    assert log.drain() == ()
    log.stored(b"x")
    log.cleared()
    log.stored(b"y")
    assert log.drain() == (AllBlocksCleared(), BlockStored((b"y",)))


def test_an_overflowing_log_says_clear_rather_than_drop_events():
    log = KVEventLog(max_events=3)
    for h in (b"1", b"2", b"3", b"4"):
        log.stored(h)
    assert log.drain() == (AllBlocksCleared(), BlockStored((b"4",)))


def test_the_cache_manager_reports_what_it_stores_and_evicts():
    log = KVEventLog()
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK, events=log)
    prompt = list(range(9))  # two full blocks and one token
    request = Request("r", tuple(prompt), SamplingParams(max_tokens=1), arrival_time=0.0)
    kv.update_block_hashes(request)
    assert kv.allocate_slots(request, 9) is not None
    kv.cache_computed_blocks(request, 9)
    expected = tuple(hash_request_blocks(prompt, BLOCK))
    assert log.drain() == (BlockStored(expected),)
    kv.free(request)
    other = Request("o", tuple(range(100, 112)), SamplingParams(max_tokens=1),
                    arrival_time=0.0)
    kv.update_block_hashes(other)
    assert kv.allocate_slots(other, 12) is not None  # needs all 3 blocks: evicts both
    removed = {h for e in log.drain() if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert removed == set(expected)


def router_holding(prefix, replica=1, replicas=3, min_prefix_fraction=0.5):
    router = PrefixAwareRouter(replicas, BLOCK, min_prefix_fraction=min_prefix_fraction)
    router.apply_events(replica, [BlockStored(tuple(hash_request_blocks(prefix, BLOCK)))])
    return router


def test_the_longest_cached_prefix_wins():
    shared = list(range(16))
    router = router_holding(shared)
    decision = router.route(shared + [99, 98], IDLE)
    assert (decision.replica, decision.reason, decision.cached_blocks) == (1, "prefix", 4)
    router.apply_events(2, [BlockStored(tuple(hash_request_blocks(shared[:8], BLOCK)))])
    assert router.route(shared, IDLE).replica == 1  # 4 blocks beat 2


def test_a_prefix_counts_only_from_the_first_block():
    router = router_holding(list(range(16)))
    decision = router.route([7, 7, 7, 7] + list(range(4, 16)), IDLE)  # first block differs
    assert decision.reason == "least_load" and decision.cached_blocks == 0


def test_no_prefix_goes_to_the_least_loaded():
    router = PrefixAwareRouter(3, BLOCK)
    loads = [ReplicaLoad(running=3), ReplicaLoad(running=1, waiting=1), ReplicaLoad(running=1)]
    assert router.route(list(range(8)), loads).replica == 2


@pytest.mark.parametrize("prefix_load, expected", [
    (ReplicaLoad(running=4), "prefix"),           # 4 more than the least: within the margin
    (ReplicaLoad(running=5, waiting=1), "prefix_overloaded"),  # 6 more, and > 1.5 x 0
])
def test_an_overloaded_prefix_replica_is_passed_over(prefix_load, expected):
    router = router_holding(list(range(16)))
    loads = [ReplicaLoad(), prefix_load, ReplicaLoad(running=2)]
    decision = router.route(list(range(16)), loads)
    assert decision.reason == expected
    assert decision.replica == (1 if expected == "prefix" else 0)
    assert decision.prefix_replica == 1 and decision.prefix_blocks == 4


def test_evicted_cleared_and_down_replicas_are_forgotten():
    prompt = list(range(16))
    router = router_holding(prompt, min_prefix_fraction=0.0)  # the index alone
    hashes = hash_request_blocks(prompt, BLOCK)
    router.apply_events(1, [BlockRemoved((hashes[1],))])  # a gap: blocks 2, 3 are unreachable
    assert router.route(prompt, IDLE).cached_blocks == 1
    router.apply_events(1, [BlockStored((hashes[1],)), BlockRemoved(tuple(hashes[2:]))])
    assert router.route(prompt, IDLE).cached_blocks == 2
    assert router.route(prompt, IDLE, available=[True, False, True]).cached_blocks == 0
    router.apply_events(1, [AllBlocksCleared()])
    assert router.route(prompt, IDLE).reason == "least_load"
    with pytest.raises(ValueError):
        router.route(prompt, IDLE, available=[False, False, False])


def test_a_short_shared_head_does_not_pull_traffic_to_one_replica():
    """Every chat shares the template's first block: a one-block match on a
    ten-block prompt is below the 0.5 fraction, so load decides."""
    shared = list(range(4))
    router = router_holding(shared)
    loads = [ReplicaLoad(), ReplicaLoad(running=2), ReplicaLoad(running=1)]
    decision = router.route(shared + list(range(100, 136)), loads)
    assert (decision.replica, decision.reason) == (0, "least_load")
    assert router.route(list(range(8)), loads).reason == "prefix"  # 1 of 2 blocks: half counts
