"""Acceptance (issue 17): greedy output with n-gram speculative decoding
equals the output without it, token for token -- on the golden prompts and
repetitive ones, alone and batched with requests that do not speculate,
with chunked prefill and with preemption in between -- and no KV block
leaks; a seeded sampled request draws the same tokens. The reference is the
default engine's plain decoding."""

from __future__ import annotations

import asyncio

import pytest
from golden import golden_cases

from engine_harness import BLOCK_BYTES, TEXTS, greedy
from kvserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from kvserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.model

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def spec_engine(engine_loop):
    return engine_loop.get(scheduler=SchedulerConfig(speculative=SPEC))


@pytest.fixture(scope="module")
def tight_spec_engine(engine_loop):
    """16-token steps (chunked prefill) and 16 KV blocks (preemption)."""
    return engine_loop.get(cache=CacheConfig(kv_cache_memory=16 * BLOCK_BYTES),
                           scheduler=SchedulerConfig(max_num_batched_tokens=16, speculative=SPEC))


def repetitive_prompts(engine) -> list[list[int]]:
    code = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
            "def mul(a, b):\n    return a * b\n\n\ndef ")
    return [engine.encode(code),
            engine.encode("Repeat after me: " + TEXTS["repeat"] + " Again: " + TEXTS["repeat"]),
            engine.encode("one two three four, one two three four, one two three")]


def plain(engine, prompts, max_tokens=MAX_TOKENS):
    return [engine.generate(p, greedy(max_tokens)).only.token_ids for p in prompts]


def spec_metric(engine, name: str) -> float:
    text = engine.engine.metrics.render().decode()
    line = next(l for l in text.splitlines() if l.startswith(f"kvserve:{name}_total{{"))
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.slow
def test_golden_and_repetitive_prompts_equal_plain_decoding(default_engine, spec_engine):
    cases = golden_cases()
    assert cases, "the golden cases are required"
    for case in cases:  # alone: always speculating; the reference is transformers' output
        output = spec_engine.generate(case["prompt_token_ids"], greedy(case["case"]["max_tokens"]))
        assert output.only.token_ids == case["output_token_ids"], case["case"]["name"]
    prompts = repetitive_prompts(spec_engine)
    assert plain(spec_engine, prompts) == \
        [default_engine.reference_tokens(p, greedy(MAX_TOKENS)) for p in prompts]
    assert spec_metric(spec_engine, "spec_decode_num_accepted_tokens") > 0
    spec_engine.assert_all_blocks_free()


def assert_batched_equals_alone(engine, reference) -> None:
    """The repetitive prompts, each plain, with a presence penalty and with
    logprobs (the last two never speculate), all in one batch on ``engine``,
    give ``reference(prompt, params)``'s tokens; no block leaks."""
    prompts = repetitive_prompts(engine)
    params = [greedy(MAX_TOKENS), greedy(MAX_TOKENS, presence_penalty=0.5),
              greedy(MAX_TOKENS, logprobs=1)]

    async def together():
        return await asyncio.gather(*(engine.agenerate(p, q) for p in prompts for q in params))
    batched = engine.run(together())
    assert [r.only.token_ids for r in batched] == \
        [reference(p, q) for p in prompts for q in params]
    engine.assert_all_blocks_free()


@pytest.mark.slow
def test_batched_with_requests_that_do_not_speculate(default_engine, spec_engine):
    assert_batched_equals_alone(spec_engine, default_engine.reference_tokens)


@pytest.mark.slow
def test_chunked_prefill_and_preemption_in_between(default_engine, tight_spec_engine):
    prompts = repetitive_prompts(tight_spec_engine) * 3  # about 36 blocks at the end
    params = greedy(MAX_TOKENS, ignore_eos=True)
    batched = tight_spec_engine.generate_all(prompts, params)
    assert [r.only.token_ids for r in batched] == \
        [default_engine.reference_tokens(p, params) for p in prompts]
    assert tight_spec_engine.engine.scheduler.total_preemptions > 0, \
        "test precondition: the small cache preempted"
    assert spec_metric(tight_spec_engine, "spec_decode_num_drafts") > 0
    tight_spec_engine.assert_all_blocks_free()


@pytest.mark.slow
def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(default_engine,
                                                                           spec_engine):
    """One uniform per emitted token: a seeded request samples as without speculation."""
    for i, prompt in enumerate(repetitive_prompts(spec_engine)):
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=MAX_TOKENS)
        assert spec_engine.generate(prompt, params).only.token_ids == \
            default_engine.reference_tokens(prompt, params)
    assert spec_metric(spec_engine, "spec_decode_num_accepted_tokens") > 0
