"""Speculative decoding, the scheduler's side: n-gram drafts, verify chunks,
roll-back of rejected drafts, one step at a time, the off switch, and block
accounting through preemption and aborts. Plain integers, block size 4."""

import pytest

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from kvserve.core import spec_decode
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.scheduler import Scheduler
from kvserve.core.spec_decode import SpecDecodingStats, may_speculate, propose_ngram

BS = 4
REPEAT = [5, 6, 7, 8, 9] * 4  # every 2-gram recurs: drafts are always found


def de_bruijn(k: int) -> list[int]:
    """A cyclic sequence over 0..k-1 holding every pair (a de Bruijn
    sequence of order 2, unrolled): whatever two tokens end a request, they
    occurred before, so there is always a draft."""
    seq = []
    for a in range(k):
        for b in range(a, k):
            seq += [a, b] if a != b else [a]
    seq += [b for a in range(k) for b in range(a)]  # the descending pairs
    pairs = {(x, y) for x, y in zip(seq, seq[1:])}
    missing = [(x, y) for x in range(k) for y in range(k) if (x, y) not in pairs]
    for x, y in missing:
        seq += [x, y]
    return seq * 2


def make(k=3, num_blocks=64, budget=64, async_scheduling=False):
    spec = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=3, prompt_lookup_min=2)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=256,
                             async_scheduling=async_scheduling, speculative=spec)
    return Scheduler(config, KVCacheManager(num_blocks, BS), BS)


def req(rid, prompt, max_tokens=32, **params):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=(2,))


# ------------------------------------------------------------------ n-gram


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3]
    assert propose_ngram(tokens, 2, 2, 3) == [4, 5]  # the later "1 2 3" wins
    assert propose_ngram(tokens, 10, 2, 3) == [4, 5, 1, 2, 3]  # up to the end
    assert propose_ngram([1, 2, 3, 4], 3, 2, 3) == []
    assert propose_ngram([7, 8, 1, 7, 8], 3, 2, 2) == [1, 7, 8]
    assert propose_ngram([7, 8, 1, 7, 8], 0, 2, 2) == []


def test_ngram_prefers_the_longest_matching_suffix():
    # "3 1" occurs after 9 and after 4; "4 3 1" only once: its follower wins
    tokens = [4, 3, 1, 50, 9, 3, 1, 60, 4, 3, 1]
    assert propose_ngram(tokens, 1, 2, 3) == [50]
    assert propose_ngram(tokens, 1, 2, 2) == [60]


def test_only_plain_sampling_may_speculate():
    assert may_speculate(SamplingParams(temperature=0.8, top_p=0.9, seed=3), 0)
    for params in (dict(presence_penalty=0.5), dict(repetition_penalty=1.1),
                   dict(logit_bias={3: 1.0}), dict(logprobs=2), dict(export_kv=True)):
        assert not may_speculate(SamplingParams(**params), 5), params
    assert not may_speculate(SamplingParams(min_tokens=4), 3)
    assert may_speculate(SamplingParams(min_tokens=4), 4)


def test_stats_count_per_position_and_mean_acceptance_length():
    stats = SpecDecodingStats()
    stats.observe(3, 2)
    stats.observe(3, 0)
    assert stats.accepted_per_pos == [1, 1, 0]
    assert stats.mean_acceptance_length == 2.0


# --------------------------------------------------------------- scheduling


