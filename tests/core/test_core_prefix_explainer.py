"""Cache-miss explainer: a prompt that misses the prefix cache only because an
early token differs from a cached prompt gets one ``PrefixCacheDivergence``."""

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.block_hash import content_hash
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.outputs import PrefixCacheDivergence
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.scheduler import Scheduler

BS = 16
GEN = 1000  # a generated token id that stops nothing


def make_sched(num_blocks=64, caching=True, track=None):
    manager = KVCacheManager(num_blocks, BS, caching, track_content_hashes=track)
    config = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=16, max_model_len=4096)
    return Scheduler(config, manager, BS)


def prompt(num_tokens, start=100):
    return list(range(start, start + num_tokens))


def changed(tokens, *positions):
    out = list(tokens)
    for p in positions:
        out[p] = 7  # "the timestamp"
    return out


def run(sched, rid, tokens, max_tokens=1):
    """Admit and run one request to its end; return the divergences reported."""
    sched.add_request(Request(rid, tokens, SamplingParams(max_tokens=max_tokens)))
    events = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        events.extend(out.divergences)
        sched.update_from_output(out, {s.request_id: [GEN] for s in out.scheduled if s.sample})
        sched.kv_cache_manager.check_consistency()
    return events


def test_timestamp_at_the_top_costs_every_hit():
    sched = make_sched()
    base = prompt(10 * BS)  # 10 full blocks; the last token is recomputed: 9 can hit
    assert run(sched, "a", base) == []
    events = run(sched, "b", changed(base, 3))
    assert events == [PrefixCacheDivergence("b", position=3, would_hit_tokens=9 * BS,
                                            hit_tokens=0)]
    assert sched.kv_cache_manager.stats.divergences == 1


def test_would_hit_counts_every_block_when_the_prompt_has_a_partial_tail():
    sched = make_sched()
    base = prompt(10 * BS + 5)
    run(sched, "a", base)
    (event,) = run(sched, "b", changed(base, 20))  # block 1, offset 4
    assert event == PrefixCacheDivergence("b", 20, 10 * BS, BS)


def test_difference_spanning_several_blocks():
    sched = make_sched()
    base = prompt(10 * BS + 1)
    run(sched, "a", base)
    (event,) = run(sched, "b", changed(base, 2 * BS + 9, 3 * BS, 4 * BS + 15))
    assert event == PrefixCacheDivergence("b", 2 * BS + 9, 10 * BS, 2 * BS)


def test_a_second_difference_ends_the_would_hit_run():
    sched = make_sched()
    base = prompt(10 * BS + 1)
    run(sched, "a", base)
    (event,) = run(sched, "b", changed(base, 3, 6 * BS + 2))
    assert event == PrefixCacheDivergence("b", 3, 6 * BS, 0)


def test_best_matching_prompt_is_the_one_that_would_hit_most():
    sched = make_sched(num_blocks=128)
    base = prompt(10 * BS + 1)
    run(sched, "a", changed(base, 5 * BS))  # agrees with c on blocks 1..4 only
    run(sched, "b", base)                    # agrees with c on blocks 1..9
    (event,) = run(sched, "c", changed(base, 3))
    assert event == PrefixCacheDivergence("c", 3, 10 * BS, 0)


def test_many_cached_variants_still_give_one_exact_event():
    from kvserve.core.prefix_explainer import MAX_CANDIDATES

    sched = make_sched(num_blocks=256)
    base = prompt(10 * BS + 1)
    for n in range(3 * MAX_CANDIDATES):  # 12 timestamp variants, each cached in full
        out = list(base)
        out[2] = 5000 + n
        assert run(sched, f"v{n}", out) == ([] if n == 0 else run_event(f"v{n}", 2))
    assert run(sched, "b", changed(base, 2)) == run_event("b", 2)
    assert sched.kv_cache_manager.stats.divergences == 3 * MAX_CANDIDATES


def run_event(rid, position):
    return [PrefixCacheDivergence(rid, position, 10 * BS, 0)]


@pytest.mark.parametrize("second", [
    prompt(10 * BS, start=5000),                       # new content
    prompt(10 * BS),                                   # identical: full hit
    changed(prompt(10 * BS), 10 * BS - 1),             # last token differs
    changed(prompt(10 * BS), 9 * BS + 3),              # last block differs
    prompt(8 * BS) + prompt(2 * BS, start=5000),       # new suffix
    prompt(4 * BS) + prompt(BS, start=5000) + prompt(5 * BS, start=6000),  # new middle
    [1] + prompt(10 * BS),                             # shifted by one token
], ids=["new", "identical", "last-token", "last-block", "suffix", "middle", "shifted"])
def test_no_event_without_later_cached_content(second):
    sched = make_sched()
    run(sched, "a", prompt(10 * BS))
    assert run(sched, "b", second) == []
    assert sched.kv_cache_manager.stats.divergences == 0


