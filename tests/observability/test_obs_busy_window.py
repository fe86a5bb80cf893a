"""``kvserve diagnose`` on a busy window where nothing finished (issue 15,
item 5): it says what ran (gauges, token counters), not "lightly loaded"."""

from kvserve.observability.diagnosis import Features, busy_summary, diagnose


def test_a_slow_running_request_is_busy_not_idle() -> None:
    # one request decoding at about 1 s per token, nothing finished in 10 s
    features = Features(source="metrics", num_requests=0, max_waiting=0.0, kv_usage_max=0.02,
                        extra={"running": 1.0, "generation_tokens": 10.0, "prompt_tokens": 0.0})
    assert diagnose(features) == []
    text = busy_summary(features, seconds=10.0)
    assert text.startswith("Busy: 1 running, 0 waiting")
    assert "10 output tokens (1.0/s, 1.00 tokens/s per running request)" in text
    assert "KV cache 2% used" in text and "0 request(s) finished" in text


def test_an_idle_window_has_no_summary() -> None:
    features = Features(source="metrics", extra={"running": 0.0, "generation_tokens": 0.0,
                                                 "prompt_tokens": 0.0})
    assert busy_summary(features, seconds=10.0) is None


def test_one_request_under_outside_cpu_load_is_no_decode_verdict() -> None:
    """A fresh user's report: one running request with uneven ITL (the host
    was busy) got "prefill/decode interference" with no prefill in sight."""
    from kvserve.observability.diagnosis import features_from_scrapes
    from kvserve.observability.metrics import EngineMetrics, parse_metrics_text

    metrics = EngineMetrics("m", 512, 64)
    metrics.set_load(1, 0, 0.02)
    before = parse_metrics_text(metrics.render().decode())
    for itl in [0.05] * 8 + [0.5, 0.6]:
        metrics.observe_tokens(1, itl)
    after = parse_metrics_text(metrics.render().decode())
    features = features_from_scrapes(before, after)
    assert features.max_concurrency == 1
    assert diagnose(features) == []
