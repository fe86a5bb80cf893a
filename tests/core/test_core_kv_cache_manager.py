"""Block pool, hash chain and prefix-cache behaviour of the KV cache manager."""

import pytest

from kvserve.core.block_hash import content_hash, hash_block_tokens, hash_request_blocks
from kvserve.core.kv_cache_manager import BlockPool, KVCacheManager
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams

BS = 4


def make_req(rid, tokens, **params):
    return Request(rid, list(tokens), SamplingParams(**params))


def run_prefill(manager, request):
    """Admit ``request`` with its prefix hits, compute its whole prompt, cache blocks."""
    hits, num_hit = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit, hits)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_computed_blocks(request)
    return hits, num_hit


def accounting(manager):
    free, cached_free, in_use = manager.pool.count_blocks()
    assert free + cached_free + in_use == manager.num_blocks
    manager.check_consistency()
    return free, cached_free, in_use


# ------------------------------------------------------------------ hashing

def test_hash_chain_depends_on_parent_tokens_and_extra_keys():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert len(a) == 32 and a == hash_block_tokens(None, (1, 2, 3, 4))
    assert a != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(a, [1, 2]) != hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1], ("lora",)) != hash_block_tokens(None, [1])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2, 0])
    assert content_hash([1, 2, 3, 4]) == a


def test_hash_request_blocks_skips_partial_and_resumes():
    tokens = list(range(11))
    hashes = hash_request_blocks(tokens, BS)
    assert len(hashes) == 2
    assert hash_request_blocks(tokens, BS, hashes[0], start_block=1) == hashes[1:]


def test_block_hash_chains_the_prefix():
    """Equal blocks after different prefixes hash differently (the K/V differ)."""
    a = hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8], BS)
    b = hash_request_blocks([9, 9, 9, 9, 5, 6, 7, 8], BS)
    assert a[0] != b[0] and a[1] != b[1]
    assert a[1] == hash_block_tokens(a[0], [5, 6, 7, 8])


def test_block_seen_at_another_position_is_no_hit():
    """A prompt that starts with another prompt's second block must not reuse it."""
    manager = KVCacheManager(16, BS)
    run_prefill(manager, make_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert manager.get_computed_blocks(make_req("b", [5, 6, 7, 8, 1, 2]))[1] == 0
    assert manager.get_computed_blocks(make_req("c", [1, 2, 3, 4, 5, 6, 7, 8, 0]))[1] == 8


# --------------------------------------------------------------- block pool

def test_pool_allocates_from_head_and_ref_counts():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2] and all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1 and pool.usage == 0.75
    pool.touch(blocks[:1])
    pool.free_blocks(blocks[:1])
    assert blocks[0].ref_cnt == 1 and pool.num_free_blocks == 1
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)


def test_pool_double_free_raises():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([block])


def test_pool_lru_eviction_order():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    for i, block in enumerate(blocks):
        assert pool.cache_full_block(block, bytes([i]) * 32)
    pool.free_blocks([blocks[2], blocks[0]])  # freed first -> evicted first
    pool.free_blocks([blocks[3]])
    (first,) = pool.get_new_blocks(1)
    assert first is blocks[2] and first.block_hash is None
    assert pool.get_cached_block(bytes([2]) * 32) is None
    assert pool.get_cached_block(bytes([0]) * 32) is blocks[0]
    # a hit in the middle of the queue removes it from the queue (O(1))
    pool.touch([blocks[0]])
    assert [b.block_id for b in pool.get_new_blocks(1)] == [3]


def test_pool_uncached_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_block(blocks[0], b"h" * 32)
    pool.free_blocks([blocks[0]])
    pool.free_blocks([blocks[1]])  # no hash: goes to the head
    assert pool.get_new_blocks(1) == [blocks[1]]
    assert pool.get_cached_block(b"h" * 32) is blocks[0]


def test_pool_duplicate_hash_and_disabled_caching():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_block(a, b"x" * 32)
    assert not pool.cache_full_block(b, b"x" * 32) and b.block_hash is None
    assert pool.cache_full_block(a, b"x" * 32)
    with pytest.raises(ValueError):
        pool.cache_full_block(a, b"y" * 32)
    off = BlockPool(1, enable_caching=False)
    (c,) = off.get_new_blocks(1)
    assert not off.cache_full_block(c, b"x" * 32) and off.get_cached_block(b"x" * 32) is None


def test_pool_reset_prefix_cache():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, b"x" * 32)
    assert not pool.reset_prefix_cache()
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() and pool.get_cached_block(b"x" * 32) is None


# ------------------------------------------------------------ cache manager

def test_allocate_grows_block_table_and_fails_without_side_effects():
    manager = KVCacheManager(num_blocks=3, block_size=BS)
    req = make_req("a", range(6))
    assert len(manager.allocate_slots(req, 6)) == 2
    req.num_computed_tokens = 6
    assert manager.allocate_slots(req, 2) == []  # fits in block 2's free slots
    before = (manager.num_free_blocks, manager.get_block_ids("a"))
    assert manager.allocate_slots(req, 7) is None  # needs 2 more, 1 free
    assert (manager.num_free_blocks, manager.get_block_ids("a")) == before
    accounting(manager)
    assert manager.free(req) == 2 and manager.num_free_blocks == 3
    accounting(manager)


