"""Scheduler: token budget, chunked prefill, decodes first, preemption, stops."""

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import FinishReason, Request, RequestStatus
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.scheduler import Scheduler

EOS = 2
GEN = 1000  # a generated token that never stops anything


def make_sched(num_blocks=64, block_size=4, budget=2048, max_seqs=64, policy="fcfs",
               max_model_len=8192, caching=True):
    manager = KVCacheManager(num_blocks, block_size, caching)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                             max_model_len=max_model_len, policy=policy)
    return Scheduler(config, manager, block_size)


def make_req(rid, num_prompt, first=0, priority=0, arrival=0.0, **params):
    params.setdefault("max_tokens", 16)
    return Request(rid, list(range(first, first + num_prompt)), SamplingParams(**params),
                   arrival_time=arrival, priority=priority, eos_token_ids=(EOS,))


def step(sched, tokens=None):
    """One schedule + fake runner + update; checks the block invariants."""
    out = sched.schedule()
    tokens = tokens or {}
    sampled = {s.request_id: list(tokens.get(s.request_id, [GEN]))
               for s in out.scheduled if s.sample}
    updates = sched.update_from_output(out, sampled)
    sched.kv_cache_manager.check_consistency()
    return out, {u.request_id: u for u in updates}


def by_id(out):
    return {s.request_id: s for s in out.scheduled}


def run_to_end(sched, max_steps=1000):
    finished = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return finished
        _, updates = step(sched)
        finished.update({rid: u for rid, u in updates.items() if u.finished})
    raise AssertionError("requests did not finish")


def tokens(sched, s):
    """The ids of a scheduled chunk's tokens (the runner knows them; the
    output carries only their count)."""
    request = sched.requests[s.request_id]
    return tuple(request.all_token_ids[s.start_position:s.start_position + s.num_tokens])


def test_single_request_prefill_then_decode():
    sched = make_sched()
    sched.add_request(make_req("a", 10, max_tokens=3))
    out, updates = step(sched)
    (s,) = out.scheduled
    assert tokens(sched, s) == tuple(range(10)) and s.start_position == 0 and s.sample
    assert s.is_new and s.new_block_ids == (0, 1, 2) and out.written_block_ids == (0, 1, 2)
    assert out.new_requests[0].prompt_token_ids == tuple(range(10))
    assert out.first_scheduled_request_ids == ("a",) and out.num_prefill_tokens == 10
    assert updates["a"].new_token_ids == (GEN,) and updates["a"].num_cached_tokens == 0
    out, _ = step(sched)
    (s,) = out.scheduled
    assert (tokens(sched, s), s.start_position, s.is_new) == ((GEN,), 10, False)
    assert s.new_block_ids == ()  # the runner has its table already
    assert out.written_block_ids == (2,)  # position 10 of 4-token blocks
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 0 and not out.new_requests
    out, updates = step(sched)
    assert updates["a"].finish_reason is FinishReason.LENGTH
    assert updates["a"].num_output_tokens == 3
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks == 64
    out, _ = step(sched)
    assert out.is_empty and out.finished_request_ids == ("a",)


def test_chunked_prefill_alone_uses_full_budget():
    sched = make_sched(block_size=16, budget=16)
    sched.add_request(make_req("long", 300))
    chunks = []
    while True:
        out, updates = step(sched)
        (s,) = out.scheduled
        chunks.append((s.start_position, s.num_tokens, s.sample))
        if s.sample:
            break
    assert [c[1] for c in chunks] == [16] * 18 + [12]
    assert [c[0] for c in chunks] == list(range(0, 300, 16))
    assert [c[2] for c in chunks] == [False] * 18 + [True]
    assert updates["long"].new_token_ids == (GEN,)


