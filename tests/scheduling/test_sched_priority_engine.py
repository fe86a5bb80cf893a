"""Acceptance (issue 4), in-process: priority order with one sequence slot,
priority preemption, and aging under a steady stream of high-priority work.

Order is the order of completion events of the request streams; nothing is
timed absolutely: the aging tests are bounded by arrival times relative to
the low-priority request, not by a wall-clock budget.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from deadlines import HANG_DEADLINE_S, hang_message
from sched_support import PROMPT, completion_order, greedy, submit, wait_until

from kvserve.config import SchedulerConfig

pytestmark = pytest.mark.model

LONG_TOKENS = 60
SHORT_TOKENS = 8
LOW = 5


@pytest.fixture(scope="module")
def priority_engine(sched_loop):
    return sched_loop.get(scheduler=SchedulerConfig(max_num_seqs=1, policy="priority"))


@pytest.fixture(scope="module")
def fcfs_engine(sched_loop):
    return sched_loop.get(scheduler=SchedulerConfig(max_num_seqs=1, policy="fcfs"))


@pytest.fixture(scope="module")
def aging_engine(sched_loop):
    return sched_loop.get(scheduler=SchedulerConfig(max_num_seqs=1, policy="priority",
                                                    priority_aging_seconds=AGING_S))


async def _urgent_after_queue(handle, low: int, tag: str):
    """A long low-priority request runs, five more wait, then a priority-0
    request arrives. Returns (long, waiting lows, urgent, num preemptions)."""
    engine, sched = handle.engine, handle.scheduler
    ids = handle.encode(PROMPT)
    preempted_before = handle.engine.scheduler.total_preemptions
    long, long_task = submit(engine, f"{tag}-long", ids, greedy(LONG_TOKENS), low)
    await wait_until(lambda: long.first_output_at is not None, "long request running")
    lows = [submit(engine, f"{tag}-low-{i}", ids, greedy(SHORT_TOKENS), low) for i in range(5)]
    await wait_until(lambda: engine.load.num_waiting == 5, "five low-priority requests waiting")
    assert sched.num_running == 1 and sched.get_request(long.request_id) is not None
    urgent, urgent_task = submit(engine, f"{tag}-urgent", ids, greedy(SHORT_TOKENS), 0)
    await asyncio.gather(long_task, urgent_task, *(task for _, task in lows))
    return (long, [t for t, _ in lows], urgent,
            handle.engine.scheduler.total_preemptions - preempted_before)


def _check_all_complete(records):
    for r in records:
        assert r.accepted and r.failed is None, r
        assert r.finish_reason == "length", r
        assert len(r.token_ids) == (LONG_TOKENS if r.request_id.endswith("-long")
                                    else SHORT_TOKENS), r


@pytest.mark.slow
def test_priority_zero_finishes_before_every_waiting_low_priority(priority_engine):
    long, lows, urgent, preemptions = priority_engine.run(
        _urgent_after_queue(priority_engine, LOW, "prio"))
    _check_all_complete([long, *lows, urgent])
    order = completion_order([long, *lows, urgent])
    for low in lows:  # all five were still waiting when the urgent one arrived
        assert urgent.done_at < low.done_at, order
    # Preemption (a better waiting request takes the only slot from the long
    # one), and the preempted request keeps its place ahead of later arrivals
    # of the same priority.
    assert preemptions >= 1
    assert order == [urgent.request_id, long.request_id, *(low.request_id for low in lows)]
    priority_engine.assert_all_blocks_free()


@pytest.mark.slow
def test_fcfs_priority_zero_request_finishes_last(fcfs_engine):
    long, lows, urgent, preemptions = fcfs_engine.run(
        _urgent_after_queue(fcfs_engine, 0, "fcfs"))  # non-zero priority is a 400 under fcfs
    _check_all_complete([long, *lows, urgent])
    order = completion_order([long, *lows, urgent])
    assert order[-1] == urgent.request_id, order
    assert order == [long.request_id, *(low.request_id for low in lows), urgent.request_id]
    assert preemptions == 0
    fcfs_engine.assert_all_blocks_free()


def test_fcfs_engine_refuses_non_zero_priority_naming_the_flag(fcfs_engine):
    async def go():
        tracked, task = submit(fcfs_engine.engine, "fcfs-prio-3", [1, 2, 3], greedy(2), 3)
        return await task
    result = fcfs_engine.run(go())
    assert result.failed is not None and result.failed.status == 400, result
    assert "--scheduling-policy priority" in result.failed.message
    assert result.failed.param == "priority"
    assert not result.token_ids


# --------------------------------------------------------------------------- aging
#
# Aging every S = 0.5 s, a priority-2 request that arrived at tL sorts ahead of
# every priority-0 request that arrives after tL + 2 x 0.5 s. The tests are
# bounded by that event, not by a wall-clock budget, so a slow or shared
# machine changes how long they take, not what they see.

AGING_S = 0.5
AGED_LOW = 2
CROSSOVER_S = AGED_LOW * AGING_S + 0.05  # arrivals after tL + this sort behind "low"
OUTSTANDING_HIGH = 4  # priority-0 requests kept submitted-and-unfinished
MAX_FEED_S = HANG_DEADLINE_S  # a hang deadline only


async def _feed_high_while_low_waits(handle, tag: str, enough):
    """Keep ``OUTSTANDING_HIGH`` priority-0 requests in the engine; a
    low-priority request arrives once that stream runs. Feeding stops when
    ``enough(low, late_highs)`` (``late_highs``: those that arrived more than
    ``CROSSOVER_S`` after it). Returns (low, late highs, all highs)."""
    engine = handle.engine
    ids = handle.encode(PROMPT)
    highs, tasks = [], []

    def top_up():
        while sum(1 for h in highs if h.done_at is None) < OUTSTANDING_HIGH:
            h, task = submit(engine, f"{tag}-high-{len(highs)}", ids, greedy(4), 0)
            highs.append(h)
            tasks.append(task)

    top_up()
    await wait_until(lambda: highs[0].first_output_at is not None, "high stream running")
    low, low_task = submit(engine, f"{tag}-low", ids, greedy(4), AGED_LOW)

    def late():
        return [h for h in highs if h.submitted_at > low.submitted_at + CROSSOVER_S]

    deadline = time.monotonic() + MAX_FEED_S
    while not enough(low, late()):
        assert time.monotonic() < deadline, hang_message(
            "feeding did not reach its end condition", MAX_FEED_S)
        top_up()
        await asyncio.sleep(0.005)
    snapshot = (low.first_output_at, [h.first_output_at for h in late()])
    await asyncio.gather(low_task, *tasks)  # feeding stopped: everything drains
    return low, late(), highs, snapshot


@pytest.mark.slow
def test_aging_lets_low_priority_run_under_a_stream_of_high_priority(aging_engine):
    def enough(low, late_highs):  # it started, or a later arrival overtook it (failure)
        return low.first_output_at is not None or any(
            h.first_output_at is not None for h in late_highs)

    low, late_highs, highs, (low_first, late_firsts) = aging_engine.run(
        _feed_high_while_low_waits(aging_engine, "aging", enough))
    assert low_first is not None, \
        f"with --priority-aging-seconds {AGING_S} a priority-0 request that arrived more " \
        f"than {CROSSOVER_S} s after the priority-{AGED_LOW} one was served before it"
    assert all(t is None for t in late_firsts)
    assert all(h.first_output_at > low.first_output_at for h in late_highs)
    # It did wait: high-priority work that was queued with it went first.
    assert any(h.done_at < low.first_output_at for h in highs
               if h.submitted_at > highs[0].submitted_at)
    assert low.finish_reason == "length"
    aging_engine.assert_all_blocks_free()


@pytest.mark.slow
def test_without_aging_low_priority_waits_while_high_priority_keeps_coming(priority_engine):
    def enough(low, late_highs):  # well past the point where aging would have let it run
        return low.first_output_at is not None or sum(
            1 for h in late_highs if h.done_at is not None) >= 3

    low, late_highs, highs, (low_first, _) = priority_engine.run(
        _feed_high_while_low_waits(priority_engine, "noaging", enough))
    assert low_first is None, "without aging the low-priority request ran during the " \
                              "priority-0 stream"
    later = [h for h in highs if h.submitted_at > low.submitted_at]
    assert all(h.done_at <= low.first_output_at for h in later), \
        "high-priority requests that arrived later should all have gone first"
    assert low.finish_reason == "length"  # it runs once the stream stops
    priority_engine.assert_all_blocks_free()