def test_a_verify_chunk_is_the_last_token_and_the_drafts():
    sched = make(k=3)
    sched.add_request(req("r", REPEAT))
    out = sched.schedule()  # the whole prompt; its last 2-gram recurs, but prefill drafts nothing
    assert not out.scheduled[0].spec_token_ids
    sched.update_from_output(out, {"r": [5]})
    out = sched.schedule()
    chunk = out.scheduled[0]
    request = sched.requests["r"]
    assert chunk.spec_token_ids == (6, 7, 8)
    assert (chunk.start_position, chunk.num_tokens, chunk.sample) == (20, 4, True)
    assert request.num_computed_tokens == 24
    # the runner accepts 2 drafts and adds its own token: 1 draft rolled back
    sched.update_from_output(out, {"r": [6, 7, 42]})
    assert request.output_token_ids == [5, 6, 7, 42]
    assert request.num_computed_tokens == 23 == request.num_tokens - 1
    assert (request.spec.num_draft_tokens, request.spec.num_accepted_tokens) == (3, 2)
    stats = sched.take_spec_stats()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 2)
    nxt = sched.schedule().scheduled[0]
    assert nxt.start_position == 23
    sched.kv_cache_manager.check_consistency()


def test_drafts_stop_short_of_max_tokens_and_the_budget():
    sched = make(k=8, budget=4)
    sched.add_request(req("r", REPEAT[:16], max_tokens=3))
    for _ in range(8):  # prefill in 4-token chunks
        out = sched.schedule()
        if out.scheduled[0].sample:
            break
        sched.update_from_output(out, {})
    sched.update_from_output(out, {"r": [6]})  # "... 9 5 6": "5 6" recurs
    chunk = sched.schedule().scheduled[0]
    assert len(chunk.spec_token_ids) == 1  # max_tokens 3: one out, one drafted, one sampled
    assert chunk.num_tokens <= 4


def test_a_speculating_request_waits_for_its_step_in_flight():
    sched = make(k=3, async_scheduling=True)
    sched.add_request(req("r", REPEAT))
    sched.add_request(req("other", range(100, 110), presence_penalty=0.5))  # never speculates
    first = sched.schedule()
    sched.update_from_output(first, {"r": [5], "other": [1000]})
    step1 = sched.schedule()
    assert {c.request_id for c in step1.scheduled} == {"r", "other"}
    step2 = sched.schedule()  # step 1 in flight: r drafts from its latest token, so it waits
    assert [c.request_id for c in step2.scheduled] == ["other"]
    sched.update_from_output(step1, {"r": [6, 99], "other": [1001]})
    sched.update_from_output(step2, {"other": [1002]})
    assert "r" in {c.request_id for c in sched.schedule().scheduled}
    sched.kv_cache_manager.check_consistency()


def test_the_off_switch_stops_a_rejected_request_in_a_batch_not_alone(monkeypatch):
    monkeypatch.setattr(spec_decode, "OFF_COOLDOWN", 3)
    sched = make(k=3, budget=128)
    sched.add_request(req("alone", [10 + t for t in de_bruijn(5)], max_tokens=64))
    sched.update_from_output(sched.schedule(), {"alone": [10]})
    for _ in range(spec_decode.OFF_WINDOW + 1):  # every draft rejected
        out = sched.schedule()
        drafts = out.scheduled[0].spec_token_ids
        assert drafts, "alone, it keeps speculating"
        sched.update_from_output(out, {"alone": [10 + (drafts[0] - 9) % 5]})
    sched.add_request(req("second", range(300, 310), presence_penalty=0.5))
    out = sched.schedule()
    chunk = {c.request_id: c for c in out.scheduled}["alone"]
    assert not chunk.spec_token_ids and not sched.requests["alone"].spec.enabled
    for _ in range(3):  # the cool-down: plain steps, then it tries again
        sched.update_from_output(out, {c.request_id: [1000] for c in out.scheduled if c.sample})
        out = sched.schedule()
    assert sched.requests["alone"].spec.enabled


