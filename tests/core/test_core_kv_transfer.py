"""Scheduler side of KV transfer: offload saves on eviction, loads from the
tier at admission, exports of a prefill replica, adoption on a decode replica.

Plain integers: a fake tier that holds a set of hashes, block size 4."""

from kvserve.config import SchedulerConfig
from kvserve.core.block_hash import hash_request_blocks
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.scheduler import Scheduler

BS = 4
GEN = 1000


class FakeTier:
    """Holds a set of block hashes; ``lookup`` counts the leading ones held."""

    def __init__(self, hashes=()):
        self.hashes = set(hashes)
        self.lookups = 0

    def lookup(self, block_hashes):
        self.lookups += 1
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self.hashes:
                break
            count += 1
        return count


def make(num_blocks=16, tier=None, budget=64):
    manager = KVCacheManager(num_blocks, BS, external=tier)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=256)
    return Scheduler(config, manager, BS)


def req(rid, prompt, max_tokens=1, **params):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=(2,))


def run(sched):
    """Schedule + fake runner + update until idle; returns the outputs."""
    outputs = []
    while sched.has_unfinished_requests() or sched.has_pending_transfers():
        out = sched.schedule()
        outputs.append(out)
        sampled = {s.request_id: [GEN] for s in out.scheduled if s.sample}
        sched.update_from_output(out, sampled)
        sched.release_exports(out.kv_export_ids)
        sched.kv_cache_manager.check_consistency()
    return outputs


def hashes(prompt, n):
    return hash_request_blocks(list(prompt)[:n * BS], BS, None, 0)


def test_computed_blocks_are_saved_by_the_step_after_the_one_computing_them():
    sched = make(tier=FakeTier(), budget=4)
    prompt = range(100, 109)  # 9 tokens: 2 full blocks, 4 tokens a step
    sched.add_request(req("a", prompt))
    outputs = run(sched)
    table_hashes = hashes(prompt, 2)
    saves = [[s.block_hash for s in out.kv_saves] for out in outputs]
    # step 0 computes block 0, step 1 block 1, step 2 the last token
    assert saves[:3] == [[], [table_hashes[0]], [table_hashes[1]]]
    assert all(s.request_id == "" for out in outputs for s in out.kv_saves)
    assert not sched.has_pending_transfers()


def test_the_last_blocks_are_saved_by_a_step_of_their_own_once_idle():
    sched = make(tier=FakeTier())
    prompt = range(100, 109)
    sched.add_request(req("a", prompt))
    outputs = run(sched)
    assert not outputs[-1].scheduled and outputs[-1].kv_saves
    assert sorted(s.block_hash for out in outputs for s in out.kv_saves) == sorted(
        hashes(prompt, 2))


def test_evicted_cached_blocks_are_saved_before_reuse():
    sched = make(num_blocks=4, tier=FakeTier())
    first = range(100, 109)  # 9 tokens: 2 full blocks, cached when computed
    sched.add_request(req("a", first))
    run(sched)
    assert sched.kv_cache_manager.pool.num_free_blocks == 4
    sched.add_request(req("b", range(200, 216)))  # needs all 4 blocks
    out = sched.schedule()
    assert sorted(s.block_hash for s in out.kv_saves) == sorted(hashes(first, 2))


def test_adopted_blocks_are_not_saved_as_computed():
    prompt = list(range(300, 314))
    sched = make(tier=FakeTier(hashes(prompt, 3)))
    sched.adopt_blocks("x", hashes(range(700, 713), 3))
    sched.add_request(req("r", prompt))
    outputs = run(sched)
    saved = {s.block_hash for out in outputs for s in out.kv_saves}
    assert not saved & set(hashes(range(700, 713), 3))


def test_no_saves_without_a_tier():
    sched = make(num_blocks=4)
    sched.add_request(req("a", range(100, 109)))
    run(sched)
    sched.add_request(req("b", range(200, 216)))
    assert not any(out.kv_saves for out in run(sched))


def test_admission_loads_the_blocks_the_tier_holds_after_local_hits():
    prompt = list(range(300, 314))  # 14 tokens: 3 full blocks
    sched = make(tier=FakeTier(hashes(prompt, 3)[1:]))  # the tier lacks block 0
    sched.add_request(req("warm", prompt[:5]))  # caches block 0 locally
    run(sched)
    sched.add_request(req("r", prompt))
    out = sched.schedule()
    chunk = out.scheduled[0]
    assert chunk.start_position == 3 * BS and chunk.num_tokens == 2  # 12 hit, 2 computed
    table = sched.kv_cache_manager.get_block_ids("r")
    assert [(t.request_id, t.block_id) for t in out.kv_loads] == [("r", table[1]), ("r", table[2])]
    assert [t.block_hash for t in out.kv_loads] == hashes(prompt, 3)[1:]
    assert set(table[1:3]) <= set(out.written_block_ids)
    assert sched.requests["r"].num_cached_tokens == 12
    assert (out.kv_offload_queries, out.kv_offload_hits) == (8, 8)
    # the loaded blocks are registered: a third request hits them locally
    sched.update_from_output(out, {"r": [GEN]})
    sched.add_request(req("again", prompt))
    again = sched.schedule()
    assert again.scheduled[0].start_position == 12 and not again.kv_loads


