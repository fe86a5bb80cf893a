"""Client-chosen request ids never meet the engine's internal sample ids.

``n=2`` under id ``job`` runs as ``job-0`` and ``job-1`` inside the engine; a
second client sending ``X-Request-Id: job-0`` meanwhile must be refused, not
be handed the first request's tokens (a bug a fresh user found).
"""

from __future__ import annotations

import asyncio

import pytest

from engine_harness import greedy

pytestmark = pytest.mark.model


def test_id_of_a_running_sample_is_refused(default_engine):
    engine = default_engine
    prompt = engine.encode("Tell me a story about a lighthouse keeper.")

    async def scenario():
        parent = asyncio.ensure_future(
            engine.agenerate(prompt, greedy(12, n=2, ignore_eos=True), "job"))
        await asyncio.sleep(0)  # "job" is registered before the clashing ids arrive
        clash = await asyncio.gather(
            engine.agenerate(prompt, greedy(4), "job-0"),
            engine.agenerate(prompt, greedy(4, n=2), "job"))  # the same id again
        return await parent, clash

    parent, clash = engine.run(scenario())
    assert all(r.failed is not None and r.failed.status == 400 for r in clash), clash
    assert sorted(parent.samples) == [0, 1]
    assert all(s.num_output_tokens == 12 and s.finish_reason == "length"
               for s in parent.samples.values())
    after = engine.generate(prompt, greedy(3, ignore_eos=True), "job-0")  # free again once "job" ended
    assert after.only.num_output_tokens == 3
    engine.assert_all_blocks_free()
