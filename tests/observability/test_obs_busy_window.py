"""``kvserve diagnose`` on a busy window where nothing finished (issue 15,
item 5): it says what ran (gauges, token counters), not "lightly loaded"."""

from kvserve.diagnosis import Features, busy_summary, diagnose


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
