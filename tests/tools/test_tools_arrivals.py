"""Arrival processes have the requested mean rate; record-then-replay reproduces
the recorded arrival offsets; make_trace writes the four classes."""

from __future__ import annotations

import datetime as dt
import json
import random

import numpy as np
import pytest

from kvserve.bench.make_trace import main as make_trace_main
from kvserve.bench.trace import CLASSES, read_trace
from kvserve.bench.workload import arrival_offsets, requests_from_logs

N = 20000


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
def test_poisson_mean_rate(rate):
    t = arrival_offsets(N, "poisson", rate, seed=1)
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    gaps = np.diff(t)
    # mean of N exponential gaps has relative standard error 1/sqrt(N) = 0.7 %
    assert (N - 1) / t[-1] == pytest.approx(rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # CV of exponential


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_mean_rate_and_burstiness(burstiness):
    rate = 3.0
    gaps = np.diff(arrival_offsets(N, "gamma", rate, burstiness, seed=2))
    assert 1.0 / gaps.mean() == pytest.approx(rate, rel=0.05)
    # gamma with shape k has CV 1/sqrt(k): burstier below 1, smoother above
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.08)


def test_concurrency_arrivals_all_at_zero():
    assert np.all(arrival_offsets(10, "concurrency") == 0)
    with pytest.raises(ValueError):
        arrival_offsets(10, "poisson", 0)


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat().replace("+00:00", "Z")


def test_record_then_replay_reproduces_offsets(tmp_path):
    """A fake kvserve log (arrival_time as wall-clock seconds, lines in finish
    order, noise lines in between) gives a trace with the recorded offsets."""
    rng = random.Random(0)
    t0 = 1_790_000_000.0
    arrivals = sorted(t0 + rng.uniform(0, 30) for _ in range(25))
    lines = ['{"event": "engine_loaded", "level": "info"}', "INFO: Uvicorn running", "not json {"]
    finished = []
    for i, a in enumerate(arrivals):
        e2e = rng.uniform(0.1, 5.0)
        finished.append((a + e2e, json.dumps({
            "request_id": f"req-{i}", "arrival_time": a, "finish_reason": "length",
            "priority": i % 3, "request_class": "agent" if i % 2 else "short_qa",
            "prompt_tokens": 20 + i, "output_tokens": 5 + i, "e2e_s": e2e,
            "event": "request_finished", "level": "info", "timestamp": _iso(a + e2e)})))
    finished.sort()
    lines += [line for _, line in finished]
    log = tmp_path / "server.log"
    log.write_text("\n".join(lines) + "\n")
    out = tmp_path / "recorded.jsonl"
    assert make_trace_main(["--arrival", "log", "--log", str(log), "-o", str(out)]) == 0
    requests, meta = read_trace(out)
    assert meta["arrival_source"] == {"arrival_time": 25}
    assert [r.id for r in requests] == [f"req-{i}" for i in range(25)]
    np.testing.assert_allclose([r.arrival_s for r in requests],
                               [a - arrivals[0] for a in arrivals], atol=1e-5)
    assert [r.output_tokens for r in requests] == [5 + i for i in range(25)]
    assert [r.priority for r in requests] == [i % 3 for i in range(25)]
    assert requests[1].cls == "agent" and requests[0].cls == "short_qa"


def test_log_reader_tolerates_other_field_names(tmp_path):
    """ISO-string arrivals, or only a finish timestamp minus e2e_s."""
    t0 = 1_790_000_000.0
    recs = [{"event": "request_finished", "request_id": "a", "arrival_wall_time": _iso(t0 + 1.5),
             "output_tokens": 3},
            {"event": "request_finished", "request_id": "b", "timestamp": _iso(t0 + 4.0),
             "e2e_s": 2.0, "output_tokens": 3},
            {"event": "request_finished", "request_id": "c", "arrival_time": t0}]
    log = tmp_path / "l.log"
    log.write_text("\n".join(json.dumps(r) for r in recs))
    requests, meta = requests_from_logs([log])
    assert {r.id: r.arrival_s for r in requests} == pytest.approx({"c": 0.0, "a": 1.5, "b": 2.0},
                                                                  abs=1e-3)
    assert meta["arrival_source"] == {"arrival_wall_time": 1, "timestamp-e2e_s": 1,
                                      "arrival_time": 1}


def test_make_trace_classes_mix_and_prefix_groups(tmp_path):
    out = tmp_path / "t.jsonl"
    assert make_trace_main(["-n", "400", "--arrival", "gamma", "--rate", "2", "--burstiness",
                            "0.5", "--scale", "0.1", "--seed", "3", "--priority", "short_qa=0",
                            "-o", str(out)]) == 0
    requests, meta = read_trace(out)
    assert meta["rate"] == 2.0 and meta["burstiness"] == 0.5
    counts = {c: sum(r.cls == c for r in requests) for c in CLASSES}
    assert counts["short_qa"] == pytest.approx(160, abs=40)  # default mix 0.4
    assert all(counts[c] > 40 for c in CLASSES)
    agents = [r for r in requests if r.cls == "agent"]
    by_group: dict[str, list[str]] = {}
    for r in agents:
        by_group.setdefault(r.prefix_group, []).append(r.prompt)
    for prompts in by_group.values():  # a long fixed prefix, changing state
        prefix = prompts[0].split("\nStep")[0]
        assert all(p.startswith(prefix) for p in prompts) and len(set(prompts)) == len(prompts)
    assert all(r.priority == 0 for r in requests if r.cls == "short_qa")
    code = [r.output_tokens for r in requests if r.cls == "code"]
    qa = [r.output_tokens for r in requests if r.cls == "short_qa"]
    assert np.mean(code) > 3 * np.mean(qa)  # code generation: long outputs
    # a trace line round-trips through the documented format
    first = json.loads(out.read_text().splitlines()[1])
    assert set(first) >= {"id", "arrival_s", "class", "prompt", "prompt_tokens", "output_tokens",
                          "priority", "prefix_group", "stream"}
