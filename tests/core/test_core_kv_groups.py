"""KV-cache groups: the layout of full and sliding-window layers, and the
block manager freeing a sliding group's blocks behind the window (issue 30).

Expected values are worked out by hand in the comments, from the rules:
a query at position p sees keys p - window < j <= p; a sliding group keeps
the blocks from ``(computed - window + 1) // block_size`` on.
"""

import pytest

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_layout import kv_cache_layout, single_group
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams

BS = 4
F, S = "full_attention", "sliding_attention"


def gemma_pattern(num_layers: int) -> list[str]:
    """Hugging Face's Gemma 3 default: every sixth layer full."""
    return [F if (i + 1) % 6 == 0 else S for i in range(num_layers)]


def test_gemma3_270m_layout_is_one_full_and_five_sliding_groups_of_three():
    layout = kv_cache_layout(gemma_pattern(18), 512)
    assert layout.group_size == 3
    assert [g.layers for g in layout.groups] == [
        (5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)]
    assert layout.windows == (None, 512, 512, 512, 512, 512)
    assert layout.layer_group[6] == 2 and layout.layer_slot[6] == 2
    assert layout.layer_group[11] == 0 and layout.layer_slot[11] == 1
    assert layout.is_hybrid


def test_gemma3_1b_pattern_gives_groups_of_two():
    layout = kv_cache_layout(gemma_pattern(26), 512)  # 4 full, 22 sliding: gcd 2
    assert layout.group_size == 2 and layout.num_groups == 13
    assert layout.windows.count(None) == 2


def test_single_type_models_are_one_group_of_every_layer():
    for layout in (single_group(30), kv_cache_layout([S] * 4, None)):
        assert layout.num_groups == 1 and not layout.is_hybrid
        assert layout.layer_slot == tuple(range(layout.group_size))


def test_layout_rejects_unknown_types():
    with pytest.raises(ValueError, match="unknown layer types"):
        kv_cache_layout([F, "local"], 8)


def test_max_blocks_counts_the_window_and_one_step():
    layout = kv_cache_layout([F, S], 8)
    # 100 tokens: the full group 25 blocks; the sliding group the window
    # behind a step's first token (7) and the step (4): ceil(11 / 4) + 1 = 4.
    assert layout.max_blocks(100, BS, 4) == 25 + 4
    assert layout.max_blocks(6, BS, 4) == 2 + 2  # never more than the full count


def make_req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=1000))


def held(manager, rid):
    """Blocks the request holds, null entries left out."""
    return [b for b in manager.req_to_blocks[rid] if b is not manager.null_block]


def decode_to(manager, request, num_tokens):
    """Compute the request's tokens one step at a time up to ``num_tokens``
    (the first step its whole prompt), caching the full blocks."""
    while request.num_computed_tokens < num_tokens:
        num_new = (request.num_tokens - request.num_computed_tokens
                   if request.num_computed_tokens < request.num_tokens else 1)
        if request.num_computed_tokens + num_new > request.num_tokens:
            request.append_output_token_ids(7)
        assert manager.allocate_slots(request, num_new) is not None
        request.num_computed_tokens += num_new
        manager.cache_computed_blocks(request)


def test_a_long_request_holds_only_the_window_of_its_sliding_group():
    manager = KVCacheManager(200, BS, windows=(None, 8))
    full_only = KVCacheManager(200, BS, windows=(None, None))
    for m in (manager, full_only):
        request = make_req("a", range(1, 5))
        decode_to(m, request, 100)
        m.check_consistency()
    # 100 tokens computed: 25 logical blocks. Full only: 2 x 25 = 50.
    assert len(held(full_only, "a")) == 50
    # The last allocation ran with 99 computed: the next token (position 99)
    # sees keys 92..99, blocks 23 and 24 -> sliding holds 2, full 25.
    assert len(held(manager, "a")) == 25 + 2
    table = manager.req_to_blocks["a"]
    assert [b is manager.null_block for b in table[1::2]] == [True] * 23 + [False] * 2
    assert manager.num_free_blocks == 200 - 1 - 27  # block 0 is the null block
    assert manager.free("a") == 27 and manager.num_free_blocks == 199
    manager.check_consistency()


def test_prefix_hit_needs_only_the_sliding_blocks_inside_the_window():
    manager = KVCacheManager(100, BS, windows=(None, 8))
    first = make_req("a", range(1, 41))  # 40 tokens: 10 full blocks, all cached
    decode_to(manager, first, 40)
    manager.free(first)
    again = make_req("b", list(range(1, 41)) + [99, 98, 97, 96])
    hits, num_hit = manager.get_computed_blocks(again)
    # At most (44 - 1) // 4 = 10 blocks; the next token, position 40, sees
    # keys 33..40: the sliding group needs blocks 8 and 9 only.
    assert num_hit == 40 and len(hits) == 20
    assert [b is manager.null_block for b in hits[1::2]] == [True] * 8 + [False] * 2
    assert all(b is not manager.null_block for b in hits[0::2])
    # Without sliding block 9 in the cache, 40 tokens cannot be a hit; 36 can:
    # position 36 sees 29..36, blocks 7 and 8.
    manager.evict_hashes([hits[19].block_id])
    hits, num_hit = manager.get_computed_blocks(again)
    assert num_hit == 36
    assert [b is manager.null_block for b in hits[1::2]] == [True] * 7 + [False] * 2
    assert manager.allocate_slots(again, 8, hits) is not None
    manager.check_consistency()


def test_single_group_manager_keeps_its_plain_block_table():
    manager = KVCacheManager(50, BS)
    request = make_req("a", range(1, 5))
    decode_to(manager, request, 30)
    assert manager.null_block is None
    assert len(manager.get_block_ids("a")) == 8 and manager.num_blocks == 50
