"""``StallWatch`` (issue 25): work without a finished step for ``timeout``
seconds is a stall; an idle engine, or work that just arrived, is not."""

import pytest

from kvserve.core.stall import StallWatch


def test_idle_is_never_stalled_however_long() -> None:
    watch = StallWatch(timeout=60)
    watch.on_load(0.0, has_work=False)
    assert watch.stalled_seconds(10_000.0) == 0.0
    assert not watch.reading(10_000.0, 0, 0).is_stalled


def test_work_that_arrives_after_an_idle_hour_starts_its_own_clock() -> None:
    watch = StallWatch(timeout=60)
    watch.on_step(100.0)  # a step long ago, then idle
    watch.on_load(3600.0, has_work=True)
    assert watch.stalled_seconds(3630.0) == 30.0
    assert watch.reading(3661.0, num_running=2, num_waiting=3).is_stalled


def test_each_step_restarts_the_clock_and_no_work_stops_it() -> None:
    watch = StallWatch(timeout=5)
    watch.on_load(0.0, has_work=True)
    for t in (1.0, 2.5, 7.0):
        watch.on_step(t)
    reading = watch.reading(11.0, 1, 0)
    assert reading.stalled_seconds == 4.0 and not reading.is_stalled
    assert watch.reading(12.0, 1, 0).is_stalled  # 5 s since the step at 7.0
    watch.on_load(12.5, has_work=False)
    assert watch.stalled_seconds(99.0) == 0.0


def test_the_reason_gives_the_figures() -> None:
    watch = StallWatch(timeout=30)
    watch.on_load(0.0, has_work=True)
    reason = watch.reading(45.0, num_running=4, num_waiting=7).reason()
    assert "45 s" in reason and "4 request(s) ran and 7 waited" in reason
    assert "limit 30 s" in reason and "--stall-timeout" in reason


def test_a_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError):
        StallWatch(timeout=0)
