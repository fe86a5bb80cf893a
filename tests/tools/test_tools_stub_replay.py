"""The replay client measures time correctly against a server that is not kvserve:
a stub streaming fixed chunks with known delays (TTFT 0.3 s, then one per 0.1 s)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from tools_support import STUB_CHUNKS, STUB_EVENTS, STUB_ITL, STUB_TTFT

from kvserve.bench.replay import main as replay_main
from kvserve.bench.replay import run_replay, summarize_all
from kvserve.bench.trace import TraceRequest, write_trace

#: Timing tolerance (s) of medians and means: the machine has 2 shared cores.
TOL = 0.05
#: Upper slack (s) of a single measurement (a late wake-up under heavy load).
SLACK = 0.3


def _requests(n: int, spacing: float = 0.05) -> list[TraceRequest]:
    return [TraceRequest(id=f"s{i}", arrival_s=i * spacing, cls="short_qa",
                         prompt=f"hello {i}", output_tokens=STUB_CHUNKS) for i in range(n)]


def _events_from(mark: int) -> list[tuple[str, str]]:
    """The stub's events since ``STUB_EVENTS[mark]``, in order, without times."""
    return [(event, text) for event, text, _ in STUB_EVENTS[mark:]]


def test_stub_ttft_itl_match_known_delays(stub_server):
    mark = len(STUB_EVENTS)
    results, duration = asyncio.run(run_replay(_requests(4), stub_server, progress=False))
    assert len(results) == 4
    expected_e2e = STUB_TTFT + (STUB_CHUNKS - 1) * STUB_ITL
    for r in results:
        assert r.success, r.error
        assert r.status == 200
        # a client cannot see a chunk before the stub sends it; a late wake-up on a
        # loaded machine only adds, so: a tight lower bound, a looser upper bound
        assert STUB_TTFT - 0.01 <= r.ttft <= STUB_TTFT + SLACK
        assert r.content_events == STUB_CHUNKS  # the empty role chunk is not a token
        assert len(r.itl) == STUB_CHUNKS - 1
        assert sum(r.itl) / len(r.itl) == pytest.approx(STUB_ITL, abs=TOL)
        assert expected_e2e - 0.01 <= r.e2el <= expected_e2e + SLACK
        assert r.output_tokens == STUB_CHUNKS and r.output_tokens_source == "usage"
        assert r.prompt_tokens == 7
        assert r.tpot == pytest.approx(STUB_ITL, abs=TOL)
    # the typical request matches the stub's delays within +-TOL
    assert np.median([r.ttft for r in results]) == pytest.approx(STUB_TTFT, abs=TOL)
    assert np.median([g for r in results for g in r.itl]) == pytest.approx(STUB_ITL, abs=TOL)
    # open loop: the 4 requests overlapped, by the stub's order of events (no
    # duration bound, issue 33): a second one arrived before the first was done
    events = _events_from(mark)
    assert events.index(("done", events[0][1])) > 1, events
    summary = summarize_all(results, duration)["overall"]
    assert summary["ttft_ms"]["median"] == pytest.approx(STUB_TTFT * 1000, abs=TOL * 1000)
    assert summary["itl_ms"]["n"] == 4 * (STUB_CHUNKS - 1)
    assert summary["itl_ms"]["median"] == pytest.approx(STUB_ITL * 1000, abs=TOL * 1000)


def test_stub_closed_loop_serializes(stub_server):
    """--max-concurrency 1 with all arrivals at 0: one request after the other,
    by the stub's order of events (each received after the one before was
    done) and by lower bounds, which a busy machine only makes longer."""
    reqs = [TraceRequest(id=f"c{i}", arrival_s=0.0, prompt="x", output_tokens=2)
            for i in range(3)]
    mark = len(STUB_EVENTS)
    results, duration = asyncio.run(run_replay(reqs, stub_server, max_concurrency=1,
                                               progress=False))
    assert all(r.success for r in results)
    assert [event for event, _ in _events_from(mark)] == ["received", "done"] * 3
    one = STUB_TTFT + STUB_ITL
    assert duration >= 3 * one - TOL
    sent = sorted(r.sent_s for r in results)
    assert sent[1] - sent[0] >= one - 0.01


def test_stub_errors_and_goodput_via_cli(stub_server, tmp_path):
    """Status codes and errors are counted; goodput applies every SLO; the
    result JSON carries provenance (a stub without /version: its status)."""
    reqs = _requests(3)
    reqs.append(TraceRequest(id="bad", arrival_s=0.1, cls="rag", prompt="FAIL please",
                             output_tokens=4))
    reqs.append(TraceRequest(id="nostream", arrival_s=0.1, cls="rag", prompt="plain",
                             output_tokens=1, stream=False))
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, reqs, {"arrival": "test"})
    out = tmp_path / "result.json"
    rc = replay_main(["--trace", str(trace), "--base-url", stub_server, "--out", str(out),
                      "--goodput", "ttft:600000", "tpot:50", "--no-progress", "--quiet"])
    assert rc == 1  # one request failed
    result = json.loads(out.read_text())
    overall = result["summary"]["overall"]
    assert overall["num_requests"] == 5 and overall["completed"] == 4 and overall["failed"] == 1
    assert overall["status_codes"] == {"200": 4, "429": 1}
    bad = next(r for r in result["requests"] if r["id"] == "bad")
    assert bad["status"] == 429 and "stub overload" in bad["error"]
    # TPOT ~100 ms > 50 ms SLO: only the non-streamed one-token request is good
    # (the TTFT SLO, 10 minutes, is met by all: a busy machine cannot fail it)
    assert overall["goodput"]["good_requests"] == 1
    assert set(result["summary"]["by_class"]) == {"short_qa", "rag"}
    prov = result["provenance"]
    assert prov["server"]["version"] == {"status": 404}
    assert prov["server"]["models"]["data"][0]["id"] == "stub-model"
    assert result["config"]["model"] == "stub-model"
    assert len(prov["trace"]["sha256"]) == 64
    assert prov["machine"]["cpu_count"] >= 1
    assert "commit" in prov["git"] and prov["tool"]["version"]
