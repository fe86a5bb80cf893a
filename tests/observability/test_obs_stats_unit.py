"""Unit tests (no model): timelines, interval stats, the observer's events,
the metrics registry and the diagnosis rules on metric scrapes."""

from __future__ import annotations

import io
import json

import pytest

from kvserve.core.outputs import RequestUpdate, SchedulerOutput
from kvserve.core.request import FinishReason
from kvserve.core.stats import IntervalStats, RequestTimeline, StepStats, StepTimes
from kvserve.observability.diagnosis import Features, diagnose, features_from_scrapes, histogram_quantile
from kvserve.observability.log import configure_logging
from kvserve.observability.metrics import METRICS, EngineMetrics, exposed_series, parse_metrics_text
from kvserve.observability.stats_logger import StatsObserver

#: The issue's list, spelled out independently of kvserve.observability.metrics.METRICS.
ISSUE_HISTOGRAMS = [
    "time_to_first_token_seconds", "inter_token_latency_seconds",
    "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_prefill_time_seconds",
    "request_decode_time_seconds", "request_inference_time_seconds", "request_prompt_tokens",
    "request_generation_tokens", "iteration_tokens_total"]
ISSUE_GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]
ISSUE_COUNTERS = ["prompt_tokens", "generation_tokens", "request_success", "num_preemptions",
                  "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_divergences"]
#: Issue 11: the step's phases and the worker's busy time.
STEP_HISTOGRAMS = ["step_phase_seconds"]
STEP_COUNTERS = ["engine_busy_seconds"]
#: Issue 15: the rest of vLLM's set a ported dashboard reads.
VLLM_HISTOGRAMS = ["time_per_output_token_seconds", "request_max_num_generation_tokens",
                   "request_params_n", "request_params_max_tokens"]
