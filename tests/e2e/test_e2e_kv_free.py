"""Acceptance: once every request has ended -- however it ended -- every KV
block is free again (cached-free blocks count as free), the block accounting
is consistent, and no request or stream is left behind.

Runs on the shared in-process engine, after whatever the other e2e modules
sent it, with a mix of endings: length, EOS, stop string, client abort
mid-stream, abort before admission, a refused prompt, and ``n = 2``.
"""

from __future__ import annotations

import asyncio

import pytest
from e2e_support import collect, make_request, wait_all_blocks_free

from kvserve.actors.messages import RequestFailed, RequestOutput

pytestmark = pytest.mark.model

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


async def _abort_after_first_output(engine, request) -> int:
    """Read until the first text arrives, then abort like a client that left."""
    seen = 0
    async for event in engine.generate(request):
        if isinstance(event, RequestOutput):
            seen += len(event.token_ids)
            assert event.finish_reason is None, "test precondition: abort before the end"
            break
    await engine.abort(request.request_id)
    return seen


async def _mixed_workload(engine):
    too_long = make_request("kv-too-long", prompt_token_ids=[42] * (engine.max_model_len + 1),
                            max_tokens=4)
    aborted_early = make_request("kv-abort-early", prompt="Tell me a long story.",
                                 max_tokens=64)
    early_stream = engine.generate(aborted_early)
    await engine.abort(aborted_early.request_id)  # before it was even tokenized
    results = await asyncio.gather(
        collect(engine, make_request("kv-length", prompt="The quick brown fox", max_tokens=8)),
        collect(engine, make_request("kv-eos", messages=CHAT, max_tokens=32, logprobs=3)),
        collect(engine, make_request("kv-stop", prompt="Count: 1, 2, 3, 4, 5,", max_tokens=24,
                                     stop=[" 9"])),
        collect(engine, make_request("kv-n2", messages=CHAT, max_tokens=8, n=2,
                                     temperature=0.8, seed=1)),
        _abort_after_first_output(engine, make_request("kv-abort", prompt="Once upon a time",
                                                       max_tokens=200)),
        collect(engine, too_long),
    )
    return results, early_stream


def test_all_kv_blocks_free_after_requests_end(e2e_engine) -> None:
    engine = e2e_engine.engine
    (length, eos, stop, n2, aborted_tokens, too_long), _ = e2e_engine.run(_mixed_workload(engine))

    assert length.finish_reason == "length" and len(length.token_ids) == 8
    assert eos.finish_reason == "stop" and eos.token_ids[-1] == 2
    assert stop.finish_reason == "stop" and " 9" not in stop.text and len(stop.token_ids) < 24
    assert n2.failed is None and n2.finish_reason is not None
    assert aborted_tokens >= 1
    assert isinstance(too_long.failed, RequestFailed) and too_long.failed.status == 400

    snap = e2e_engine.run(wait_all_blocks_free(engine))
    assert snap.usage == 0.0, snap
    assert snap.num_free_blocks == snap.num_blocks, snap
    assert not snap.held, f"requests still holding blocks: {snap.held}"
    assert not snap.num_unfinished, "the scheduler still has unfinished requests"
    free, cached_free, in_use = snap.counts
    assert in_use == 0 and free + cached_free == snap.num_blocks, snap.counts
    assert cached_free > 0, "prefix caching is on: finished prompts stay cached-free"

    async def consistency():
        engine.core.scheduler.kv_cache_manager.check_consistency()
        return len(engine.streams)

    assert e2e_engine.run(consistency()) == 0, "streams left open in the registry"