def test_a_lost_load_restarts_the_request_and_voids_the_step_in_flight():
    """Issue 47 item 10: the step loading ``r``'s blocks failed (a block left
    the tier); ``recompute`` requeues ``r`` from its prompt, the token the
    step in flight behind it samples is dropped, the loaded blocks' hashes
    are forgotten (a new request cannot hit them), and ``r`` then loads only
    what the tier still holds."""
    prompt = list(range(300, 314))  # 14 tokens: 3 full blocks
    tier = FakeTier(hashes(prompt, 3))
    sched = make(tier=tier)
    sched.add_request(req("r", prompt, max_tokens=3))
    first = sched.schedule()
    assert len(first.kv_loads) == 3
    behind = sched.schedule()  # async: r's decode is in flight behind the failed step
    assert [s.request_id for s in behind.scheduled] == ["r"]
    tier.hashes.discard(hashes(prompt, 3)[1])  # lost: the load of block 1 failed
    events = sched.recompute(["r"], "kv_load_lost")
    assert [(e.request_id, e.reason) for e in events] == [("r", "kv_load_lost")]
    assert sched.requests["r"].status is RequestStatus.PREEMPTED
    assert sched.update_from_output(behind, {"r": [GEN]}) == []  # void: computed from bad K/V
    assert sched.requests["r"].output_token_ids == []
    sched.kv_cache_manager.check_consistency()
    assert not any(sched.kv_cache_manager.pool.get_cached_block(block_hash)
                   for block_hash in hashes(prompt, 3))  # nothing hits the bad blocks
    again = sched.schedule()
    assert [t.block_hash for t in again.kv_loads] == hashes(prompt, 1)  # block 0 only
    assert again.scheduled[0].start_position == BS and again.scheduled[0].is_new
    sched.update_from_output(again, {"r": [GEN]})
    run(sched)
    assert sched.requests == {}
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.pool.num_usable_blocks


def test_the_last_prompt_token_is_computed_even_if_the_tier_holds_its_block():
    prompt = list(range(400, 408))  # exactly 2 full blocks
    tier = FakeTier(hashes(prompt, 2))
    sched = make(tier=tier)
    sched.add_request(req("r", prompt))
    out = sched.schedule()
    assert len(out.kv_loads) == 1 and out.scheduled[0].start_position == BS
    assert out.scheduled[0].num_tokens == BS


def test_prompt_logprobs_requests_do_not_load_from_the_tier():
    prompt = list(range(500, 513))
    tier = FakeTier(hashes(prompt, 3))
    sched = make(tier=tier)
    sched.add_request(req("r", prompt, prompt_logprobs=1))
    out = sched.schedule()
    assert not out.kv_loads and out.scheduled[0].start_position == 0 and tier.lookups == 0


def test_an_exporting_request_holds_its_full_prompt_blocks_until_released():
    prompt = list(range(600, 610))  # 10 tokens: 2 full blocks
    sched = make()
    sched.add_request(req("p", prompt, export_kv=True))
    out = sched.schedule()
    table = sched.kv_cache_manager.get_block_ids("p")
    sched.update_from_output(out, {"p": [GEN]})  # max_tokens 1: finished
    assert not sched.has_unfinished_requests() and sched.has_pending_transfers()
    held = sched.kv_cache_manager.num_free_blocks
    export = sched.schedule()
    assert export.is_empty is False and not export.scheduled and export.kv_export_ids == ("p",)
    assert [(e.request_id, e.block_id, e.block_hash) for e in export.kv_exports] == [
        ("p", table[0], hashes(prompt, 2)[0]), ("p", table[1], hashes(prompt, 2)[1])]
    assert sched.kv_cache_manager.num_free_blocks == held  # still held
    sched.release_exports(["p"])
    assert sched.kv_cache_manager.num_free_blocks == 16
    sched.kv_cache_manager.check_consistency()
    assert not sched.has_pending_transfers()