def test_chunked_prefill_while_another_request_decodes_every_step():
    sched = make_sched(num_blocks=64, block_size=16, budget=16)
    sched.add_request(make_req("short", 4, first=500, max_tokens=100))
    sched.add_request(make_req("long", 300, max_tokens=2))
    out, _ = step(sched)
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("short", 4),
                                                                          ("long", 12)]
    position, num_steps = 12, 1
    while position < 300:
        out, updates = step(sched)
        num_steps += 1
        assert out.num_batched_tokens <= 16
        short, long_ = out.scheduled  # the decode comes first
        assert short.request_id == "short" and tokens(sched, short)[-1] == GEN and short.sample
        assert long_.request_id == "long" and long_.start_position == position
        assert long_.num_tokens == min(15, 300 - position)
        assert tokens(sched, long_) == tuple(range(position, position + long_.num_tokens))
        position += long_.num_tokens
        assert long_.sample == (position == 300)
        assert updates["short"].num_output_tokens == num_steps
        assert out.num_decode_tokens == 1 and out.num_prefill_tokens == long_.num_tokens
    assert num_steps == 1 + 20
    out, _ = step(sched)  # now both decode
    assert [s.num_tokens for s in out.scheduled] == [1, 1]


def test_token_budget_and_max_num_seqs():
    sched = make_sched(budget=10, max_seqs=2)
    for i in range(4):
        sched.add_request(make_req(f"r{i}", 4, first=100 * i, max_tokens=5))
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    assert out.num_batched_tokens == 8 and out.num_running == 2 and out.num_waiting == 2
    for _ in range(4):
        out, _ = step(sched)
        assert len(out.scheduled) <= 2 and out.num_batched_tokens <= 10
    assert {s.request_id for s in out.scheduled} == {"r0", "r1"}
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["r2", "r3"]
    assert set(out.finished_request_ids) == {"r0", "r1"}
    run_to_end(sched)
    assert sched.kv_cache_manager.num_free_blocks == 64


def test_budget_cuts_admitted_prompt():
    sched = make_sched(budget=10)
    sched.add_request(make_req("a", 6))
    sched.add_request(make_req("b", 9))
    out, _ = step(sched)
    assert [(s.request_id, s.num_tokens, s.sample) for s in out.scheduled] == [
        ("a", 6, True), ("b", 4, False)]
    assert sched.num_staged == 0 and sched.num_staged_tokens == 0


def _preemption_setup(policy):
    """4 blocks of 4 tokens; A (priority 5) admitted before B (priority 0)."""
    sched = make_sched(num_blocks=4, block_size=4, policy=policy)
    sched.add_request(make_req("A", 6, priority=5, arrival=0.0, max_tokens=5))
    step(sched)
    sched.add_request(make_req("B", 6, first=100, priority=0, arrival=1.0, max_tokens=5))
    step(sched)
    step(sched)
    assert sched.kv_cache_manager.num_free_blocks == 0
    return sched


def test_preemption_fcfs_evicts_last_admitted_which_resumes_and_finishes():
    sched = _preemption_setup("fcfs")
    out, _ = step(sched)  # A needs a 3rd block
    assert [p.request_id for p in out.preemptions] == ["B"]
    assert out.preemptions[0].num_blocks_freed == 2
    assert out.preemptions[0].reason == "kv_cache_full"
    assert [s.request_id for s in out.scheduled] == ["A"] and out.new_requests == ()
    assert out.finished_request_ids == ("B",)
    b = sched.get_request("B")
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.kv_cache_manager.get_block_ids("B") == []
    outputs_before = tuple(b.output_token_ids)
    finished = {}
    resumed = None
    while sched.has_unfinished_requests():
        out, updates = step(sched)
        finished.update({k: u for k, u in updates.items() if u.finished})
        if "B" in by_id(out) and by_id(out)["B"].is_new:
            resumed = (by_id(out)["B"], out.new_requests[0])
    s, new = resumed
    assert new.resumed and new.output_token_ids == outputs_before
    assert new.num_cached_tokens == 4 and s.start_position == 4  # B's head block survived
    assert s.num_tokens == 2 + len(outputs_before) and s.sample  # recomputes from position 4
    assert new.prompt_token_ids + new.output_token_ids == tuple(range(100, 106)) + outputs_before
    assert len(s.new_block_ids) >= 2  # the whole table again: the runner dropped it
    assert finished["A"].finish_reason is FinishReason.LENGTH
    assert finished["B"].num_output_tokens == 5 and finished["B"].num_preemptions == 1
    assert finished["B"].num_cached_tokens == 0  # the first scheduling's hits
    assert sched.kv_cache_manager.num_free_blocks == 4