VLLM_GAUGES = ["cache_config_info"]
VLLM_COUNTERS = ["prompt_tokens_computed"]
#: Issue 16: the offload tier's hits and every KV transfer, by direction.
KV_COUNTERS = ["kv_offload_queries", "kv_offload_hits", "kv_transfer_blocks", "kv_transfer_bytes"]
KV_HISTOGRAMS = ["kv_transfer_seconds"]
#: Issue 17: speculative decoding, under vLLM's names.
SPEC_COUNTERS = ["spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                 "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos"]
#: Issue 32: pipeline stages (kvserve-specific).
PIPELINE_HISTOGRAMS = ["pipeline_stage_seconds"]
PIPELINE_COUNTERS = ["pipeline_stage_busy_seconds"]
#: Issue 49: the decode path chosen at start-up (kvserve-specific).
DECODE_GAUGES = ["decode_path_info"]


def test_timeline_phases_add_up_by_construction():
    t = RequestTimeline("r", arrival_time=100.0, arrival_wall=1.7e9, prompt_tokens=10)
    assert t.scheduled(100.25) and not t.scheduled(101.0)
    assert t.tokens(100.75, 1) is None  # first token: no ITL
    assert t.tokens(100.85, 1) == pytest.approx(0.1)
    assert t.tokens(101.05, 2) == pytest.approx(0.2)
    t.finish(101.05, "length", num_output_tokens=4)
    assert t.queue_time == pytest.approx(0.25)
    assert t.prefill_time == pytest.approx(0.5)
    assert t.decode_time == pytest.approx(0.3)
    assert t.ttft == pytest.approx(0.75)
    assert t.e2e == pytest.approx(1.05)
    assert t.queue_time + t.prefill_time + t.decode_time == pytest.approx(t.e2e, abs=1e-9)
    assert t.inference_time == pytest.approx(t.prefill_time + t.decode_time)
    assert t.tpot == pytest.approx((t.e2e - t.ttft) / 3)
    fields = t.log_fields()
    assert fields["arrival_time"] == 1.7e9 and fields["finish_reason"] == "length"


def test_timeline_single_token_has_no_tpot():
    t = RequestTimeline("r", 0.0, 0.0, 5)
    t.scheduled(0.1)
    t.tokens(0.2, 1)
    t.finish(0.2, "length", 1)
    assert t.tpot is None and t.decode_time == 0.0


def test_interval_snapshot_message():
    stats = IntervalStats(start=10.0)
    stats.add_step(StepStats(0, 10.0, 10.5, 2, 100, 1, 0, 0.5, 2, 3))
    stats.generation_tokens = 20
    stats.add_scheduling(1, 100, 25)
    snap = stats.snapshot(12.0, num_running=2, num_waiting=3, kv_cache_usage=0.5,
                          total_preemptions=4)
    assert snap.prompt_throughput == pytest.approx(50.0)
    assert snap.generation_throughput == pytest.approx(10.0)
    message = snap.message()
    for text in ("Avg prompt throughput: 50.0 tokens/s", "Avg generation throughput: 10.0",
                 "Running: 2 reqs", "Waiting: 3 reqs", "Preemptions: 1",
                 "KV cache usage: 50.0%", "Prefix cache hit rate: 25.0%"):
        assert text in message


def test_step_phases_in_stats_line_and_metrics():
    times = StepTimes(schedule=0.001, prepare=0.002, forward=0.100, sample=0.005, emit=0.003)
    step = StepStats(0, 10.0, 10.107, 4, 0, 4, 0, 0.1, 4, 0, times=times)
    stats = IntervalStats(start=10.0)
    stats.add_step(step)
    stats.add_step(StepStats(1, 10.2, 10.307, 4, 0, 4, 0, 0.1, 4, 0, times=times))
    snap = stats.snapshot(11.0, num_running=4, num_waiting=0, kv_cache_usage=0.1,
                          total_preemptions=0)
    assert snap.busy_fraction == pytest.approx(0.214)
    assert snap.step_ms == pytest.approx({"schedule": 1.0, "prepare": 2.0, "forward": 100.0,
                                          "sample": 5.0, "draft": 0.0, "emit": 3.0})
    # the draft phase shows only with a draft model
    assert "Busy: 21%, Step: 111.0 ms (schedule 1.0, prepare 2.0, forward 100.0, sample 5.0, " \
           "emit 3.0)" in snap.message()
    assert snap.log_fields()["step_ms"]["forward"] == 100.0
    metrics = EngineMetrics("m")
    metrics.observe_step(step)
    samples = parse_metrics_text(metrics.render().decode())
    assert samples["kvserve:engine_busy_seconds_total"][0][1] == pytest.approx(0.107)
    sums = {lab["phase"]: v for lab, v in samples["kvserve:step_phase_seconds_sum"]}
    assert sums == pytest.approx(times.as_dict())


def _output(step_id, first=(), running=1, waiting=0, prefill=0, decode=0, queries=0, hits=0):
    return SchedulerOutput(step_id=step_id, scheduled=(), new_requests=(),
                           finished_request_ids=(), preemptions=(), rejected=(),
                           num_batched_tokens=prefill + decode, num_prefill_tokens=prefill,
                           num_decode_tokens=decode, first_scheduled_request_ids=tuple(first),
                           prefix_cache_queries=queries, prefix_cache_hits=hits,
                           kv_cache_usage=0.25, num_running=running, num_waiting=waiting)


def _update(rid, tokens, reason=None, out=0):
    return RequestUpdate(rid, tuple(tokens), reason, 0, 8, out, 0)


def test_observer_events_and_metrics():
    sink = io.StringIO()
    configure_logging("json", "debug", stream=sink)
    try:
        metrics = EngineMetrics("m", 512, 64)
        obs = StatsObserver(metrics)
        import time
        now = time.monotonic()
        obs.on_received("r1", now, 0, "chat", 1, prompt="secret prompt", stream=True)
        obs.on_queued("r1", "r1", now, 8, 0, "chat")
        obs.on_schedule(_output(0, first=["r1"], prefill=8, queries=8, hits=0), 1, 0, 0.25)
        obs.on_step(_output(0, prefill=8), now, now + 0.01)
        obs.on_update(_update("r1", [5], out=1))
        obs.on_step(_output(1, decode=1), now, now + 0.01)
        obs.on_update(_update("r1", [6], FinishReason.LENGTH, out=2))
        obs.set_load(0, 0, 0.0)
        obs.log_stats(0, 0, 0.0)
    finally:
        configure_logging("json", "info")
    events = [json.loads(line) for line in sink.getvalue().splitlines()]
    names = [e["event"] for e in events]
    assert names == ["request_received", "request_queued", "request_scheduled", "step",
                     "request_first_token", "step", "request_finished", "engine_stats"]
    assert "secret prompt" not in sink.getvalue()  # only with --log-prompts
    finished = events[6]
    assert finished["request_class"] == "chat" and finished["output_tokens"] == 2
    assert finished["stream"] is True and events[0]["stream"] is True  # analyze's split
    assert finished["queue_s"] + finished["prefill_s"] + finished["decode_s"] == \
        pytest.approx(finished["e2e_s"], abs=2e-6)
    samples = parse_metrics_text(metrics.render().decode())
    assert samples["kvserve:time_to_first_token_seconds_count"][0][1] == 1
    assert samples["kvserve:inter_token_latency_seconds_count"][0][1] == 1
    assert samples["kvserve:request_time_per_output_token_seconds_count"][0][1] == 1
    assert samples["kvserve:generation_tokens_total"][0][1] == 2
    assert samples["kvserve:prompt_tokens_total"][0][1] == 8  # the whole prompt
    assert samples["kvserve:prompt_tokens_computed_total"][0][1] == 8  # no cache hit here
    assert samples["kvserve:time_per_output_token_seconds_count"][0][1] == 1
    assert samples["kvserve:request_max_num_generation_tokens_sum"][0][1] == 2
    assert samples["kvserve:request_params_n_sum"][0][1] == 1
    success = {lab["finished_reason"]: v for lab, v in samples["kvserve:request_success_total"]}
    assert success["length"] == 1 and success["stop"] == 0


def test_every_issue_metric_is_exposed_with_its_type_and_label():
    metrics = EngineMetrics("my-model", 512, 64)
    metrics.set_cache_config(block_size=16, enable_prefix_caching=True)
    metrics.set_decode_path("fused")
    text = metrics.render().decode()
    samples = parse_metrics_text(text)
    assert sorted(METRICS) == sorted(ISSUE_HISTOGRAMS + ISSUE_GAUGES + ISSUE_COUNTERS
                                     + STEP_HISTOGRAMS + STEP_COUNTERS + VLLM_HISTOGRAMS
                                     + VLLM_GAUGES + VLLM_COUNTERS + KV_COUNTERS
                                     + KV_HISTOGRAMS + SPEC_COUNTERS + PIPELINE_HISTOGRAMS
                                     + PIPELINE_COUNTERS + DECODE_GAUGES)
    assert samples["kvserve:decode_path_info"] == [({"model_name": "my-model", "path": "fused"},
                                                    1.0)]
    for name in (ISSUE_HISTOGRAMS + STEP_HISTOGRAMS + VLLM_HISTOGRAMS + KV_HISTOGRAMS
                 + PIPELINE_HISTOGRAMS):
        assert f"# TYPE kvserve:{name} histogram" in text
    for name in ISSUE_GAUGES + VLLM_GAUGES + DECODE_GAUGES:
        assert f"# TYPE kvserve:{name} gauge" in text
    for name in (ISSUE_COUNTERS + STEP_COUNTERS + VLLM_COUNTERS + KV_COUNTERS + SPEC_COUNTERS
                 + PIPELINE_COUNTERS):
        assert (f"# TYPE kvserve:{name}_total counter" in text
                or f"# TYPE kvserve:{name} counter" in text), name
    for name in METRICS:
        for series in exposed_series(name):
            assert series in samples, series
    for name, rows in samples.items():
        assert name.startswith("kvserve:"), name
        assert all(labels["model_name"] == "my-model" for labels, _ in rows), name
    assert "_created" not in text


def test_two_engines_have_separate_registries():
    a, b = EngineMetrics("a"), EngineMetrics("b")
    a.generation_tokens.inc(5)
    assert parse_metrics_text(b.render().decode())["kvserve:generation_tokens_total"][0][1] == 0


def test_histogram_quantile_interpolates():
    buckets = [(0.1, 0.0), (0.5, 10.0), (1.0, 20.0), (float("inf"), 20.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.5)
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.75)
    assert histogram_quantile(0.5, []) is None


def _scrape(metrics: EngineMetrics):
    return parse_metrics_text(metrics.render().decode())


def _finish(metrics, queue, prefill, decode, out=10):
    t = RequestTimeline("r", 0.0, 0.0, 100)
    t.scheduled(queue)
    t.tokens(queue + prefill, 1)
    t.finish(queue + prefill + decode, "length", out)
    metrics.observe_first_token(t)
    metrics.observe_finished(t)


def test_diagnose_from_scrapes_queueing_kv_and_idle():
    m = EngineMetrics("m")
    before = _scrape(m)
    assert diagnose(features_from_scrapes(before, _scrape(m))) == []  # idle window
    for _ in range(10):
        _finish(m, queue=3.0, prefill=0.05, decode=0.5)
    m.set_load(2, 8, 0.3)
    verdicts = diagnose(features_from_scrapes(before, _scrape(m)))
    assert [v.kind for v in verdicts] == ["queueing", "target_missed"]  # TTFT 3 s > 2 s
    assert verdicts[0].evidence["queue_share_of_ttft"] > 0.9
    assert verdicts[1].summary.endswith("The verdicts above say why.")
    m2 = EngineMetrics("m2")
    before = _scrape(m2)
    for _ in range(5):
        _finish(m2, queue=0.01, prefill=0.05, decode=0.5)
    m2.observe_scheduling(preemptions=4, queries=0, hits=0, divergences=0)
    m2.set_load(4, 0, 0.97)
    verdicts = diagnose(features_from_scrapes(before, _scrape(m2)))
    assert verdicts[0].kind == "kv_capacity" and verdicts[0].evidence["preemptions"] == 4


def test_rules_prefill_and_decode():
    prefill = Features("logs", num_requests=6, ttft_mean=2.0, e2e_mean=2.2, queue_mean=0.01,
                       queue_p90=0.02, prefill_mean=1.99, prompt_ttft_corr=0.95,
                       prompt_spread=5.0)
    same_length = Features("logs", num_requests=6, ttft_mean=2.0, e2e_mean=2.2, queue_mean=0.01,
                           queue_p90=0.02, prefill_mean=1.99, prompt_ttft_corr=0.95,
                           prompt_spread=1.2)
    assert diagnose(same_length) == []  # TTFT cannot grow with prompt length here
    assert [v.kind for v in diagnose(prefill)] == ["prefill"]
    decode = Features("logs", num_requests=6, ttft_mean=0.1, e2e_mean=3.0, queue_mean=0.01,
                      queue_p90=0.02, prefill_mean=0.09, tpot_p10=0.03, tpot_p50=0.08,
                      tpot_p90=0.12, max_concurrency=4)
    assert [v.kind for v in diagnose(decode)] == ["decode"]
    decode.max_concurrency = 1  # one request at a time: no interference, a host note instead
    assert diagnose(decode) == []
    light = Features("logs", num_requests=6, ttft_mean=0.1, e2e_mean=0.6, queue_mean=0.001,
                     queue_p90=0.002, prefill_mean=0.099, tpot_p10=0.03, tpot_p50=0.032,
                     tpot_p90=0.2)
    assert diagnose(light) == []


def test_a_uniformly_slow_server_misses_its_target_without_finishing_a_request():
    """Issue 48 item 7: four requests at 0.02 tokens/s each finish nothing in
    a 10 s window and show no relative symptom; ``diagnose`` gave no verdict.
    The token rate per running request gives the TPOT that misses."""
    m = EngineMetrics("m")
    before = _scrape(m)
    m.set_load(4, 0, 0.1)
    m.observe_tokens(1, None)  # 1 token in 10 s over 4 running: 0.025 tokens/s each
    features = features_from_scrapes(before, _scrape(m), seconds=10.0)
    (verdict,) = diagnose(features)
    assert verdict.kind == "target_missed"
    assert verdict.evidence["tpot_from_token_rate_s"] == pytest.approx(40.0)
    assert "every step is slow for every request alike" in verdict.summary
    features.tpot_target = 60.0  # a target it meets
    assert diagnose(features) == []


@pytest.mark.parametrize("ttft, verdicts", [(9.7, ["target_missed"]), (1.5, [])])
def test_a_slow_first_token_is_judged_against_the_target(ttft, verdicts):
    """A 9.7 s median TTFT with no queue and even prompts was called fine."""
    f = Features("logs", num_requests=8, ttft_mean=ttft, ttft_p50=ttft, e2e_mean=ttft + 1,
                 queue_mean=0.01, queue_p90=0.02, prefill_mean=ttft - 0.01,
                 prompt_ttft_corr=0.9, prompt_spread=1.1, tpot_p10=0.04, tpot_p50=0.05,
                 tpot_p90=0.06)
    found = diagnose(f)
    assert [v.kind for v in found] == verdicts
    if found:
        assert found[0].summary.startswith("The median TTFT is 9.70 s against a target of 2 s")
        assert "prefill itself takes longer than the target" in found[0].summary
