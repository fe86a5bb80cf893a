"""Acceptance (issue 33, item 6): ``kvserve analyze`` on a log the current
engine has just written, not on a recorded fixture.

One ``kvserve serve`` with a KV cache of 9 blocks of 8 tokens serves five
requests: the same 40-token prompt twice, one after the other (the second
hits the prefix cache), then three concurrent requests of 12 prompt + 16
output tokens (4 blocks each, 12 > 9: the three fill the cache while they
hold 3 blocks each, and the first to need a 4th preempts). ``kvserve
analyze --json`` then reads the log. One server thread (``--num-threads 1``)
keeps the run short on a shared 2-core machine.

The references are the log's own events and the HTTP responses, never the
analyser: the request count is what was sent; ``request_finished``'s phase
times sum to its E2E and the report and ``requests.csv`` repeat them;
preemptions are the ``request_preempted`` lines; cached tokens are
``request_scheduled``'s, the response's ``usage`` and whole blocks of the
prompt; the verdicts follow from the rules of
``kvserve.observability.diagnosis``'s docstring applied here, with numpy, to
those events (``kv_capacity`` first: a preemption with the cache full).
"""

from __future__ import annotations

import csv
import json
import os
import random
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from e2e_support import LiveServer

pytestmark = pytest.mark.model

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 8
KV_BLOCKS = 9
#: The default model's KV bytes per token (float32): 30 layers x 3 KV heads x 64 x (K, V) x 4.
KV_BYTES_PER_TOKEN = 46_080
PREFIX_LEN, PREFIX_OUTPUT = 40, 4
CONCURRENT_LEN, CONCURRENT_OUTPUT, CONCURRENT = 12, 16, 3
PREFIX_IDS = ("prefix-0", "prefix-1")
CONCURRENT_IDS = tuple(f"kv-{i}" for i in range(CONCURRENT))
SENT = PREFIX_IDS + CONCURRENT_IDS
HANG_S = 300.0  # a hang deadline, never a speed check


@dataclass
class Run:
    events: dict[str, list[dict]]  # event name -> the log's events, in order
    usage: dict[str, dict]  # request id -> the HTTP response's usage
    printed: dict  # kvserve analyze --json
    report: str
    csv_rows: dict[str, dict[str, str]]  # request id -> requests.csv row


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(length)]