def test_a_prompt_shorter_than_a_block_exports_no_block_but_is_listed():
    sched = make()
    sched.add_request(req("p", range(600, 603), export_kv=True))
    sched.update_from_output(sched.schedule(), {"p": [GEN]})
    assert sched.has_pending_transfers()
    export = sched.schedule()
    assert export.kv_export_ids == ("p",) and not export.kv_exports and not export.is_empty
    assert sched.kv_cache_manager.num_free_blocks == 16


def test_an_aborted_exporting_request_exports_nothing():
    sched = make()
    sched.add_request(req("p", range(600, 610), export_kv=True, max_tokens=4))
    sched.schedule()
    sched.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    assert not sched.has_pending_transfers()
    assert sched.kv_cache_manager.num_free_blocks == 16


def test_adopted_blocks_load_next_step_and_become_the_requests_hits():
    prompt = list(range(700, 713))  # 3 full blocks
    sched = make()
    loads = sched.adopt_blocks("d", hashes(prompt, 3))
    assert len(loads) == 3 and sched.has_pending_transfers()
    sched.kv_cache_manager.check_consistency()
    sched.add_request(req("d", prompt))
    out = sched.schedule()
    assert out.kv_loads == tuple(loads)
    assert out.scheduled[0].start_position == 12 and out.scheduled[0].num_tokens == 1
    assert sched.requests["d"].num_cached_tokens == 12
    assert sched.kv_cache_manager.adopted == {}
    sched.update_from_output(out, {"d": [GEN]})
    assert sched.kv_cache_manager.num_free_blocks == 16
    sched.kv_cache_manager.check_consistency()


def test_adoption_skips_cached_hashes_and_stops_when_no_block_is_free():
    prompt = list(range(800, 817))  # 4 full blocks
    sched = make(num_blocks=3)
    sched.add_request(req("warm", prompt[:5]))
    run(sched)  # block 0 cached (free)
    loads = sched.adopt_blocks("d", hashes(prompt, 4))
    # block 0 is cached; 3 free blocks, one of them is cached block 0's
    assert [t.block_hash for t in loads] == hashes(prompt, 4)[1:3]
    sched.kv_cache_manager.check_consistency()


def test_adopted_blocks_are_released_if_the_request_never_arrives():
    sched = make()
    sched.adopt_blocks("gone", hashes(range(900, 913), 3))
    sched.finish_requests(["gone"], RequestStatus.FINISHED_ABORTED)
    manager = sched.kv_cache_manager
    assert manager.num_free_blocks == 16 and manager.adopted == {}
    manager.check_consistency()


def test_a_load_whose_block_was_evicted_first_is_dropped_with_its_save():
    sched = make(num_blocks=3, tier=FakeTier())
    loads = sched.adopt_blocks("d", hashes(range(900, 913), 3))
    sched.finish_requests(["d"], RequestStatus.FINISHED_ABORTED)  # released, not loaded
    sched.add_request(req("other", range(1, 12)))  # takes all 3 blocks
    out = sched.schedule()
    assert not out.kv_loads and not out.kv_saves
    assert len(loads) == 3


class FakeTieredTier(FakeTier):
    """A memory tier holding ``memory`` with a disk tier holding ``disk`` under
    it (``TieredExternalKV``): the leading run of blocks found in either,
    split by where the memory tier's run ends."""

    def __init__(self, memory=(), disk=()):
        super().__init__(set(memory) | set(disk))
        self.memory = set(memory)

    def lookup_tiers(self, block_hashes):
        total = self.lookup(block_hashes)
        in_memory = 0
        for block_hash in block_hashes[:total]:
            if block_hash not in self.memory:
                break
            in_memory += 1
        return in_memory, total - in_memory


def test_disk_tier_hits_are_counted_apart_from_memory_hits():
    """A 25-token prompt (6 full blocks; the last token is always computed):
    blocks 0-1 in the memory tier, 2-4 on disk, 5 nowhere. The block manager
    loads five blocks and counts 8 memory-tier tokens and 12 disk tokens, the
    disk queried for the 16 tokens the memory tier missed."""
    prompt = list(range(100, 125))
    h = hashes(prompt, 6)
    sched = make(tier=FakeTieredTier(memory=h[:2], disk=h[2:5]))
    r = req("r", prompt)
    sched.add_request(r)
    outputs = run(sched)
    assert [(t.block_hash, t.request_id) for t in outputs[0].kv_loads] == [
        (block_hash, "r") for block_hash in h[:5]]
    stats = sched.kv_cache_manager.stats
    assert (stats.external_queries, stats.external_hits) == (24, 8)
    assert (stats.external_disk_queries, stats.external_disk_hits) == (16, 12)
    assert r.num_cached_tokens == 20
