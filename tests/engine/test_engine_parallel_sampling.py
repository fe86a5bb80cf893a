"""``n=3`` with a seed: three different samples, reproducible, and the prompt's
full blocks computed and held once for all three."""

from __future__ import annotations

import pytest

from engine_harness import BLOCK, TEXTS, full_block_tokens
from kvserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.model

N = 3
MAX_TOKENS = 12


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(n=N, temperature=0.8, seed=seed, max_tokens=MAX_TOKENS)


def test_n3_seeded_samples_share_prompt_blocks(default_engine):
    prompt = default_engine.encode("Parallel sampling. " + TEXTS["samples"] + " " + TEXTS["repeat"])
    num_shared = full_block_tokens(len(prompt))
    assert num_shared >= 2 * BLOCK
    kv = default_engine.kv
    before = (kv.stats.requests, kv.stats.queries, kv.stats.hits)

    with default_engine.record_steps() as steps:
        first = default_engine.generate(prompt, sampled(1234))
    assert first.failed is None
    assert first.accepted is not None and list(first.accepted.prompt_token_ids) == prompt
    assert sorted(first.samples) == [0, 1, 2]
    for sample in first.samples.values():
        assert sample.finish_reason in ("stop", "length")
        assert 0 < len(sample.token_ids) <= MAX_TOKENS
    texts = [first.samples[i].text for i in range(N)]
    assert len(set(texts)) > 1, texts

    # Block accounting: one prefix-cache query per sample; the first admitted
    # computes the prompt, the other two hit all its full blocks.
    requests, queries, hits = (kv.stats.requests - before[0], kv.stats.queries - before[1],
                               kv.stats.hits - before[2])
    assert (requests, queries, hits) == (N, N * len(prompt), (N - 1) * num_shared)
    cached = sorted(s.num_cached_tokens[-1] for s in first.samples.values())
    assert cached == [0, num_shared, num_shared]
    # The same physical blocks sit at the head of the three block tables, and
    # only one sample computes the prompt's shared part.
    tables, computed_from = {}, {}
    for step in steps:
        for s in step.scheduled:
            if s.is_new:
                tables[s.request_id] = s.new_block_ids  # the whole table when new
                computed_from[s.request_id] = s.start_position
    assert sorted(tables) == [f"{first.request_id}-{i}" for i in range(N)]
    assert len({t[:num_shared // BLOCK] for t in tables.values()}) == 1
    assert sorted(computed_from.values()) == [0, num_shared, num_shared]
    default_engine.assert_all_blocks_free()

    # Same seed, same three texts (each sample i uses seed + i), now with the
    # whole prompt cached for all three.
    before_hits = kv.stats.hits
    again = default_engine.generate(prompt, sampled(1234))
    assert {i: s.text for i, s in again.samples.items()} == dict(enumerate(texts))
    assert {i: s.token_ids for i, s in again.samples.items()} == {
        i: s.token_ids for i, s in first.samples.items()}
    assert kv.stats.hits - before_hits == N * num_shared
    default_engine.assert_all_blocks_free()

    # Another seed gives other samples.
    other = default_engine.generate(prompt, sampled(4321))
    assert [other.samples[i].text for i in range(N)] != texts
    default_engine.assert_all_blocks_free()
