"""``DrainRate``: the Retry-After of a 429 is the time the waiting queue,
at its measured release rate, needs to make room (issue 14, item 4)."""

import pytest

from kvserve.core.admission_queue import AdmissionLimits, AdmissionQueue
from kvserve.core.drain_rate import MAX_RETRY_SECONDS, DrainRate
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams


def test_no_release_measured_gives_the_default() -> None:
    rate = DrainRate()
    assert rate.retry_after(0.0, 5, 0, default=1.0) == 1.0
    rate.record(0.0, 0, 0)
    assert rate.retry_after(3.0, 5, 0, default=2.0) == 2.0


def test_seconds_are_the_overflow_over_the_rate() -> None:
    rate = DrainRate(window_seconds=20)
    rate.record(0.0, 0, 0)
    for t in range(1, 11):  # 2 sequences (100 tokens) per second for 10 s
        rate.record(float(t), 2, 100)
    assert rate.rates(10.0) == pytest.approx((2.0, 100.0))
    assert rate.retry_after(10.0, 10, 0, default=1.0) == 5.0        # 10 / 2 per s
    assert rate.retry_after(10.0, 1, 1000, default=1.0) == 10.0     # tokens bind: 1000 / 100
    assert rate.retry_after(10.0, 1, 0, default=1.0) == 1.0         # at least 1 s
    assert rate.retry_after(10.0, 10_000, 0, default=1.0) == MAX_RETRY_SECONDS


def test_old_releases_leave_the_window() -> None:
    rate = DrainRate(window_seconds=10)
    rate.record(0.0, 10, 0)
    assert rate.rates(5.0) == pytest.approx((2.0, 0.0))
    assert rate.rates(10.5) is None  # nothing left the queue for 10 s: not measured
    rate.record(11.0, 5, 0)
    assert rate.rates(11.0) == pytest.approx((0.5, 0.0))  # 5 over a full 10 s window


def _request(rid: str, tokens: int) -> Request:
    return Request(rid, tuple(range(tokens)), SamplingParams(max_tokens=4), arrival_time=0.0)


def test_overflow_counts_what_must_leave_before_a_request_fits() -> None:
    queue = AdmissionQueue(AdmissionLimits(max_waiting_requests=3, max_waiting_tokens=100),
                           block_size=16, max_chunk_tokens=64)
    for i in range(3):
        queue.add(_request(f"r{i}", 30))
    assert queue.overflow(1, 10) == (1, 0)
    assert queue.overflow(2, 20) == (2, 30)  # 90 + 40 tokens against 100
    assert AdmissionQueue(AdmissionLimits(), 16, 64).overflow(5, 10_000) == (0, 0)
