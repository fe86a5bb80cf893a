"""Every KV block is free again after requests end early: aborted mid-prefill,
aborted while decoding (n=3), or finished by a stop string."""

from __future__ import annotations

import asyncio
import time

import pytest

from deadlines import hang_message
from engine_harness import STEP_TIMEOUT_S, TEXTS, greedy
from kvserve.config import SchedulerConfig
from kvserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def budget16_engine(engine_loop):
    return engine_loop.get(scheduler=SchedulerConfig(max_num_batched_tokens=16))


def test_abort_during_chunked_prefill_frees_blocks(budget16_engine):
    engine = budget16_engine
    prompt = engine.encode("Abort me. " + TEXTS["chunked"])[:200]

    async def scenario():
        task = asyncio.ensure_future(engine.agenerate(prompt, greedy(8), "abort-prefill"))
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while True:
            request = engine.scheduler.get_request("abort-prefill")
            if request is not None and request.num_computed_tokens >= 64:
                break
            assert time.monotonic() < deadline, hang_message("the prefill did not reach 64 tokens",
                                                             STEP_TIMEOUT_S)
            await asyncio.sleep(0.005)
        assert request.num_computed_tokens < len(prompt)
        await engine.engine.abort("abort-prefill")
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while engine.scheduler.get_request("abort-prefill") is not None:  # freed at its step
            assert time.monotonic() < deadline, hang_message(
                "the aborted request was not finished", STEP_TIMEOUT_S)
            await asyncio.sleep(0.005)
        task.cancel()

    engine.run(scenario())
    engine.assert_all_blocks_free()


def test_abort_n3_while_decoding_frees_blocks(default_engine):
    engine = default_engine
    prompt = engine.encode("Abort the samples. " + TEXTS["samples"] + " " + TEXTS["repeat"])
    params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=200, ignore_eos=True)

    async def scenario():
        task = asyncio.ensure_future(engine.agenerate(prompt, params, "abort-n3"))
        while True:
            live = [engine.scheduler.get_request(f"abort-n3-{i}") for i in range(3)]
            if all(r is not None and r.num_output_tokens >= 2 for r in live):
                break
            await asyncio.sleep(0.005)
        await engine.engine.abort("abort-n3")
        await asyncio.sleep(0.2)
        task.cancel()

    engine.run(scenario())
    engine.assert_all_blocks_free()


def test_stop_string_frees_blocks(default_engine):
    engine = default_engine
    prompt = engine.encode("Stop string. " + TEXTS["repeat"])
    full = engine.generate(prompt, greedy(10, ignore_eos=True)).only
    words = full.text.split()
    assert len(words) >= 4, full.text
    stop = words[2]
    stopped = engine.generate(prompt, greedy(10, ignore_eos=True, stop=(stop,))).only
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text
    assert full.text.startswith(stopped.text)
    engine.assert_all_blocks_free()


def test_a_stop_token_with_the_next_step_in_flight_streams_nothing_extra(default_engine):
    """Async scheduling: the step after the stop token is already scheduled
    when the token comes back; its extra token is dropped, the stream ends
    at the stop token, and every block is free."""
    engine = default_engine
    prompt = engine.encode("Stop token. " + TEXTS["repeat"])
    full = engine.generate(prompt, greedy(8, ignore_eos=True)).only
    stop_token = full.token_ids[2]
    with engine.record_steps() as steps:
        stopped = engine.generate(prompt, greedy(8, ignore_eos=True,
                                                 stop_token_ids=(stop_token,))).only
    assert stopped.token_ids == full.token_ids[:3] and stopped.finish_reason == "stop"
    holding = [s for s in steps for c in s.scheduled if c.sample]
    assert len(holding) == 4, "the step behind the stop token was not scheduled"
    engine.assert_all_blocks_free()
