"""Acceptance (issue 17), the ``draft_model`` method: greedy output with a
draft model equals the output without speculation, token for token -- on
the golden prompts and repetitive ones, alone and batched with requests
that do not speculate, with chunked prefill and with preemption in between
-- and no KV block leaks; seeded sampling draws the same tokens; unseeded
sampling goes through rejection sampling (its distribution is tested in
``tests/model/test_spec_verify.py``). The reference is the default engine's
plain decoding. The draft is the default model's own checkpoint with int8
weights: the only other model of the same tokenizer at hand, and one whose
argmax differs from the float model's now and then, so rejections happen."""

from __future__ import annotations

import asyncio

import pytest
from golden import golden_cases
from test_engine_spec_decode import (MAX_TOKENS, assert_batched_equals_alone,
                                     repetitive_prompts, spec_metric)

from engine_harness import BLOCK_BYTES, greedy
from kvserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from kvserve.core.sampling_params import SamplingParams

# slow: the module's shared engine or servers take most of its time (make test-slow).
pytestmark = [pytest.mark.model, pytest.mark.slow]


def draft_spec(model_path: str) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=model_path, num_speculative_tokens=4,
                             quantization="int8")


@pytest.fixture(scope="module")
def draft_engine(engine_loop, default_model_path):
    return engine_loop.get(scheduler=SchedulerConfig(speculative=draft_spec(str(default_model_path))))


@pytest.fixture(scope="module")
def tight_draft_engine(engine_loop, default_model_path):
    """16-token steps (chunked prefill) and 24 KV blocks (preemption)."""
    return engine_loop.get(cache=CacheConfig(kv_cache_memory=24 * BLOCK_BYTES),
                           scheduler=SchedulerConfig(max_num_batched_tokens=16,
                                                     speculative=draft_spec(str(default_model_path))))


def test_golden_and_repetitive_prompts_equal_plain_decoding(default_engine, draft_engine):
    cases = golden_cases()
    assert cases, "the golden cases are required"

    async def together():  # all speculate: their drafts are accepted, so none switches off
        return await asyncio.gather(*(draft_engine.agenerate(
            case["prompt_token_ids"], greedy(case["case"]["max_tokens"])) for case in cases))
    for case, output in zip(cases, draft_engine.run(together())):  # vs transformers' output
        assert output.only.token_ids == case["output_token_ids"], case["case"]["name"]
    for prompt in repetitive_prompts(draft_engine):
        assert draft_engine.generate(prompt, greedy(MAX_TOKENS)).only.token_ids == \
            default_engine.reference_tokens(prompt, greedy(MAX_TOKENS))
    drafted = spec_metric(draft_engine, "spec_decode_num_draft_tokens")
    accepted = spec_metric(draft_engine, "spec_decode_num_accepted_tokens")
    # The int8 draft agrees with the float model on most greedy tokens; a draft
    # K/V cache out of step with the tokens (a wrong slot, a skipped catch-up)
    # would drop this far lower.
    assert drafted > 0 and accepted / drafted > 0.8, (accepted, drafted)
    draft_engine.assert_all_blocks_free()


def test_batched_with_requests_that_do_not_speculate(default_engine, draft_engine):
    assert_batched_equals_alone(
        draft_engine, default_engine.reference_tokens)


def test_chunked_prefill_and_preemption_in_between(default_engine, tight_draft_engine):
    unique = repetitive_prompts(tight_draft_engine)
    params = greedy(MAX_TOKENS, ignore_eos=True)
    batched = tight_draft_engine.generate_all(unique * 2, params)
    expected = [default_engine.reference_tokens(p, params) for p in unique]
    assert [r.only.token_ids for r in batched] == expected * 2
    assert tight_draft_engine.engine.scheduler.total_preemptions > 0, \
        "test precondition: the small cache preempted"
    assert spec_metric(tight_draft_engine, "spec_decode_num_accepted_tokens") > 0
    tight_draft_engine.assert_all_blocks_free()


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(default_engine,
                                                                           draft_engine):
    """Seeded requests get argmax drafts verified as n-gram ones: one uniform
    per emitted token, so the draft model does not change their tokens."""
    before = spec_metric(draft_engine, "spec_decode_num_accepted_tokens")
    for i, prompt in enumerate(repetitive_prompts(draft_engine)):
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=MAX_TOKENS)
        assert draft_engine.generate(prompt, params).only.token_ids == \
            default_engine.reference_tokens(prompt, params)
    assert spec_metric(draft_engine, "spec_decode_num_accepted_tokens") > before


def test_unseeded_sampling_runs_rejection_sampling_and_frees_every_block(draft_engine):
    before = spec_metric(draft_engine, "spec_decode_num_accepted_tokens")
    prompts = repetitive_prompts(draft_engine)
    params = SamplingParams(temperature=0.7, top_k=50, max_tokens=MAX_TOKENS, ignore_eos=True)
    results = draft_engine.generate_all(prompts, params)
    assert all(len(r.only.token_ids) == MAX_TOKENS for r in results)
    # q close to p: rejection sampling accepts most drafts (1 - TV(p, q) each)
    assert spec_metric(draft_engine, "spec_decode_num_accepted_tokens") > before
    draft_engine.assert_all_blocks_free()

