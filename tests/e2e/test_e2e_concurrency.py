"""Acceptance: 16 concurrent streaming requests give the greedy tokens each
gives alone (continuous batching must not change any request's result).

Each prompt first runs alone; then all 16 run at once (``asyncio.gather``) on
the shared engine, and once more, arriving staggered, on a tight engine
(small token budget, a small KV cache) that forces chunked prefill and
preemption by recompute. Half the prompts share a long
system prompt, so prefix-cache hits happen within a batch.

A divergence is accepted only where the concurrent run's own top-2 logits are
a near-tie (< 1e-3), the same rule as for the golden outputs.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from e2e_support import EngineThread, collect, first_divergence, make_request, \
    wait_all_blocks_free

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig

pytestmark = pytest.mark.model

MAX_TOKENS = 8
TIGHT_BLOCKS = 5
SYSTEM = ("You are a helpful assistant that answers in one short sentence. Be precise, be "
          "friendly, and never make up facts you are not sure about.")
QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "How many legs does a spider have?",
    "What is 2 + 2?",
    "Which planet is known as the red planet?",
    "What language is spoken in Brazil?",
    "What do bees make?",
    "Who wrote Romeo and Juliet?",
]
RAW = [
    "The quick brown fox",
    "def add(a, b):\n",
    "Once upon a time, in a small village by the sea,",
    "1, 1, 2, 3, 5, 8,",
    "The three laws of thermodynamics are",
    "import numpy as np\nx = np.",
    "Monday, Tuesday, Wednesday,",
    "Water boils at",
]


def _requests(tag: str):
    """16 greedy requests (8 chat sharing a system prompt, 8 raw), ids tagged."""
    out = []
    for i, question in enumerate(QUESTIONS):
        out.append(make_request(f"{tag}-chat{i}", max_tokens=MAX_TOKENS, logprobs=2,
                                messages=[{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": question}]))
    for i, prompt in enumerate(RAW):
        out.append(make_request(f"{tag}-raw{i}", prompt=prompt, max_tokens=MAX_TOKENS,
                                logprobs=2))
    return out


@pytest.fixture(scope="module")
def alone(e2e_engine):
    """Each request run by itself, one after another: the reference outputs."""
    results = [e2e_engine.generate(request) for request in _requests("alone")]
    for result in results:
        assert result.failed is None, result.failed
        assert len(result.token_ids) >= 1
    return results


def _check_same(alone, together) -> None:
    for ref, got in zip(alone, together, strict=True):
        assert got.failed is None, got.failed
        assert got.prompt_token_ids == ref.prompt_token_ids
        # A near-tie on either side may flip under a different batch shape.
        top2 = [min(a, b, key=lambda t: t[0] - t[1]) for a, b in zip(got.top2(), ref.top2())]
        diverged = first_divergence(ref.token_ids, got.token_ids, top2, got.request_id)
        if diverged is None:
            assert got.text == ref.text, got.request_id
            assert got.finish_reason == ref.finish_reason, got.request_id


@pytest.mark.slow
def test_16_concurrent_equal_alone(e2e_engine, alone) -> None:
    async def all_at_once():
        return await asyncio.gather(*(collect(e2e_engine.engine, r)
                                      for r in _requests("together")))

    together = e2e_engine.run(all_at_once())
    assert len(together) == 16
    _check_same(alone, together)


@pytest.fixture(scope="module")
def tight_engine(default_model_path: Path):
    """A second engine that forces chunked prefill (a 32-token budget) and
    preemption by recompute (5 KV blocks of 16 tokens for 16 requests)."""
    per_token = 2 * 30 * 3 * 64 * 4  # float32 K+V bytes per token of SmolLM2-135M
    config = EngineConfig(
        model=str(default_model_path), logprobs_mode="raw_logits",
        cache=CacheConfig(kv_cache_memory=TIGHT_BLOCKS * 16 * per_token),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=16))
    handle = EngineThread(config)
    assert handle.engine.core.plan.num_blocks == TIGHT_BLOCKS
    yield handle
    handle.close()


@pytest.mark.slow
def test_16_concurrent_staggered_tight_engine_equal_alone(tight_engine, alone) -> None:
    async def staggered():
        tasks = []
        for request in _requests("tight"):
            tasks.append(asyncio.ensure_future(collect(tight_engine.engine, request)))
            await asyncio.sleep(0.01)
        return await asyncio.gather(*tasks)

    together = tight_engine.run(staggered())
    _check_same(alone, together)
    snap = tight_engine.run(wait_all_blocks_free(tight_engine.engine))
    assert snap.all_free, snap
    assert tight_engine.engine.scheduler.total_preemptions > 0, \
        "test precondition: the tight engine should have preempted"