def test_preemption_with_a_verify_step_in_flight_keeps_the_tokens():
    sched = make(k=3, num_blocks=8, async_scheduling=True)
    sched.add_request(req("r", REPEAT))
    out = sched.schedule()
    sched.update_from_output(out, {"r": [5]})
    verify = sched.schedule()
    assert verify.scheduled[0].spec_token_ids
    sched.add_request(req("big", range(400, 430)))  # needs the blocks r holds: preempts it
    sched._preempt(sched.requests["r"], type("S", (), {"num_new": {}, "preemptions": [],
                                                        "budget": 0})())
    sched.update_from_output(verify, {"r": [6, 7, 8, 9]})
    request = sched.requests["r"]
    assert request.status is RequestStatus.PREEMPTED and request.num_computed_tokens == 0
    assert request.output_token_ids == [5, 6, 7, 8, 9]
    sched.kv_cache_manager.check_consistency()


def test_aborting_a_speculating_request_frees_every_block():
    sched = make(k=3)
    sched.add_request(req("r", REPEAT))
    sched.update_from_output(sched.schedule(), {"r": [5]})
    out = sched.schedule()
    assert out.scheduled[0].spec_token_ids
    sched.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    sched.update_from_output(out, {"r": [6, 7, 8, 9]})  # dropped
    assert sched.kv_cache_manager.num_free_blocks == 64
    sched.kv_cache_manager.check_consistency()


def test_a_stop_token_among_accepted_drafts_ends_the_request_there():
    sched = make(k=3)
    sched.add_request(req("r", REPEAT, stop_token_ids=[7]))
    sched.update_from_output(sched.schedule(), {"r": [5]})
    out = sched.schedule()
    updates = sched.update_from_output(out, {"r": [6, 7, 8, 11]})
    assert updates[0].finish_reason is not None and updates[0].new_token_ids == (6, 7)
    assert sched.kv_cache_manager.num_free_blocks == 64


@pytest.mark.parametrize("bad", ['{"method": "draft_model"}',
                                 '{"method": "ngram", "model": "x"}',
                                 '{"method": "ngram", "quantization": "int8"}',
                                 '{"method": "ngram", "num_speculative_tokens": null}',
                                 '{"method": null}', '{"method": "draft_model", "model": 5}',
                                 '{"method": "draft_model", "model": "x", "quantization": "q3"}',
                                 '{"method": "ngram", "num_speculative_tokens": 0}',
                                 '{"method": "medusa"}', '{"k": 3}', "not json"])
def test_bad_speculative_configs_are_refused(bad):
    with pytest.raises(ValueError):
        SpeculativeConfig.from_json(bad)


# ------------------------------------------------------------ draft model


def make_draft(k=3, num_blocks=64, budget=64, max_model_len=256):
    spec = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=k)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8,
                             max_model_len=max_model_len, async_scheduling=False,
                             speculative=spec)
    return Scheduler(config, KVCacheManager(num_blocks, BS), BS)


def test_a_prompt_last_chunk_gets_lookahead_slots_and_the_next_step_verifies_its_drafts():
    sched = make_draft(k=3)
    sched.add_request(req("r", range(100, 110)))  # 10 tokens: 3 blocks of 4
    out = sched.schedule()
    chunk = out.scheduled[0]
    assert (chunk.num_tokens, chunk.sample, chunk.num_lookahead_tokens) == (10, True, 3)
    assert len(chunk.new_block_ids) == 4  # positions 0-12: the draft writes 10, 11 and 12
    sched.update_from_output(out, {"r": [7]}, drafts={"r": [8, 9, 11]})
    out = sched.schedule()
    chunk = out.scheduled[0]
    assert chunk.spec_token_ids == (8, 9, 11)
    assert (chunk.start_position, chunk.num_tokens, chunk.num_lookahead_tokens) == (10, 4, 3)
    # positions 10-13 verified; with every draft accepted the draft writes 14, 15 and 16
    assert sched.kv_cache_manager.num_request_blocks("r") == 5
    sched.update_from_output(out, {"r": [8, 42]}, drafts={"r": [1, 2, 3]})
    request = sched.requests["r"]
    assert request.output_token_ids == [7, 8, 42] and request.num_computed_tokens == 12
    assert sched.take_spec_stats().num_accepted_tokens == 1
    assert sched.schedule().scheduled[0].spec_token_ids == (1, 2, 3)
    sched.kv_cache_manager.check_consistency()