def test_preemption_priority_evicts_worst_priority():
    sched = _preemption_setup("priority")
    out, _ = step(sched)  # A (worst) needs a block: it is itself the victim
    assert [p.request_id for p in out.preemptions] == ["A"]
    assert [s.request_id for s in out.scheduled] == ["B"]
    finished = run_to_end(sched)
    assert finished["A"].num_preemptions == 1 and finished["B"].num_preemptions == 0


def test_priority_preempts_already_scheduled_request_and_returns_its_budget():
    sched = make_sched(num_blocks=4, block_size=4, policy="priority", budget=100)
    sched.add_request(make_req("W", 6, priority=9, arrival=0.0, max_tokens=9))
    step(sched)
    sched.add_request(make_req("G", 8, first=100, priority=0, arrival=1.0, max_tokens=9))
    step(sched)  # W decodes (pos 6), G prefills 8 tokens
    # W (pos 7) fits in its 2nd block and is scheduled first; G (pos 8) needs
    # a 3rd block -> W, already scheduled, is the victim and is unscheduled
    out, _ = step(sched)
    assert [p.request_id for p in out.preemptions] == ["W"]
    assert [s.request_id for s in out.scheduled] == ["G"] and out.num_batched_tokens == 1
    run_to_end(sched)
    assert sched.kv_cache_manager.num_free_blocks == 4


def test_abort_frees_blocks_of_running_and_waiting():
    sched = make_sched(num_blocks=8, block_size=4, max_seqs=1)
    sched.add_request(make_req("run", 9))
    sched.add_request(make_req("wait", 9, first=50))
    step(sched)
    assert sched.kv_cache_manager.num_free_blocks == 5
    updates = sched.finish_requests(["run", "wait", "nope"], RequestStatus.FINISHED_ABORTED)
    assert {u.request_id: u.finish_reason for u in updates} == {
        "run": FinishReason.ABORT, "wait": FinishReason.ABORT}
    assert sched.kv_cache_manager.num_free_blocks == 8
    assert not sched.has_unfinished_requests()
    out, _ = step(sched)
    assert set(out.finished_request_ids) == {"run", "wait"} and out.is_empty
    assert sched.finish_requests("run", RequestStatus.FINISHED_ABORTED) == []
    with pytest.raises(ValueError):
        sched.finish_requests("x", RequestStatus.RUNNING)


def test_abort_between_schedule_and_update_is_ignored():
    sched = make_sched()
    sched.add_request(make_req("a", 5))
    out = sched.schedule()
    sched.finish_requests("a", RequestStatus.FINISHED_STOPPED)  # e.g. a stop string
    assert sched.update_from_output(out, {"a": [GEN]}) == []
    sched.kv_cache_manager.check_consistency()
    assert sched.kv_cache_manager.num_free_blocks == 64


@pytest.mark.parametrize("params,tokens,expected", [
    (dict(), [5, EOS], (FinishReason.STOP, 2, None)),
    (dict(ignore_eos=True, max_tokens=3), [EOS, EOS, EOS], (FinishReason.LENGTH, 3, None)),
    (dict(max_tokens=2), [5, 6], (FinishReason.LENGTH, 2, None)),
    (dict(stop_token_ids=(7,)), [5, 7], (FinishReason.STOP, 2, 7)),
    (dict(min_tokens=3), [EOS, EOS, 5, EOS], (FinishReason.STOP, 4, None)),
])
def test_finish_conditions(params, tokens, expected):
    sched = make_sched()
    sched.add_request(make_req("a", 5, **params))
    for token in tokens:
        _, updates = step(sched, {"a": [token]})
    update = updates["a"]
    assert (update.finish_reason, update.num_output_tokens, update.stop_reason) == expected
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks == 64


def test_several_sampled_tokens_are_truncated_at_stop():
    sched = make_sched()
    sched.add_request(make_req("a", 5))
    _, updates = step(sched, {"a": [5, EOS, 9]})
    assert updates["a"].new_token_ids == (5, EOS) and updates["a"].finished