def _complete(base_url: str, request_id: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    try:
        with httpx.Client(base_url=base_url, timeout=HANG_S) as client:
            response = client.post("/v1/completions", json=body,
                                   headers={"X-Request-Id": request_id})
    except httpx.TimeoutException:
        raise AssertionError(f"{request_id}: no answer in {HANG_S} s "
                             f"(load average {os.getloadavg()})") from None
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def _read_events(path: Path) -> dict[str, list[dict]]:
    events: dict[str, list[dict]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            events.setdefault(event.get("event"), []).append(event)
    return events


@pytest.fixture(scope="module")
def run(default_model_path, tmp_path_factory) -> Run:
    log_dir = tmp_path_factory.mktemp("kvserve-analyze-fresh")
    server = LiveServer(default_model_path, log_dir, extra_args=[
        "--kv-cache-memory", str(KV_BLOCKS * BLOCK * KV_BYTES_PER_TOKEN),
        "--max-model-len", str(KV_BLOCKS * BLOCK), "--block-size", str(BLOCK),
        "--num-threads", "1", "--log-level", "debug", "--stats-interval", "1"])
    rng = random.Random(33)
    usage = {}
    try:
        prefix = _prompt(rng, PREFIX_LEN)
        for request_id in PREFIX_IDS:  # one after the other: the second finds the first's blocks
            usage[request_id] = _complete(server.base_url, request_id, prefix, PREFIX_OUTPUT)
        prompts = [_prompt(rng, CONCURRENT_LEN) for _ in CONCURRENT_IDS]
        with ThreadPoolExecutor(CONCURRENT) as pool:
            futures = {rid: pool.submit(_complete, server.base_url, rid, p, CONCURRENT_OUTPUT)
                       for rid, p in zip(CONCURRENT_IDS, prompts)}
            usage.update({rid: f.result() for rid, f in futures.items()})
    finally:
        server.stop()
    log = server.stderr_path
    out = log_dir / "analysis"
    try:
        done = subprocess.run([sys.executable, "-m", "kvserve.cli", "analyze", str(log),
                               "--out", str(out), "--json", "--no-plots"],
                              capture_output=True, text=True, timeout=HANG_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"kvserve analyze did not finish in {HANG_S} s "
                             f"(load average {os.getloadavg()})") from None
    assert done.returncode == 0, done.stderr
    with open(out / "requests.csv", newline="", encoding="utf-8") as handle:
        rows = {row["request_id"]: row for row in csv.DictReader(handle)}
    return Run(_read_events(log), usage, json.loads(done.stdout),
               (out / "report.md").read_text(encoding="utf-8"), rows)


def _finished(run: Run) -> dict[str, dict]:
    return {e["request_id"]: e for e in run.events["request_finished"]}


def _preempted(run: Run) -> list[str]:
    return [e["request_id"] for e in run.events.get("request_preempted", [])]


def _table(report: str, heading: str) -> list[dict[str, str]]:
    """The rows of the first Markdown table after ``heading``, keyed by column."""
    lines = report[report.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")))))
    return rows


# ----------------------------------------------------------- the run itself


@pytest.mark.slow
def test_the_run_preempted_and_hit_the_prefix_cache(run: Run):
    """The scenario happened as designed (else the checks below prove little)."""
    finished = _finished(run)
    assert sorted(finished) == sorted(SENT)
    assert sorted(e["request_id"] for e in run.events["request_received"]) == sorted(SENT)
    assert _preempted(run), "no request_preempted line: the KV cache was not too small"
    steps = run.events["step"]
    assert max(s["kv_cache_usage"] for s in steps) == 1.0, (  # 3 requests x 3 blocks = 9
        f"the concurrent requests did not overlap (load average {os.getloadavg()})")
    assert max(s["batch_size"] for s in steps) == CONCURRENT
    # prefix caching hits whole blocks and always computes the prompt's last token
    expected_hit = (PREFIX_LEN - 1) // BLOCK * BLOCK
    scheduled = {e["request_id"]: e for e in run.events["request_scheduled"]}
    assert run.usage["prefix-1"]["prompt_tokens_details"]["cached_tokens"] == expected_hit
    assert scheduled["prefix-1"]["cached_tokens"] == expected_hit
    assert scheduled["prefix-0"]["cached_tokens"] == 0
    for rid in SENT:
        assert finished[rid]["output_tokens"] == run.usage[rid]["completion_tokens"]
        assert finished[rid]["prompt_tokens"] == run.usage[rid]["prompt_tokens"]


# ----------------------------------------------------------------- analyse


def test_analyze_counts_the_requests_sent(run: Run):
    n = len(SENT)
    assert run.printed["features"]["num_requests"] == n
    assert run.report.startswith(f"# kvserve log analysis\n\n{n} finished requests ({n} with a "
                                 f"first token), {len(run.events['engine_stats'])} engine_stats "
                                 f"lines, {len(run.events['step'])} step events")
    assert sorted(run.csv_rows) == sorted(SENT)
    assert sorted(r["request"] for r in _table(run.report, "## Per-request phases")) \
        == sorted(SENT)


def test_phase_breakdown_sums_to_the_logged_e2e(run: Run):
    finished = _finished(run)
    for rid, row in run.csv_rows.items():  # full precision: the log's 6 decimals
        logged = finished[rid]
        for phase in ("queue_s", "prefill_s", "decode_s", "ttft_s", "e2e_s"):
            assert float(row[phase]) == logged[phase], (rid, phase)
        parts = float(row["queue_s"]) + float(row["prefill_s"]) + float(row["decode_s"])
        assert parts == pytest.approx(logged["e2e_s"], abs=2e-6), rid  # 4 values rounded to 1e-6
    for row in _table(run.report, "## Per-request phases"):  # 3 decimals each
        logged = finished[row["request"]]
        for column, phase in (("queue s", "queue_s"), ("prefill s", "prefill_s"),
                              ("decode s", "decode_s"), ("E2E s", "e2e_s")):
            assert float(row[column]) == pytest.approx(logged[phase], abs=5.1e-4), row
        parts = sum(float(row[c]) for c in ("queue s", "prefill s", "decode s"))
        assert parts == pytest.approx(logged["e2e_s"], abs=2.1e-3), row
    # the "All requests" table: mean / p50 / p90 / p99 of each phase, from the log with numpy
    (summary,) = _table(run.report, "### All requests")
    assert summary["n"] == str(len(SENT))
    for phase in ("queue", "prefill", "ttft", "tpot", "e2e"):
        values = [finished[rid][f"{phase}_s"] for rid in SENT]
        shown = [float(x) for x in summary[f"{phase} mean / p50 / p90 / p99 (s)"].split(" / ")]
        want = [statistics.fmean(values), *np.percentile(values, [50, 90, 99])]
        assert shown == pytest.approx(want, abs=5.1e-4), phase


def test_preemptions_and_cached_tokens_are_reported(run: Run):
    preempted = _preempted(run)
    finished = _finished(run)
    scheduled = {e["request_id"]: e for e in run.events["request_scheduled"]}
    assert sum(e["preemptions"] for e in finished.values()) == len(preempted)
    assert f", {len(preempted)} preemptions.\n" in run.report
    features = run.printed["features"]
    assert features["preemptions"] == len(preempted)
    assert features["preempted_requests"] == len(set(preempted))
    table = {r["request"]: r for r in _table(run.report, "## Per-request phases")}
    for rid in SENT:
        want_preempt = preempted.count(rid)
        want_cached = run.usage[rid]["prompt_tokens_details"]["cached_tokens"]
        assert want_cached == scheduled[rid]["cached_tokens"]
        assert int(run.csv_rows[rid]["preemptions"]) == want_preempt, rid
        assert int(table[rid]["preempt"]) == want_preempt, rid
        assert int(run.csv_rows[rid]["cached_tokens"]) == want_cached, rid
        assert int(table[rid]["cached"]) == want_cached, rid
    assert int(table["prefix-1"]["cached"]) == (PREFIX_LEN - 1) // BLOCK * BLOCK


def _pearson(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3 or np.std(xs) == 0 or np.std(ys) == 0:
        return None
    return float(np.corrcoef(xs, ys)[0, 1])


def expected_verdicts(events: dict[str, list[dict]]) -> list[str]:
    """The verdict kinds, in precedence order, that the rules of
    ``kvserve.observability.diagnosis`` (its docstring) give for these
    events: computed here with numpy, not with the analyser."""
    reqs = [r for r in events["request_finished"] if r["ttft_s"] is not None]
    col = {k: [r[k] for r in reqs] for k in ("queue_s", "prefill_s", "ttft_s", "e2e_s",
                                             "prompt_tokens")}
    ttft_mean, e2e_mean = np.mean(col["ttft_s"]), np.mean(col["e2e_s"])
    kv = [s["kv_cache_usage"] for s in events["step"]]
    kinds = []
    # kv_capacity: a preemption, and KV usage >= 0.9 at some point or >= 0.8 half the time
    if events.get("request_preempted") and (
            max(kv) >= 0.9 or np.mean([v >= 0.8 for v in kv]) >= 0.5):
        kinds.append("kv_capacity")
    # queueing: queue is half of TTFT, p90 queue >= 0.25 s, queue moves with TTFT
    corr = _pearson(col["queue_s"], col["ttft_s"])
    if (np.mean(col["queue_s"]) / ttft_mean >= 0.5 and np.percentile(col["queue_s"], 90) >= 0.25
            and (corr is None or corr >= 0.5)):
        kinds.append("queueing")
    # prefill: half of TTFT, 30% of E2E, >= 0.1 s, prompts vary 2x and TTFT follows them
    prefill = np.mean(col["prefill_s"])
    p10, p90 = np.percentile(col["prompt_tokens"], [10, 90])
    corr = _pearson(col["prompt_tokens"], col["ttft_s"])
    if (prefill / ttft_mean >= 0.5 and prefill / e2e_mean >= 0.3 and prefill >= 0.1
            and p90 / p10 >= 2 and corr is not None and corr >= 0.6):
        kinds.append("prefill")
    # decode: neither TTFT verdict, requests ran together, TPOT poor for most of them
    tpot = [r["tpot_s"] for r in reqs if r["tpot_s"] is not None]
    t10, t50, t90 = np.percentile(tpot, [10, 50, 90])
    if ("queueing" not in kinds and "prefill" not in kinds
            and max(s["batch_size"] for s in events["step"]) > 1
            and t10 > 0 and t50 >= 1.5 * t10 and t90 >= 2 * t10):
        kinds.append("decode")
    return kinds


def test_the_verdict_follows_from_the_log(run: Run):
    expected = expected_verdicts(run.events)
    assert expected[0] == "kv_capacity"  # the run was built for it (first test)
    printed = run.printed
    assert [v["kind"] for v in printed["verdicts"]] == expected, printed["features"]
    assert printed["bottleneck"] == "kv_capacity"
    evidence = printed["verdicts"][0]["evidence"]
    assert evidence["preemptions"] == len(_preempted(run))
    assert evidence["requests"] == len(SENT)
    assert evidence["kv_usage_max"] == 1.0
    assert "**Bottleneck: KV-cache capacity limits concurrency** (`kv_capacity`)" in run.report
