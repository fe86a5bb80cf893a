"""Acceptance (issue 6): the log analyser names the right bottleneck, with its
evidence, on logs recorded from real engine runs (``tools/record_scenarios.py``
-> ``tests/observability/data/*.jsonl``), and no bottleneck on a lightly
loaded server; ``kvserve analyze`` writes the report and the plots."""

from __future__ import annotations

import json

import pytest
from conftest import DATA

from kvserve.observability.analysis import analyze, load_log

SCENARIOS = {"overload": "queueing", "long_prompts": "prefill", "tiny_kv": "kv_capacity",
             "light": None}


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def scenario(request):
    return request.param, analyze(load_log(DATA / f"{request.param}.jsonl"))


def test_fixture_comes_from_a_real_engine_run(scenario):
    name, result = scenario
    data = result.data
    assert len(data.requests) >= 6 and data.stats, name
    assert len(data.received) == len(data.requests)
    for r in data.requests:
        assert r["request_id"].startswith(name)
        assert r["queue_s"] + r["prefill_s"] + r["decode_s"] == \
            pytest.approx(r["e2e_s"], abs=0.003)
        assert r["arrival_time"] > 1.6e9  # wall-clock epoch seconds


def test_the_analyser_names_the_bottleneck(scenario):
    name, result = scenario
    expected = SCENARIOS[name]
    kinds = [v.kind for v in result.verdicts]
    assert result.bottleneck == expected, (name, kinds, result.features)
    if expected is None:
        assert "**No bottleneck**" in result.report
        return
    verdict = result.verdicts[0]
    assert verdict.evidence and f"`{expected}`" in result.report
    f = result.features
    if expected == "queueing":
        assert "kv_capacity" not in kinds and "prefill" not in kinds
        assert verdict.evidence["queue_share_of_ttft"] >= 0.5
        assert verdict.evidence["queue_p90_s"] >= 0.25
        assert verdict.evidence["corr(queue, ttft)"] >= 0.5
        assert f.queue_last_third_mean > f.queue_first_third_mean  # queue builds up
    elif expected == "prefill":
        assert "queueing" not in kinds and "kv_capacity" not in kinds
        assert verdict.evidence["corr(prompt_tokens, ttft)"] >= 0.6
        assert verdict.evidence["prefill_share_of_ttft"] >= 0.5
        assert verdict.evidence["ttft_s_per_1k_prompt_tokens"] > 0
    elif expected == "kv_capacity":
        assert verdict.evidence["preemptions"] >= 1
        assert verdict.evidence["kv_usage_max"] >= 0.9


def test_kvserve_analyze_writes_report_and_plots(tmp_path, capsys):
    from kvserve.cli import main

    out = tmp_path / "report"
    assert main(["analyze", str(DATA / "overload.jsonl"), "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["bottleneck"] == "queueing"
    report = (out / "report.md").read_text(encoding="utf-8")
    for heading in ("## Diagnosis", "By workload class", "By prompt length", "By priority",
                    "## Throughput over time", "## Per-request phases"):
        assert heading in report
    for png in ("latency_cdf.png", "queue_kv_over_time.png", "ttft_vs_prompt.png",
                "throughput_over_time.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "requests.csv").read_text().count("\n") == 13  # header + 12 requests


def test_missing_log_file_is_an_error(tmp_path, capsys):
    from kvserve.cli import main

    assert main(["analyze", str(tmp_path / "nope.jsonl")]) == 2


@pytest.mark.parametrize("content, words", [
    ("2026-12-06 04:00:01 [info     ] request_finished   request_id=cmpl-1 e2e_s=0.4\n"
     "2026-12-06 04:00:02 [info     ] engine_stats       num_running=0\n", "2 lines hold no"),
    ("", "it is empty"),
])
def test_a_log_it_cannot_read_is_an_error_not_an_empty_report(tmp_path, capsys, content, words):
    """Issue 48, item 7: a terminal's console-format log (or nothing) is not
    "0 requests, no bottleneck": the command says it cannot read it."""
    from kvserve.cli import main

    path = tmp_path / "console.log"
    path.write_text(content, encoding="utf-8")
    assert main(["analyze", str(path), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert f"cannot read {path}" in err and words in err and "--log-format json" in err