def test_no_lookahead_for_chunks_that_do_not_sample_or_requests_that_cannot_speculate():
    sched = make_draft(k=3, budget=8)
    sched.add_request(req("long", range(100, 112)))
    sched.add_request(req("penalized", range(200, 204), presence_penalty=0.5))
    out = sched.schedule()
    by_id = {c.request_id: c for c in out.scheduled}
    assert by_id["long"].num_lookahead_tokens == 0 and not by_id["long"].sample
    assert by_id.get("penalized") is None or by_id["penalized"].num_lookahead_tokens == 0


def test_lookahead_slots_never_preempt_and_are_freed_with_the_request():
    sched = make_draft(k=3, num_blocks=3)
    sched.add_request(req("r", range(100, 112), max_tokens=1))  # exactly 3 blocks
    out = sched.schedule()
    assert out.scheduled[0].num_lookahead_tokens == 0  # no room for them: none asked
    assert not out.preemptions
    sched.update_from_output(out, {"r": [7]})
    assert sched.kv_cache_manager.num_free_blocks == 3
    sched.kv_cache_manager.check_consistency()


def test_drafts_of_a_request_preempted_since_are_dropped():
    sched = make_draft(k=3)
    sched.add_request(req("r", range(100, 110)))
    out = sched.schedule()
    sched.update_from_output(out, {"r": [7]}, drafts={"r": [8, 9, 11]})
    sched._preempt(sched.requests["r"], type("S", (), {"num_new": {}, "preemptions": [],
                                                        "budget": 0})())
    out = sched.schedule()  # resumed: recomputes prompt + output, no stale drafts
    chunk = out.scheduled[0]
    assert not chunk.spec_token_ids and chunk.start_position + chunk.num_tokens == 11
    sched.update_from_output(out, {"r": [12]})
    sched.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.num_free_blocks == 64
    sched.kv_cache_manager.check_consistency()


def test_a_draft_model_may_not_share_the_offload_tier():
    spec = SpeculativeConfig(method="draft_model", model="draft")
    with pytest.raises(ValueError, match="offload tier"):
        EngineConfig(model="m", cache=CacheConfig(kv_offloading_size=1.0),
                     scheduler=SchedulerConfig(speculative=spec))


def test_disable_by_batch_size_stops_drafts_and_lookahead_while_the_batch_is_large():
    spec = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=3,
                             disable_by_batch_size=2)
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256,
                             async_scheduling=False, speculative=spec)
    sched = Scheduler(config, KVCacheManager(64, BS), BS)
    sched.add_request(req("a", range(100, 110)))
    out = sched.schedule()
    assert out.scheduled[0].num_lookahead_tokens == 3  # alone: below the limit
    sched.update_from_output(out, {"a": [7]}, drafts={"a": [8, 9, 11]})
    sched.add_request(req("b", range(200, 210)))
    out = sched.schedule()  # two running: nobody speculates or proposes
    assert all(not c.spec_token_ids and not c.num_lookahead_tokens for c in out.scheduled)
    sched.update_from_output(out, {"a": [8], "b": [5]})
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    out = sched.schedule()  # alone again: proposes for the next step
    assert out.scheduled[0].num_lookahead_tokens == 3


def test_a_missing_draft_folder_is_a_usage_error_before_any_model_loads(tmp_path, capsys):
    from kvserve.cli import build_parser

    spec = '{"method": "draft_model", "model": "%s"}' % (tmp_path / "missing")
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--speculative-config", spec])
    assert exited.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "is not a checkpoint folder (no config.json in it)" in lines[0] \
        and "--help" in lines[0], lines  # one line that says where the flags are


def test_null_model_and_quantization_mean_their_defaults():
    assert SpeculativeConfig.from_json('{"method": "ngram", "model": null, "quantization": null}') \
        == SpeculativeConfig()
