"""Prefix caching end to end: same greedy outputs with it on and off, and
``num_cached_tokens`` equal to the reused full-block tokens."""

from __future__ import annotations

import pytest

from engine_harness import BLOCK, TEXTS, full_block_tokens, greedy

pytestmark = pytest.mark.model

MAX_TOKENS = 8


def run_sequentially(engine, prompts):
    return [engine.generate(p, greedy(MAX_TOKENS)) for p in prompts]


def expected_hits(prompts):
    """Per prompt: the full-block tokens shared with an earlier prompt of the
    list (the longest common token prefix, floored to whole blocks, never
    including the prompt's last token)."""
    hits = []
    for i, prompt in enumerate(prompts):
        best = 0
        for earlier in prompts[:i]:
            common = 0
            while (common < min(len(prompt), len(earlier))
                   and prompt[common] == earlier[common]):
                common += 1
            best = max(best, common)
        hits.append(min(best // BLOCK, (len(prompt) - 1) // BLOCK) * BLOCK)
    return hits


def test_repeated_prompts_same_output_and_cached_tokens(default_engine, no_prefix_engine):
    base = default_engine.encode("Question A. " + TEXTS["repeat"])
    aligned = default_engine.encode("Question B. " + TEXTS["repeat"] * 3)[:48]  # P % 16 == 0
    assert len(base) % BLOCK != 0 and len(base) > BLOCK
    prompts = [base, base, base, aligned, aligned]

    kv = default_engine.kv
    hits0, queries0 = kv.stats.hits, kv.stats.queries
    with_cache = run_sequentially(default_engine, prompts)
    # Without the cache identical prompts are computed identically: run each once.
    unique = run_sequentially(no_prefix_engine, [base, aligned])
    without = [unique[0]] * 3 + [unique[1]] * 2

    for on, off in zip(with_cache, without):
        assert on.only.finish_reason in ("stop", "length")
        assert on.only.token_ids == off.only.token_ids
        assert on.only.text == off.only.text
    # From the second identical request on: the whole prompt's full blocks,
    # the last token recomputed.
    cached = [r.only.num_cached_tokens[-1] for r in with_cache]
    assert cached == [0, full_block_tokens(len(base)), full_block_tokens(len(base)),
                      0, full_block_tokens(len(aligned))]
    assert full_block_tokens(len(aligned)) == len(aligned) - BLOCK
    # Every output of a request carries the same count.
    for r in with_cache:
        assert len(set(r.only.num_cached_tokens)) == 1
    assert kv.stats.hits - hits0 == sum(cached)
    assert kv.stats.queries - queries0 == sum(len(p) for p in prompts)
    for r in without:
        assert r.only.num_cached_tokens == [0] * len(r.only.num_cached_tokens)
    assert no_prefix_engine.kv.stats.hits == 0

    default_engine.assert_all_blocks_free()
    no_prefix_engine.assert_all_blocks_free()


@pytest.mark.slow
def test_shared_long_prefix_different_suffixes(default_engine, no_prefix_engine):
    prefix = default_engine.encode(TEXTS["long_prefix"])
    assert len(prefix) >= 200
    questions = ["Can I borrow fifteen books at once?",
                 "When is the chess evening?",
                 "Is the library open on Sunday?"]
    prompts = [prefix + default_engine.encode("Question: " + q + "\nAnswer:") for q in questions]
    assert len({tuple(p[len(prefix):len(prefix) + 3]) for p in prompts}) > 1

    with_cache = run_sequentially(default_engine, prompts)
    without = run_sequentially(no_prefix_engine, prompts)

    for on, off in zip(with_cache, without):
        assert on.only.token_ids == off.only.token_ids, (on.only.text, off.only.text)
        assert on.only.text == off.only.text
    cached = [r.only.num_cached_tokens[-1] for r in with_cache]
    expected = expected_hits(prompts)
    assert cached == expected
    assert cached[0] == 0 and all(c >= (len(prefix) // BLOCK) * BLOCK for c in cached[1:])
    assert all(c > 0 for c in cached[1:])

    default_engine.assert_all_blocks_free()
    no_prefix_engine.assert_all_blocks_free()


def test_concurrent_identical_prompts_share_blocks(default_engine, no_prefix_engine):
    """Identical prompts submitted at once: the first admitted computes the
    prompt, the others reuse its blocks (registered when scheduled), and all
    outputs equal the uncached one."""
    prompt = default_engine.encode("Concurrent. " + TEXTS["repeat"] + " Keep it short.")
    reference = no_prefix_engine.generate(prompt, greedy(MAX_TOKENS))
    with default_engine.record_steps() as steps:
        results = default_engine.generate_all([prompt] * 3, greedy(MAX_TOKENS))
    for r in results:
        assert r.only.token_ids == reference.only.token_ids
    cached = sorted(r.only.num_cached_tokens[-1] for r in results)
    assert cached == [0, full_block_tokens(len(prompt)), full_block_tokens(len(prompt))]
    # The shared full blocks are the same physical blocks in every block table.
    num_shared = full_block_tokens(len(prompt)) // BLOCK
    tables = {}
    for step in steps:
        for s in step.scheduled:
            if s.is_new:  # the whole block table comes with a new request
                tables.setdefault(s.request_id, s.new_block_ids)
    assert len(tables) == 3
    assert len({t[:num_shared] for t in tables.values()}) == 1

    default_engine.assert_all_blocks_free()
