"""The KV offload tier end to end: a prompt whose prefix blocks were evicted
from the engine's cache loads them from the tier, with the same greedy
output as computing them (the reference: an engine without prefix caching);
a tier that lost them means recompute, never a wrong answer."""

from __future__ import annotations

import pytest

from engine_harness import BLOCK, BLOCK_BYTES, TEXTS, full_block_tokens, greedy
from kvserve.config import CacheConfig

pytestmark = pytest.mark.model

MAX_TOKENS = 8
CACHE_BLOCKS = 24  # 384 tokens: one long prompt evicts another's blocks


def offload_cache(tier_blocks: int) -> CacheConfig:
    return CacheConfig(kv_cache_memory=CACHE_BLOCKS * BLOCK_BYTES,
                       kv_offloading_size=tier_blocks * BLOCK_BYTES / 2**30)


@pytest.fixture(scope="module")
def offload_engine(engine_loop):
    handle = engine_loop.start(engine_loop.config(cache=offload_cache(tier_blocks=64)))
    yield handle
    engine_loop.stop(handle)


def prompts(engine):
    prefix = engine.encode("Offload test. " + TEXTS["long_prefix"])
    evictor = engine.encode("Eviction. " + TEXTS["chunked"] * 2)[:20 * BLOCK]
    return prefix, evictor


@pytest.mark.slow
def test_evicted_prefix_is_loaded_from_the_tier_with_the_same_output(offload_engine,
                                                                     no_prefix_engine):
    prefix, evictor = prompts(offload_engine)
    assert 12 * BLOCK < len(prefix) < CACHE_BLOCKS * BLOCK
    reference = no_prefix_engine.generate(prefix, greedy(MAX_TOKENS)).only.token_ids
    stats = offload_engine.kv.stats
    hits0 = stats.external_hits

    first = offload_engine.generate(prefix, greedy(MAX_TOKENS)).only
    offload_engine.generate(evictor, greedy(1))  # needs 21 of the 24 blocks
    # the prefix's tail blocks were evicted first: a few head blocks stay
    assert offload_engine.kv.get_computed_blocks(_request(prefix))[1] <= 4 * BLOCK
    again = offload_engine.generate(prefix, greedy(MAX_TOKENS)).only

    assert first.token_ids == again.token_ids == reference
    assert again.num_cached_tokens[-1] == full_block_tokens(len(prefix))
    loaded = stats.external_hits - hits0
    assert loaded >= full_block_tokens(len(prefix)) - 4 * BLOCK
    text = offload_engine.engine.metrics.render().decode()
    assert 'kvserve:kv_transfer_blocks_total{direction="onload"' in text
    assert f"kvserve:kv_offload_hits_total{{model_name=" in text
    offload_engine.assert_all_blocks_free()


@pytest.mark.slow
def test_blocks_the_tier_lost_are_recomputed_with_the_same_output(offload_engine,
                                                                  no_prefix_engine):
    prefix = offload_engine.encode("Lost tier. " + TEXTS["long_prefix"])
    evictor = offload_engine.encode("Third eviction. " + TEXTS["chunked"] * 2)[:20 * BLOCK]
    reference = no_prefix_engine.generate(prefix, greedy(MAX_TOKENS)).only.token_ids
    offload_engine.generate(prefix, greedy(MAX_TOKENS))
    offload_engine.generate(evictor, greedy(1))
    offload_engine.engine.core.runner.kv_connector.tier.clear()
    hits0 = offload_engine.kv.stats.external_hits
    again = offload_engine.generate(prefix, greedy(MAX_TOKENS)).only
    assert again.token_ids == reference
    assert offload_engine.kv.stats.external_hits == hits0
    assert again.num_cached_tokens[-1] <= 4 * BLOCK  # the head blocks still cached locally
    offload_engine.assert_all_blocks_free()


def _request(prompt):
    from kvserve.core.request import Request
    from kvserve.core.sampling_params import SamplingParams
    return Request("probe", list(prompt), SamplingParams(max_tokens=1))


@pytest.mark.slow
def test_an_engine_attached_to_the_tier_loads_what_another_evicted(engine_loop, offload_engine,
                                                                   no_prefix_engine):
    """Replicas of a node share the tier: engine B never saw the prompt."""
    prefix = offload_engine.encode("Shared tier. " + TEXTS["long_prefix"])
    evictor = offload_engine.encode("Second eviction. " + TEXTS["chunked"] * 2)[:20 * BLOCK]
    reference = no_prefix_engine.generate(prefix, greedy(MAX_TOKENS)).only.token_ids
    other = engine_loop.start(engine_loop.config(
        cache=CacheConfig(kv_cache_memory=CACHE_BLOCKS * BLOCK_BYTES)))
    try:
        other.run(other.engine.attach_offload_tier(
            str(offload_engine.engine.core.runner.kv_connector.tier.path)))
        offload_engine.generate(prefix, greedy(MAX_TOKENS))
        offload_engine.generate(evictor, greedy(1))
        result = other.generate(prefix, greedy(MAX_TOKENS)).only
        assert result.token_ids == reference
        assert result.num_cached_tokens[-1] >= full_block_tokens(len(prefix)) - 4 * BLOCK
        assert other.kv.stats.external_hits == result.num_cached_tokens[-1]
        other.assert_all_blocks_free()
    finally:
        engine_loop.stop(other)