def test_prefix_hit_in_tokens_and_shared_blocks():
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_req("a", range(10))
    assert run_prefill(manager, a) == ([], 0)
    b = make_req("b", list(range(8)) + [99, 98, 97])
    hits, num_hit = run_prefill(manager, b)
    assert num_hit == 8 and [h.block_id for h in hits] == manager.get_block_ids("a")[:2]
    assert all(h.ref_cnt == 2 for h in hits)
    assert manager.stats.queries == 21 and manager.stats.hits == 8
    assert manager.stats.requests == 2
    manager.free(a)  # b still holds the shared blocks
    assert all(h.ref_cnt == 1 for h in hits)
    assert manager.get_computed_blocks(make_req("c", range(9)))[1] == 8
    accounting(manager)
    manager.free(b)
    assert accounting(manager)[2] == 0


def test_last_prompt_token_is_always_recomputed():
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    run_prefill(manager, make_req("a", range(8)))  # exactly two full blocks
    hits, num_hit = manager.get_computed_blocks(make_req("b", range(8)))
    assert len(hits) == 1 and num_hit == 4
    hits, num_hit = manager.get_computed_blocks(make_req("c", range(9)))
    assert len(hits) == 2 and num_hit == 8


def test_hits_must_be_a_prefix_chain():
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    run_prefill(manager, make_req("a", range(12)))
    other = make_req("b", [50, 51, 52, 53] + list(range(4, 13)))  # same 2nd block, other prefix
    assert manager.get_computed_blocks(other) == ([], 0)


def test_freed_cached_blocks_are_reused_until_evicted():
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_req("a", range(9))
    run_prefill(manager, a)
    manager.free(a)
    assert manager.num_free_blocks == 4 and manager.usage == 0.0
    free, cached_free, _ = accounting(manager)
    assert (free, cached_free) == (2, 2)
    # a 9-token request with another prefix takes the uncached block(s) first,
    # then evicts a's tail block before its head block
    other = make_req("x", range(100, 109))
    assert manager.allocate_slots(other, 9) is not None
    b = make_req("b", range(9))
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 4  # block 0 of a survived, block 1 was evicted
    assert manager.allocate_slots(b, 5, hits) is None  # 1 revived + 2 new > 1 free
    manager.free(other)
    assert manager.allocate_slots(b, 5, hits) is not None
    assert manager.num_free_blocks == 1 and hits[0].ref_cnt == 1
    accounting(manager)


def test_allocation_counts_revived_cached_blocks_against_free_space():
    manager = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_req("a", range(9))
    run_prefill(manager, a)
    manager.free(a)
    b = make_req("b", list(range(8)) + list(range(20, 24)) + [1])  # 13 tokens, 4 blocks
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    assert manager.allocate_slots(b, 5, hits) is None  # 2 revived + 2 new > 3 free
    assert manager.get_block_ids("b") == [] and manager.stats.requests == 1
    accounting(manager)


def test_blocks_are_cached_only_once_computed():
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_req("a", range(12))
    manager.allocate_slots(a, 12)
    assert manager.get_computed_blocks(make_req("b", range(13)))[1] == 0
    a.num_computed_tokens = 5
    manager.cache_computed_blocks(a)
    assert manager.get_computed_blocks(make_req("c", range(13)))[1] == 4


def test_generated_tokens_fill_blocks_that_get_cached():
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_req("a", range(3))
    run_prefill(manager, a)
    for token in (7, 8):  # decode: the sampled token is computed next step
        a.append_output_token_ids(token)
        manager.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        manager.cache_computed_blocks(a)
    assert manager.get_computed_blocks(make_req("b", [0, 1, 2, 7, 8]))[1] == 4


def test_prefix_caching_disabled_and_prompt_logprobs():
    off = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    run_prefill(off, make_req("a", range(9)))
    assert off.get_computed_blocks(make_req("b", range(9))) == ([], 0)
    assert off.stats.queries == 0
    on = KVCacheManager(num_blocks=10, block_size=BS)
    run_prefill(on, make_req("a", range(9)))
    assert on.get_computed_blocks(make_req("b", range(9), prompt_logprobs=1)) == ([], 0)


def test_content_hash_hook():
    manager = KVCacheManager(num_blocks=10, block_size=BS, track_content_hashes=True)
    run_prefill(manager, make_req("a", [9, 9, 9, 9, 1, 2, 3, 4, 0]))
    ids = manager.get_block_ids("a")
    assert manager.pool.blocks_with_content(content_hash([1, 2, 3, 4])) == [ids[1]]
    assert manager.pool.blocks_with_content(content_hash([5, 5, 5, 5])) == []


def test_hits_only_on_first_allocation():
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_req("a", range(9))
    run_prefill(manager, a)
    b = make_req("b", range(9))
    hits, _ = manager.get_computed_blocks(b)
    manager.allocate_slots(b, 1, hits)
    with pytest.raises(ValueError):
        manager.allocate_slots(b, 1, hits)


def test_prompt_logprobs_request_hits_only_after_scoring_its_prompt():
    """It needs every prompt position's logits, so no hits before its first
    token; resumed after a preemption (prompt scored), it hits; its blocks
    serve others either way."""
    manager = KVCacheManager(16, BS)
    scorer = make_req("s", [1, 2, 3, 4, 5, 6, 7, 8, 9], prompt_logprobs=2)
    run_prefill(manager, make_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert manager.get_computed_blocks(scorer) == ([], 0)
    run_prefill(manager, scorer)
    assert manager.get_computed_blocks(make_req("b", [1, 2, 3, 4, 5, 6, 7, 8, 0]))[1] == 8
    manager.free(scorer)
    scorer.append_output_token_ids(42)  # its first token: prompt logprobs delivered
    scorer.num_computed_tokens = 0
    assert manager.get_computed_blocks(scorer)[1] == 8
