"""Acceptance (issue 4): beyond the waiting-queue limits requests get 429 with
``Retry-After`` and an OpenAI error body, before any compute; the accepted
ones all complete. HTTP against a live ``kvserve serve --max-waiting-requests
2 --max-num-seqs 1``, plus in-process checks of both limits.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from deadlines import HANG_DEADLINE_S
from e2e_support import LiveServer
from sched_support import (PROMPT, HTTPRecord, assert_error_body, chat_body, greedy,
                           sse_stream, submit, wait_until)

from kvserve.config import SchedulerConfig
from kvserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.model

MAX_WAITING = 2


@pytest.fixture(scope="module")
def limited_server(default_model_path, tmp_path_factory):
    server = LiveServer(default_model_path, tmp_path_factory.mktemp("kvserve-backpressure"),
                        extra_args=["--max-num-seqs", "1", "--max-waiting-requests",
                                    str(MAX_WAITING), "--max-model-len", "512"])
    yield server
    server.stop()


@pytest.mark.slow
def test_http_beyond_waiting_limit_429_with_retry_after_accepted_complete(limited_server):
    async def go():
        async with httpx.AsyncClient(base_url=limited_server.base_url,
                                     timeout=httpx.Timeout(HANG_DEADLINE_S, connect=60.0)) as client:
            running = asyncio.Event()
            tasks = [asyncio.ensure_future(sse_stream(client, chat_body(PROMPT, 60), name="run",
                                                      first_content=running))]
            await wait_until(running.is_set, "the running request streaming")
            # Fill the waiting queue one request at a time: a streaming answer's
            # status comes once the request was admitted (or refused).
            for i in range(MAX_WAITING):
                answered, record = asyncio.Event(), HTTPRecord(f"wait-{i}")
                tasks.append(asyncio.ensure_future(sse_stream(
                    client, chat_body(f"{PROMPT} ({i})", 8), accepted=answered, record=record)))
                await wait_until(answered.is_set, f"wait-{i} answered")
                assert record.status == 200, (record, "waiting request refused")
            refused_stream = [await sse_stream(client, chat_body(PROMPT, 8), name=f"over-{i}")
                              for i in range(2)]
            refused_plain = await client.post("/v1/chat/completions",
                                              json=chat_body(PROMPT, 8, stream=False))
            accepted = await asyncio.gather(*tasks)
            after = await sse_stream(client, chat_body(PROMPT, 4), name="after")
            return accepted, refused_stream, refused_plain, after

    accepted, refused_stream, refused_plain, after = asyncio.run(go())
    for record in refused_stream:
        assert record.status == 429, record
        assert int(record.headers["retry-after"]) >= 1, record.headers
        error = assert_error_body(record.body, 429)
        assert "--max-waiting-requests" in error["message"], error
        assert error["code"] == "too_many_requests"
    assert refused_plain.status_code == 429, refused_plain.text
    assert int(refused_plain.headers["retry-after"]) >= 1
    assert_error_body(refused_plain.json(), 429)
    for record in accepted:  # the running one and the waiting ones, all in full
        assert record.status == 200 and record.done and not record.errors, record
        assert record.finish_reason == "length", record
        assert record.usage["completion_tokens"] == (60 if record.name == "run" else 8)
    assert after.status == 200 and after.done, after  # the 429s were only while full
    limited_server.assert_alive()


# --------------------------------------------------------------------------- in-process

LIMITED = SchedulerConfig(max_num_seqs=1, max_waiting_requests=MAX_WAITING,
                          max_waiting_tokens=300)


async def _with_one_running(handle, tag, then):
    """Start a long request, wait until it runs, then ``await then()``."""
    ids = handle.encode(PROMPT)
    long, long_task = submit(handle.engine, f"{tag}-long", ids, greedy(40))
    await wait_until(lambda: long.first_output_at is not None, "long request running")
    result = await then()
    await long_task
    return long, result


@pytest.mark.slow
def test_waiting_tokens_limit_429_names_the_flag(sched_loop):
    handle = sched_loop.get(scheduler=LIMITED)
    prompt = handle.encode(PROMPT * 20)[:200]  # 200 prompt tokens; limit 300

    async def then():
        first, first_task = submit(handle.engine, "tok-first", prompt, greedy(2))
        await wait_until(lambda: handle.engine.load.num_waiting == 1, "first one waiting")
        second, second_task = submit(handle.engine, "tok-second", prompt, greedy(2))
        await asyncio.gather(first_task, second_task)
        return first, second

    long, (first, second) = handle.run(_with_one_running(handle, "tok", then))
    assert first.failed is None and first.finish_reason == "length"
    assert second.failed is not None and second.failed.status == 429, second
    assert "--max-waiting-tokens" in second.failed.message
    assert second.failed.retry_after and second.failed.retry_after > 0
    assert not second.token_ids
    handle.assert_all_blocks_free()


def test_burst_does_not_exceed_waiting_limit(sched_loop):
    handle = sched_loop.get(scheduler=LIMITED)
    ids = handle.encode(PROMPT)

    async def then():
        burst = [submit(handle.engine, f"burst-{i}", ids, greedy(2)) for i in range(6)]
        await asyncio.gather(*(task for _, task in burst))
        return [record for record, _ in burst]

    long, burst = handle.run(_with_one_running(handle, "burst", then))
    admitted = [r for r in burst if r.failed is None]
    refused = [r for r in burst if r.failed is not None]
    assert all(r.failed.status == 429 for r in refused), refused
    assert len(admitted) == MAX_WAITING, \
        f"{len(admitted)} of a burst of 6 admitted with --max-waiting-requests {MAX_WAITING}"


def test_a_request_that_can_never_wait_gets_a_400_not_a_429(sched_loop):
    """Issue 14, item 4, on an idle engine: the prompt alone exceeds
    --max-waiting-tokens, or n alone exceeds --max-waiting-requests. A 429
    (retry later) could never succeed, so both get a 400 naming the flag."""
    handle = sched_loop.get(scheduler=LIMITED)
    long_prompt = (handle.encode(PROMPT * 40))[:400]  # 400 tokens; limit 300
    assert len(long_prompt) == 400

    async def run():
        too_long, long_task = submit(handle.engine, "never-long", long_prompt, greedy(2))
        params = SamplingParams(n=MAX_WAITING + 1, temperature=0.0, max_tokens=2)
        too_many, many_task = submit(handle.engine, "never-many", handle.encode(PROMPT), params)
        await asyncio.gather(long_task, many_task)
        return too_long, too_many

    too_long, too_many = handle.run(run())
    assert too_long.failed is not None and too_long.failed.status == 400, too_long
    assert "--max-waiting-tokens 300" in too_long.failed.message
    assert too_many.failed is not None and too_many.failed.status == 400, too_many
    assert too_many.failed.param == "n" and "--max-waiting-requests" in too_many.failed.message
    handle.assert_all_blocks_free()
