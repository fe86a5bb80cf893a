"""Preemption by recompute with a tiny KV cache: 8 concurrent requests must
evict each other, yet every output equals its output with a large cache, every
preemption is logged, and no request is lost."""

from __future__ import annotations

import pytest
import structlog

from engine_harness import BLOCK, BLOCK_BYTES, greedy
from kvserve.config import CacheConfig

pytestmark = pytest.mark.model

NUM_BLOCKS = 16
NUM_REQUESTS = 8
MAX_TOKENS = 16

TOPICS = ["the ocean tides", "how bees make honey", "why leaves change colour in autumn",
          "how a refrigerator keeps food cold", "the phases of the moon",
          "how vaccines train the immune system", "why bread rises in the oven",
          "how a rainbow forms after rain"]


def make_prompts(engine):
    prompts = []
    for i, topic in enumerate(TOPICS):
        text = (f"Request number {i}. Please write a clear explanation, suitable for a "
                f"curious twelve year old, of {topic}. Use simple words, a friendly tone and "
                f"one concrete everyday example.")
        prompts.append(engine.encode(text))
    return prompts


@pytest.mark.slow
def test_small_cache_preempts_without_changing_outputs(engine_loop, default_engine):
    params = greedy(MAX_TOKENS, ignore_eos=True)
    prompts = make_prompts(default_engine)
    assert all(36 <= len(p) <= 64 for p in prompts), [len(p) for p in prompts]
    needed = sum(-(-(len(p) + MAX_TOKENS) // BLOCK) for p in prompts)
    assert needed >= 2 * NUM_BLOCKS  # they cannot all fit at once

    reference = default_engine.generate_all(prompts, params)
    default_engine.assert_all_blocks_free()

    with structlog.testing.capture_logs() as logs:
        small = engine_loop.start(engine_loop.config(
            cache=CacheConfig(kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES)))
        try:
            assert small.kv.num_blocks == NUM_BLOCKS
            with small.record_steps() as steps:
                results = small.generate_all(prompts, params)
            small.assert_all_blocks_free()
            total_preemptions = small.engine.scheduler.total_preemptions
        finally:
            engine_loop.stop(small)

    # No request lost: all 8 finished normally, with all their tokens.
    for r in results:
        assert r.failed is None
        assert r.only.finish_reason == "length", r.only
        assert r.only.error is None
        assert len(r.only.token_ids) == r.only.num_output_tokens == MAX_TOKENS
    # Same greedy outputs as with a cache large enough for all of them.
    for prompt, got, want in zip(prompts, results, reference):
        assert got.only.token_ids == want.only.token_ids, len(prompt)
        assert got.only.text == want.only.text

    # At least one preemption happened, was counted and was logged.
    preempted = [e for st in steps for e in st.preemptions]
    assert preempted
    events = [e for e in logs if e["event"] == "request_preempted"]
    assert len(events) == len(preempted) == total_preemptions
    ids = {r.request_id for r in results}
    for n, (event, pre) in enumerate(zip(events, preempted), start=1):
        assert event["request_id"] == pre.request_id
        assert event["request_id"] in ids
        assert event["reason"] == "kv_cache_full"
        assert event["num_blocks_freed"] == pre.num_blocks_freed > 0
        assert event["total_preemptions"] == n
        assert event["log_level"] == "warning"
    finished = {e["request_id"] for e in logs if e["event"] == "request_finished"}
    assert finished == ids