def test_reported_once_even_when_admission_is_retried():
    sched = make_sched(num_blocks=13)
    base = prompt(10 * BS)
    sched.add_request(Request("a", base, SamplingParams(max_tokens=20)))
    sched.add_request(Request("b", changed(base, 3), SamplingParams(max_tokens=1)))
    events, steps = [], 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        steps += 1
        events.extend(out.divergences)
        sched.update_from_output(out, {s.request_id: [GEN] for s in out.scheduled if s.sample})
    assert steps > 20  # b waited for a's blocks
    assert [(e.request_id, e.position) for e in events] == [("b", 3)]
    assert sched.kv_cache_manager.stats.divergences == 1


def test_would_hit_counts_only_resident_blocks():
    sched = make_sched(num_blocks=12)
    base = prompt(10 * BS)
    run(sched, "a", base)
    run(sched, "x", prompt(8 * BS, start=5000))  # evicts a's blocks 4..9 (tail first)
    (event,) = run(sched, "b", changed(base, 3))
    assert event == PrefixCacheDivergence("b", 3, 4 * BS, 0)


def test_cached_prompt_without_its_divergent_block_explains_nothing():
    sched = make_sched()
    base = prompt(10 * BS)
    sched.add_request(Request("a", base, SamplingParams(max_tokens=1)))
    sched.schedule()  # a's blocks are registered when scheduled
    a_block0 = sched.kv_cache_manager.get_block_ids("a")[0]
    sched.kv_cache_manager.evict_hashes([a_block0])  # a prompt identical to a would miss too
    sched.add_request(Request("b", changed(base, 3), SamplingParams(max_tokens=1)))
    assert sched.schedule().divergences == ()


def test_no_event_when_prefix_caching_or_tracking_is_off():
    for sched in (make_sched(caching=False), make_sched(track=False)):
        base = prompt(10 * BS)
        run(sched, "a", base)
        assert run(sched, "b", changed(base, 3)) == []
        assert sched.kv_cache_manager.pool.content_index == {}


def test_prompt_logprobs_requests_are_not_explained():
    sched = make_sched()
    base = prompt(10 * BS)
    run(sched, "a", base)
    sched.add_request(Request("b", changed(base, 3), SamplingParams(max_tokens=1,
                                                                   prompt_logprobs=1)))
    assert sched.schedule().divergences == ()


def test_memory_is_bounded_by_the_cache():
    manager = KVCacheManager(num_blocks=20, block_size=BS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=4096, max_model_len=4096),
                      manager, BS)
    base = prompt(6 * BS)
    for n in range(50):
        run(sched, f"r{n}", changed(base, n % BS) if n % 2 else prompt(6 * BS, start=n * 1000))
    with_content = [b for b in manager.pool.blocks if b.content is not None]
    assert 0 < len(with_content) <= manager.num_blocks
    assert all(len(b.content.token_ids) == BS for b in with_content)
    indexed = sum(len(ids) for by_pos in manager.pool.content_index.values()
                  for ids in by_pos.values())
    assert indexed == len(with_content)
    assert manager.req_content_hashes == {}  # per-request memo dropped when freed
    assert manager.stats.divergences > 0


def test_content_index_is_position_aware():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    req = Request("a", [1, 2, 3, 4, 1, 2, 3, 4, 0], SamplingParams())
    manager.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    manager.cache_computed_blocks(req)
    ids = manager.get_block_ids("a")
    chash = content_hash([1, 2, 3, 4])
    assert manager.pool.blocks_with_content(chash) == sorted(ids[:2])
    assert manager.pool.blocks_with_content(chash, position=1) == [ids[1]]
    block = manager.pool.blocks[ids[1]]
    assert block.content.parent_hash == req.block_hashes[0] and block.content.position == 1
    assert manager.reset_prefix_cache() is False
    manager.free(req)
    assert manager.reset_prefix_cache() and manager.pool.content_index == {}
    assert block.content is None


def test_scheduler_actor_logs_each_divergence():
    from structlog.testing import capture_logs

    from kvserve.actors.scheduler import SchedulerActor

    sched = make_sched()
    sched.kv_cache_manager.stats.divergences = 1
    actor = SchedulerActor(sched, *(SchedulerActor.mailbox() for _ in range(4)))
    with capture_logs() as logs:
        actor._log_divergence(PrefixCacheDivergence("req-1", 3, 1024, 0))
    (entry,) = logs
    assert entry["event"] == "prefix_cache_divergence" and entry["log_level"] == "warning"
    assert (entry["request_id"], entry["position"], entry["would_hit_tokens"],
            entry["hit_tokens"], entry["total_divergences"]) == ("req-1", 3, 1024, 0, 1)
    assert entry["message"] == ("Request req-1 missed the prefix cache at token 3: its prompt "
                                "differs from a cached one there; 1,024 tokens would have hit "
                                "(0 did)")
