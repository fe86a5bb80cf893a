"""Chunked prefill under a 16-token budget: decodes of other requests advance
every step while a long prompt prefills, and the output equals the unchunked
output."""

from __future__ import annotations

import asyncio
import time

import pytest

from deadlines import hang_message
from engine_harness import STEP_TIMEOUT_S, TEXTS, greedy
from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.scheduler import Scheduler

BUDGET = 16
LONG = 300
FAKE_TOKEN = 1000  # what the fake runner "samples" for every sampling request


class FakeRunner:
    """Stands in for the model: one fixed token per sampling request; checks
    that each chunk starts where the request's previous one ended."""

    def __init__(self) -> None:
        self.next_position: dict[str, int] = {}

    def execute(self, output):
        sampled = {}
        for s in output.scheduled:
            if s.is_new:
                self.next_position[s.request_id] = s.start_position
            assert s.start_position == self.next_position[s.request_id], s
            self.next_position[s.request_id] += s.num_tokens
            if s.sample:
                sampled[s.request_id] = [FAKE_TOKEN]
        return sampled


@pytest.mark.parametrize("caching", [True, False])
def test_decodes_advance_every_step_while_long_prompt_prefills(caching):
    kv = KVCacheManager(num_blocks=64, block_size=16, enable_prefix_caching=caching)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=BUDGET), kv, 16)
    runner = FakeRunner()

    def step():
        out = sched.schedule()
        updates = sched.update_from_output(out, runner.execute(out))
        kv.check_consistency()
        return out, {u.request_id: u for u in updates}

    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    sched.add_request(Request("decode", list(range(10, 22)), params, eos_token_ids=(2,)))
    out, updates = step()  # its whole 12-token prompt fits the budget
    assert updates["decode"].new_token_ids == (FAKE_TOKEN,)

    sched.add_request(Request("long", list(range(100, 100 + LONG)), params, eos_token_ids=(2,)))
    chunks = []
    decode_tokens = 1
    while True:
        out, updates = step()
        by_id = {s.request_id: s for s in out.scheduled}
        assert out.num_batched_tokens <= BUDGET
        # The decode request advances by one token in every step ...
        assert by_id["decode"].num_tokens == 1
        assert by_id["decode"].sample
        assert out.scheduled[0].request_id == "decode"  # decodes first
        assert out.num_decode_tokens == 1
        assert updates["decode"].new_token_ids == (FAKE_TOKEN,)
        decode_tokens += 1
        # ... while the long prompt gets the rest of the budget.
        long = by_id["long"]
        assert long.num_tokens == min(BUDGET - 1, LONG - long.start_position)
        assert long.start_position == sum(chunks)
        chunks.append(long.num_tokens)
        if long.sample:
            assert sum(chunks) == LONG
            assert updates["long"].new_token_ids == (FAKE_TOKEN,)
            break
        assert "long" not in updates
    assert len(chunks) == -(-LONG // (BUDGET - 1)) == 20
    assert decode_tokens == 1 + len(chunks)
    # Then both decode side by side.
    out, updates = step()
    assert sorted(s.num_tokens for s in out.scheduled) == [1, 1]
    sched.finish_requests(["decode", "long"], RequestStatus.FINISHED_ABORTED)
    assert kv.usage == 0
    kv.check_consistency()


@pytest.fixture(scope="module")
def budget16_engine(engine_loop):
    return engine_loop.get(scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET))


@pytest.mark.model
@pytest.mark.slow
def test_budget_16_output_equals_unchunked(budget16_engine, default_engine):
    text = TEXTS["chunked"] * 2
    long_prompt = budget16_engine.encode(text)[:LONG]
    short_prompt = budget16_engine.encode("Name three colours of the rainbow.")
    assert len(long_prompt) == LONG
    long_params, short_params = greedy(8), greedy(32, ignore_eos=True)

    async def scenario(engine):
        """Start the short request, wait until it decodes, then send the long one."""
        short_task = asyncio.ensure_future(engine.agenerate(short_prompt, short_params))
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while not engine.scheduler.requests or any(
                r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
            assert time.monotonic() < deadline, hang_message("the short request did not decode",
                                                             STEP_TIMEOUT_S)
            await asyncio.sleep(0.005)
        long_result = await engine.agenerate(long_prompt, long_params)
        return long_result, await short_task

    with budget16_engine.record_steps() as steps:
        chunked_long, chunked_short = budget16_engine.run(scenario(budget16_engine))
    reference_long, reference_short = default_engine.run(scenario(default_engine))

    assert chunked_long.only.token_ids == reference_long.only.token_ids
    assert chunked_long.only.text == reference_long.only.text
    assert chunked_short.only.token_ids == reference_short.only.token_ids
    assert chunked_short.only.finish_reason == "length"

    # In the real engine too: every step that carried a chunk of the long
    # prompt also carried a decode of the short request while it was live.
    long_id, short_id = chunked_long.request_id, chunked_short.request_id
    prefill_steps = [st for st in steps
                     if any(s.request_id == long_id and s.start_position < LONG
                            for s in st.scheduled)]
    assert len(prefill_steps) >= LONG // BUDGET
    short_done = max(i for i, st in enumerate(steps)
                     if any(s.request_id == short_id for s in st.scheduled))
    assert steps.index(prefill_steps[-1]) < short_done  # short outlived the prefill
    for st in prefill_steps:
        assert st.num_batched_tokens <= BUDGET
        decode = [s for s in st.scheduled if s.request_id == short_id]
        assert len(decode) == 1 and decode[0].num_tokens == 1, st.scheduled

    budget16_engine.assert_all_blocks_free()
    default_engine.assert_all_blocks_free()


@pytest.mark.model
def test_budget_16_identical_prompts_share_prefill(budget16_engine, default_engine):
    """Two identical long prompts at once under a 16-token budget: the second
    waits for budget, then reuses the first's full blocks; same outputs as
    the unchunked engine."""
    prompt = budget16_engine.encode("Twice. " + TEXTS["chunked"])[:LONG - 20]
    params = greedy(6)
    results = budget16_engine.generate_all([prompt, prompt], params)
    reference = default_engine.generate(prompt, params)
    for r in results:
        assert r.only.token_ids == reference.only.token_ids
    cached = [r.only.num_cached_tokens[-1] for r in results]
    assert cached[0] == 0
    assert cached[1] == ((len(prompt) - 1) // 16) * 16
    budget16_engine.assert_all_blocks_free()
    default_engine.assert_all_blocks_free()
