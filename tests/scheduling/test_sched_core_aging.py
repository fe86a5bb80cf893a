"""Priority order, priority preemption and aging in the pure core scheduler
(no model, fake time through ``arrival_time``)."""

from __future__ import annotations

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request
from kvserve.core.request_queue import PriorityQueue, priority_key
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.scheduler import Scheduler

EOS = 2
GEN = 1000  # a sampled token that never stops anything
STEP_S = 0.1  # fake seconds per engine step


def make_sched(policy="priority", aging=None, max_seqs=1, num_blocks=256, block_size=4):
    config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=max_seqs,
                             policy=policy, priority_aging_seconds=aging)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, False), block_size)


def make_req(rid, arrival, priority=0, max_tokens=1, num_prompt=4):
    return Request(rid, list(range(10, 10 + num_prompt)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=arrival, priority=priority, eos_token_ids=(EOS,))


def step(sched):
    out = sched.schedule()
    sampled = {s.request_id: [GEN] for s in out.scheduled if s.sample}
    sched.update_from_output(out, sampled)
    sched.kv_cache_manager.check_consistency()
    return out


def run_flood(aging, num_steps, per_step=2, low_priority=3):
    """A low-priority request arrives at t=0.05 while ``per_step`` priority-0
    requests arrive every step (more than the one finished per step).
    Returns the step at which the low one was first scheduled, or None."""
    sched = make_sched(aging=aging)
    sched.add_request(make_req("h-seed", arrival=0.0))
    sched.add_request(make_req("low", arrival=0.05, priority=low_priority))
    for k in range(num_steps):
        t = k * STEP_S
        for j in range(per_step):
            sched.add_request(make_req(f"h-{k}-{j}", arrival=t + 0.06 + j * 1e-3))
        out = step(sched)
        if any(s.request_id == "low" for s in out.scheduled):
            return k
    return None


def test_without_aging_low_priority_starves_under_a_stream_of_high():
    assert run_flood(aging=None, num_steps=300) is None


def test_with_aging_low_priority_runs_once_it_has_aged_past_new_arrivals():
    # Aging 1 s per level, priority 3: arrivals after t = 0.05 + 3 s sort behind
    # "low"; 2 arrivals per step since t = 0 put about 2 * 31 requests ahead.
    started = run_flood(aging=1.0, num_steps=300)
    assert started is not None, "low-priority request starved despite aging"
    assert 40 <= started <= 80, started


def test_aging_formula_effective_priority_is_time_free_key():
    # effective(t) = priority - (t - arrival) / S; ordering at any t equals
    # ordering by priority + arrival / S.
    a = make_req("a", arrival=0.0, priority=3)
    b = make_req("b", arrival=2.5, priority=0)  # a is 3 levels worse, 2.5 s older
    c = make_req("c", arrival=3.5, priority=0)  # ... and 3.5 s older
    assert priority_key(a, 1.0) > priority_key(b, 1.0)
    assert priority_key(a, 1.0) < priority_key(c, 1.0)
    queue = PriorityQueue(aging_seconds=1.0)
    for r in (c, a, b):
        queue.add(r)
    assert [r.request_id for r in queue] == ["b", "a", "c"]
    no_aging = PriorityQueue()
    for r in (c, a, b):
        no_aging.add(r)
    assert [r.request_id for r in no_aging] == ["b", "c", "a"]


def test_priority_zero_overtakes_waiting_low_and_preempts_running_low():
    """Core version of the acceptance scenario: one slot, a long low-priority
    request runs, five low ones wait, then a priority-0 one arrives."""
    sched = make_sched()
    sched.add_request(make_req("long", 0.0, priority=5, max_tokens=30))
    step(sched)
    for i in range(5):
        sched.add_request(make_req(f"low-{i}", 1.0 + i, priority=5, max_tokens=3))
    step(sched)
    sched.add_request(make_req("urgent", 10.0, priority=0, max_tokens=3))
    out = step(sched)
    assert [p.request_id for p in out.preemptions] == ["long"]
    assert [s.request_id for s in out.scheduled] == ["urgent"]
    finished = []
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sampled = {s.request_id: [GEN] for s in out.scheduled if s.sample}
        finished += [u.request_id for u in sched.update_from_output(out, sampled) if u.finished]
    # Preempted "long" keeps its place ahead of later arrivals of its priority.
    assert finished == ["urgent", "long", *(f"low-{i}" for i in range(5))]


@pytest.mark.parametrize("aging", [None, 1.0])
def test_priority_ties_go_by_arrival_time(aging):
    sched = make_sched(aging=aging)
    for arrival in (3.0, 1.0, 2.0):  # added out of arrival order
        sched.add_request(make_req(f"r{arrival:g}", arrival))
    order = []
    while sched.has_unfinished_requests():
        order += [s.request_id for s in step(sched).scheduled]
    assert order == ["r1", "r2", "r3"]
