"""``ThreadHysteresis``: the CPU thread count never flaps (issue 28).

Synthetic load traces, sampled every 0.25 s as ``LoadAdaptiveThreads``
samples ``other_runnable_threads``: pure logic, no sleeps, no /proc.
"""

from __future__ import annotations

import random

import pytest

from kvserve.cpu.threads import LoadAdaptiveThreads, ThreadHysteresis

INTERVAL = 0.25


def drive(policy: ThreadHysteresis, trace, start: float = 0.0) -> list[tuple[float, int]]:
    """Feed ``trace`` (one sample per INTERVAL); the (time, count) of each change."""
    changes, threads = [], policy.threads
    for i, others in enumerate(trace):
        now = start + i * INTERVAL
        if policy.observe(now, others) != threads:
            threads = policy.threads
            changes.append((now, threads))
    return changes


def seconds(n: float) -> int:
    return int(n / INTERVAL)


def bursty(rng: random.Random, n: int, p: float) -> list[int]:
    """A process runnable in a fraction ``p`` of the samples (a load client)."""
    return [int(rng.random() < p) for _ in range(n)]


def test_a_load_client_beside_the_server_changes_nothing():
    """The flapping of issue 28: others runnable 0.4-0.9 of the time (the
    old moving average rounded 0.5 up to a busy core)."""
    rng = random.Random(0)
    for p in (0.2, 0.4, 0.6, 0.7):
        policy = ThreadHysteresis(max_threads=2, cpus=2)
        assert drive(policy, bursty(rng, seconds(600), p)) == [], p
        assert policy.changes == 0


def test_a_busy_process_drops_one_thread_once_and_its_end_brings_it_back():
    rng = random.Random(1)
    policy = ThreadHysteresis(max_threads=2, cpus=2)
    quiet, busy = bursty(rng, seconds(120), 0.3), [1 + c for c in bursty(rng, seconds(300), 0.3)]
    changes = drive(policy, quiet + busy + bursty(rng, seconds(120), 0.3))
    (t_drop, n_drop), (t_back, n_back) = changes
    assert (n_drop, n_back) == (1, 2)
    assert 120 + policy.drop_after <= t_drop <= 120 + policy.window + policy.drop_after + 1
    assert 420 + policy.restore_after <= t_back <= 420 + policy.window + policy.restore_after + 1


def test_two_busy_processes_on_four_cpus_take_two_threads():
    policy = ThreadHysteresis(max_threads=4, cpus=4)
    changes = drive(policy, [0] * seconds(30) + [2] * seconds(120))
    assert [n for _, n in changes] == [2]


def test_a_load_that_comes_and_goes_changes_at_most_once_a_minute():
    policy = ThreadHysteresis(max_threads=2, cpus=2)
    trace = ([1] * seconds(20) + [0] * seconds(20)) * 15  # 10 minutes
    changes = drive(policy, trace)
    assert 1 <= len(changes) <= 10
    times = [t for t, _ in changes]
    assert all(b - a >= policy.min_dwell for a, b in zip(times, times[1:]))


def test_nothing_changes_until_the_window_is_full_again_after_an_idle_spell():
    policy = ThreadHysteresis(max_threads=2, cpus=2)
    assert drive(policy, [0] * seconds(10)) == []
    # no readings for 100 s (no steps ran), then one busy reading: too few to act on
    assert policy.observe(110.0, 2) == 2
    assert policy.observe(110.25, 2) == 2


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="busy_fraction"):
        ThreadHysteresis(2, 2, busy_fraction=0.0)
    with pytest.raises(ValueError, match="max_threads"):
        ThreadHysteresis(0, 2)


def test_the_sampler_reads_the_clock_and_logs_each_change():
    from structlog.testing import capture_logs

    now, others = [0.0], [0]
    adaptive = LoadAdaptiveThreads(max_threads=2, cpus=2, interval=INTERVAL,
                                   sample=lambda: others[0], clock=lambda: now[0])
    with capture_logs() as logs:
        for step in range(seconds(30)):
            now[0] = step * INTERVAL
            others[0] = 0 if now[0] < 10 else 2
            adaptive.current()
            now[0] += 0.1
            adaptive.current()  # between samples: no reading
    assert adaptive.current() == 1 and adaptive.policy.changes == 1
    (entry,) = [e for e in logs if e["event"] == "threads_adapted"]
    assert (entry["num_threads"], entry["previous"], entry["changes"]) == (1, 2, 1)
