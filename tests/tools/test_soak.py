"""tools/soak.py (``kvserve.bench.soak``): the pure parts (outcome classes,
loopback check, percentile, gauges, stream checks, the seeded mix), then one
short soak against a live ``kvserve serve`` it starts itself."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvserve.bench import soak
from kvserve.bench.soak import (
    DEFAULT_MIX,
    FAILURES,
    OUTCOMES,
    Budget,
    StreamRead,
    Target,
    apply_event,
    body_problem,
    classify,
    loopback_error,
    make_plans,
    parse_gauges,
    parse_mix,
    percentile,
    sse_payloads,
    stream_end_problem,
)

TOOL = Path(__file__).resolve().parents[2] / "tools" / "soak.py"
#: The live test's load: seed, workers, largest max_tokens, burst size.
LIVE_SEED, LIVE_CONCURRENCY, LIVE_MAX_TOKENS, LIVE_BURST = 0, 8, 16, 4


# --------------------------------------------------------------------------- outcomes


@pytest.mark.parametrize("expect, status, kwargs, outcome", [
    ("ok", 200, {}, "complete"),
    ("ok", 200, {"hung_up": True}, "disconnect"),
    ("ok", 200, {"body_ok": False}, "bad_body"),
    ("ok", 200, {"body_ok": False, "hung_up": True}, "bad_body"),
    ("ok", 204, {}, "bad_body"),
    ("ok", 400, {}, "unexpected_4xx"),
    ("ok", 429, {}, "429/503"),
    ("ok", 503, {}, "429/503"),
    ("ok", 500, {}, "5xx"),
    ("ok", 502, {}, "5xx"),
    ("4xx", 400, {}, "4xx"),
    ("4xx", 404, {}, "4xx"),
    ("4xx", 422, {}, "4xx"),
    ("4xx", 503, {}, "429/503"),
    ("4xx", 200, {}, "unexpected_2xx"),
    ("4xx", 500, {}, "5xx"),
    ("400", 400, {}, "4xx"),
    ("400", 413, {}, "unexpected_4xx"),
    ("ok", None, {"error": "timeout"}, "timeout"),
    ("4xx", None, {"error": "transport_error"}, "transport_error"),
    ("ok", None, {}, "transport_error"),
])
def test_classify(expect, status, kwargs, outcome):
    assert classify(expect, status, **kwargs) == outcome
    assert outcome in OUTCOMES


def test_failure_classes():
    assert FAILURES == {"5xx", "transport_error", "timeout", "unexpected_4xx",
                        "unexpected_2xx", "bad_body"}
    assert FAILURES < set(OUTCOMES)


# --------------------------------------------------------------------------- loopback


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:8000/",
                                 "http://LOCALHOST", "http://[::1]:9000", "https://127.0.0.1"])
def test_loopback_accepted(url):
    assert loopback_error(url) is None


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000", "http://example.com", "http://0.0.0.0:80",
                                 "http://127.0.0.2:8000", "http://[::2]:80", "ftp://127.0.0.1",
                                 "127.0.0.1:8000", "http://localhost.example.com"])
def test_loopback_refused(url):
    assert loopback_error(url)


def test_cli_refuses_remote_url(capsys):
    assert soak.main(["--url", "http://192.168.1.10:8000", "--duration", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "loopback" in err


@pytest.mark.parametrize("argv", [["--server-pid", "1"],
                                  ["--url", "http://127.0.0.1:1", "--model", "m"],
                                  ["--url", "http://127.0.0.1:1", "--server-pid", "999999999"],
                                  ["--mix", "stream=1,nope=2"]])
def test_cli_usage_errors(argv, capsys):
    assert soak.main(argv) == 2
    assert capsys.readouterr().err.startswith("soak: error:")


# --------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    values = list(np.random.default_rng(3).exponential(5.0, size=101))
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges():
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0], 50) == 1.5


def test_parse_gauges():
    text = ("# HELP kvserve:num_requests_running x\n# TYPE kvserve:num_requests_running gauge\n"
            'kvserve:num_requests_running{model_name="m"} 3.0\n'
            'kvserve:kv_cache_usage_perc{model_name="m",x="a b"} 0.25\n'
            "plain_metric 7\nbroken_line\n")
    assert parse_gauges(text) == {"kvserve:num_requests_running": 3.0,
                                  "kvserve:kv_cache_usage_perc": 0.25, "plain_metric": 7.0}


def test_parse_mix():
    assert parse_mix(None) == DEFAULT_MIX
    mix = parse_mix("stream=2, bad=1")
    assert mix["stream"] == 2 and mix["bad"] == 1 and mix["burst"] == 0
    for bad in ("stream", "nope=1", "stream=-1", "stream=0"):
        with pytest.raises(ValueError):
            parse_mix(bad)


def test_budget_stops_at_max_requests():
    budget = Budget(deadline=float("inf"), max_requests=5)
    assert [budget.take(3), budget.take(3), budget.take(1)] == [3, 2, 0]
    assert Budget(deadline=0.0, max_requests=None).take(1) == 0


def test_budget_stop():
    budget = Budget(deadline=float("inf"), max_requests=None)
    assert budget.take(2) == 2
    budget.stop("server gone")
    budget.stop("later reason")
    assert budget.take(1) == 0 and budget.stopped == "server gone"


def test_proc_readers():
    pid = os.getpid()
    assert soak.alive(pid) and soak.fd_count(pid) > 0 and soak.rss_mib(pid) > 1.0
    assert soak.fd_count(999_999_999) is None and soak.rss_mib(999_999_999) is None
    assert not soak.alive(999_999_999)


def test_wait_until_polls_to_a_deadline():
    values = iter(range(100))

    async def read() -> int:
        return next(values)

    async def go():
        now = time.monotonic()
        hit = await soak.wait_until(read, lambda v: v >= 3, now + 30, interval_s=0.001)
        miss = await soak.wait_until(read, lambda v: v < 0, now + 0.05, interval_s=0.001)
        return hit, miss

    hit, miss = asyncio.run(go())
    assert hit == (True, 3) and miss[0] is False and miss[1] > 3


# --------------------------------------------------------------------------- bodies and streams


def _read(lines: list[str], plan) -> StreamRead:
    async def go() -> StreamRead:
        async def source():
            for line in lines:
                yield line
        st = StreamRead()
        async for payload in sse_payloads(source()):
            apply_event(st, payload, plan)
            if st.problem:
                return st
        st.problem = stream_end_problem(st, plan)
        return st
    return asyncio.run(go())


def _chunk(content: str | None = None, finish: str | None = None, usage: dict | None = None):
    choices = [] if content is None else [{"index": 0, "delta": {"content": content},
                                           "finish_reason": finish}]
    return f"data: {json.dumps({'choices': choices, 'usage': usage})}"


def _stream_plan(max_tokens: int = 2, ignore_eos: bool = True):
    target = Target("m", 512, max_tokens=max_tokens)
    plan = make_plans("stream", random.Random(1), target)[0]
    return replace(plan, max_tokens=max_tokens, ignore_eos=ignore_eos)


def test_stream_complete_and_bad():
    plan = _stream_plan()
    usage = {"completion_tokens": 2}
    good = [_chunk("a"), "", _chunk("b", "length"), "", _chunk(usage=usage), "", "data: [DONE]", ""]
    st = _read(good, plan)
    assert st.problem is None and st.done and st.events == 4
    assert _read(good[:-2], plan).problem.startswith("stream ended without [DONE]")
    assert "not JSON" in _read(["data: {oops", ""], plan).problem
    assert "error" in _read(['data: {"error": {"message": "boom"}}', ""], plan).problem
    assert "after [DONE]" in _read(good + [_chunk("c"), ""], plan).problem
    for odd in ('data: [1, 2]', 'data: {"choices": [3]}', 'data: {"choices": null}', "data: 7"):
        assert "malformed" in _read([odd, ""], plan).problem
    short = [_chunk("a", "length"), "", _chunk(usage={"completion_tokens": 1}), "",
             "data: [DONE]", ""]
    assert "completion_tokens 1" in _read(short, plan).problem  # ignore_eos: exactly max_tokens
    assert _read(short, _stream_plan(ignore_eos=False)).problem is None


def test_body_problem():
    plan = _stream_plan(max_tokens=4, ignore_eos=False)
    ok = {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
          "usage": {"completion_tokens": 3}}
    assert body_problem(json.dumps(ok).encode(), plan) is None
    assert body_problem(b"<html>", plan)
    assert body_problem(json.dumps({"choices": []}).encode(), plan)
    assert body_problem(json.dumps({**ok, "usage": {"completion_tokens": 5}}).encode(), plan)
    no_finish = {**ok, "choices": [{"text": "x", "finish_reason": None}]}
    assert body_problem(json.dumps(no_finish).encode(), plan)


# --------------------------------------------------------------------------- the mix


def test_plans_expectations():
    target = Target("m", 512, max_tokens=16, burst_size=4)
    rng = random.Random(5)
    for kind in DEFAULT_MIX:
        for _ in range(20):
            plans = make_plans(kind, rng, target)
            assert len(plans) == (4 if kind == "burst" else 1)
            for p in plans:
                assert p.path in ("/v1/chat/completions", "/v1/completions")
                assert p.expect == {"bad": "4xx", "oversized": "400"}.get(kind, "ok")
                if p.expect == "ok":
                    assert 1 <= p.body["max_tokens"] <= 16
                assert (p.hangup_after in (1, 2)) == (kind == "disconnect")
                assert (p.pause_s > 0) == (kind == "slow")
    assert make_plans("oversized", rng, Target("m", None))[0].expect == "ok"


def test_oversized_prompts():
    rng = random.Random(2)
    seen = {}
    for _ in range(20):
        variant, prompt = soak.oversized_prompt(rng, 512)
        seen[variant] = prompt
    assert len(seen["tokens"].split()) == 2 * 512 + 64  # words: one token or more each
    assert len(seen["chars"]) == 96 * 512 > 81 * 512  # 81: SmolLM2's longest token, bytes
    for _ in range(10):  # too many characters for one request: only the token variant
        assert soak.oversized_prompt(rng, 20_000)[0] == "tokens"


def _first_kinds(seed: int, workers: int) -> set[str]:
    """The kinds the workers draw first (as ``_worker`` does, before any plan)."""
    return {random.Random(f"{seed}/{i}").choices(list(DEFAULT_MIX), list(DEFAULT_MIX.values()))[0]
            for i in range(workers)}


def test_live_seed_draws_every_expected_kind_first():
    """The live test relies on it: whatever the machine's speed, each worker
    sends its first draw, and these cover a good, a bad and a hung-up request."""
    kinds = _first_kinds(LIVE_SEED, LIVE_CONCURRENCY)
    assert {"bad", "disconnect"} <= kinds and kinds & {"stream", "plain", "burst", "slow"}


def test_table_lists_everything():
    attempts = [soak.Attempt("probe", "probe", "complete", 200, itl=[0.01, 0.02, 0.03]),
                soak.Attempt("bad", "bad/x", "4xx", 400),
                soak.Attempt("plain", "plain/chat", "5xx", 500, "boom")]
    checks = [soak.Check("health", "PASS", "/health 200"),
              soak.Check("fds", "not checked", "no server pid"),
              soak.check_outcomes(Counter(a.outcome for a in attempts))]
    result = soak.summarize(attempts, 2.0, soak.Baseline(None, None, 0.0), [], None, checks)
    assert result["total"] == 3 and result["failures"] == 1 and not result["passed"]
    assert result["probe_itl_ms"]["p50"] == pytest.approx(20.0)
    assert result["rss_mib"]["growth"] is None  # no pid: nothing sampled
    grown = soak.summarize(attempts, 2.0, soak.Baseline(20, 100.0, 0.0),
                           [(0.0, 100.0), (1.0, 180.25), (2.0, 150.0)], 21, checks)
    assert grown["rss_mib"]["peak"] == 180.25 and grown["rss_mib"]["end"] == 150.0
    assert grown["rss_mib"]["growth"] == pytest.approx(80.25)
    assert soak.check_rss(soak.Baseline(20, 100.0, 0.0), 180.25, 80.0).status == "FAIL"
    assert soak.check_rss(soak.Baseline(20, 100.0, 0.0), 180.0, 80.0).status == "PASS"
    table = soak.format_table(result)
    for word in (*OUTCOMES, "requests/s", "probe ITL", "RSS baseline / peak", "RSS growth",
                 "fds before", "check health", "not checked", "FAIL"):
        assert word in table
    json.dumps(result)


# --------------------------------------------------------------------------- live


@pytest.mark.model
@pytest.mark.slow
def test_soak_live_kvserve(default_model_path, tmp_path):
    out, log = tmp_path / "soak.json", tmp_path / "server.log"
    cmd = [sys.executable, str(TOOL), "--model", str(default_model_path),
           "--serve-args", "--max-model-len 512 --kv-cache-memory 64MiB",
           "--duration", "15", "--concurrency", str(LIVE_CONCURRENCY),
           "--seed", str(LIVE_SEED), "--max-tokens", str(LIVE_MAX_TOKENS),
           "--burst-size", str(LIVE_BURST), "--server-log", str(log), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    log_tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{log_tail}"
    result = json.loads(out.read_text())
    outcomes = result["outcomes"]
    assert result["failures"] == 0 and result["passed"], result["failure_examples"]
    assert all(outcomes[k] == 0 for k in FAILURES)
    for kind in ("complete", "4xx", "disconnect"):
        assert outcomes[kind] >= 1, outcomes
    assert sum(outcomes.values()) == result["total"]
    assert {c["name"]: c["status"] for c in result["checks"]} == {
        "warm-up": "PASS", "load": "PASS", "health": "PASS", "idle gauges": "PASS", "fds": "PASS",
        "rss growth": "PASS", "no failures": "PASS"}
    assert result["by_kind"]["bad"].keys() <= {"4xx", "429/503"}
    assert result["probe_itl_ms"]["n"] > 0 and result["server"]["max_model_len"] == 512
    assert "kvserve soak" in proc.stdout and "result" in proc.stdout