def test_max_model_len_finishes_with_length():
    sched = make_sched(max_model_len=8)
    sched.add_request(make_req("a", 6, max_tokens=None))
    _, updates = step(sched)
    _, updates = step(sched)
    assert updates["a"].finish_reason is FinishReason.LENGTH
    assert updates["a"].num_output_tokens == 2


def test_defensive_rejections():
    sched = make_sched(num_blocks=4, block_size=4, max_model_len=20)
    sched.add_request(make_req("too_long", 21))
    sched.add_request(make_req("too_big", 17))  # 5 blocks > 4 in the cache
    sched.add_request(Request("empty", [], SamplingParams()))
    sched.add_request(make_req("ok", 3))
    out, _ = step(sched)
    rejected = {u.request_id: u for u in out.rejected}
    assert set(rejected) == {"too_long", "too_big", "empty"}
    assert all(u.finish_reason is FinishReason.ERROR and u.error for u in rejected.values())
    assert "max_model_len" in rejected["too_long"].error
    assert [s.request_id for s in out.scheduled] == ["ok"]


def test_missing_sampled_token_is_an_error_not_a_hang():
    sched = make_sched()
    sched.add_request(make_req("a", 5))
    out = sched.schedule()
    (update,) = sched.update_from_output(out, {})
    assert update.finish_reason is FinishReason.ERROR
    assert sched.kv_cache_manager.num_free_blocks == 64


def test_prefix_cache_hit_across_requests_and_stats():
    sched = make_sched()
    sched.add_request(make_req("a", 10, max_tokens=1))
    out, _ = step(sched)
    assert (out.prefix_cache_queries, out.prefix_cache_hits) == (10, 0)
    sched.add_request(make_req("b", 10, max_tokens=1))
    out, updates = step(sched)
    s = by_id(out)["b"]
    assert s.start_position == 8 and s.num_tokens == 2
    assert out.new_requests[0].num_cached_tokens == 8
    assert (out.prefix_cache_queries, out.prefix_cache_hits) == (10, 8)
    assert updates["b"].num_cached_tokens == 8
    assert sched.kv_cache_manager.stats.hits == 8


def test_add_request_validation():
    sched = make_sched(max_model_len=100)
    req = make_req("a", 3)
    sched.add_request(req)
    assert req.max_model_len == 100
    with pytest.raises(ValueError):
        sched.add_request(make_req("a", 3))
    with pytest.raises(ValueError):
        make_sched(block_size=4).__class__(SchedulerConfig(), KVCacheManager(4, 4), 8)


def test_same_request_id_can_be_reused_after_finishing():
    sched = make_sched()
    sched.add_request(make_req("a", 3, max_tokens=1))
    step(sched)
    sched.add_request(make_req("a", 3, max_tokens=1))
    out, updates = step(sched)
    assert out.finished_request_ids == ("a",) and by_id(out)["a"].is_new
    assert updates["a"].finished


def test_a_long_prefill_leaves_room_for_a_request_that_arrives():
    """``long_prefill_token_threshold`` (vLLM's): a fresh user's 6,031-token
    prompt held a 33-token request in the queue for 16 s; with the cap, the
    short request is admitted in the next step, beside the long prefill."""
    manager = KVCacheManager(400, 4, True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, long_prefill_token_threshold=8),
                      manager, 4)
    sched.add_request(make_req("long", 200))
    out, _ = step(sched)
    assert by_id(out)["long"].num_tokens == 16  # alone: the whole budget
    sched.add_request(make_req("short", 6, first=500))
    out, _ = step(sched)
    chunks = {rid: s.num_tokens for rid, s in by_id(out).items()}
    assert chunks == {"long": 8, "short": 6}
    out, _ = step(sched)  # nobody waits: the long prefill takes what is left again
    assert by_id(out)["long"].num_tokens == 16 - 1  # the short one decodes its token


def test_without_the_cap_a_long_prefill_holds_the_queue():
    manager = KVCacheManager(400, 4, True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16), manager, 4)
    sched.add_request(make_req("long", 200))
    step(sched)
    sched.add_request(make_req("short", 6, first=500))
    out, _ = step(sched)
    assert set(by_id(out)) == {"long"}
