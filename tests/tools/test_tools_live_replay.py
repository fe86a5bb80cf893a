"""Replay against a live kvserve (the default model): every request accounted
for, TTFT <= E2E, ITL gaps == content events - 1, output tokens == the server's
usage (and its own request_finished log); then record-then-replay from that log."""

from __future__ import annotations

import json

import pytest
from e2e_support import LiveServer

from kvserve.bench.trace import TraceRequest, read_trace, write_trace
from kvserve.cli import main as kvserve_main

pytestmark = pytest.mark.model

MAX_TOKENS = [6, 4, 8, 5, 7, 3]
CLASSES = ["short_qa", "rag", "code", "agent", "short_qa", "agent"]


@pytest.fixture(scope="module")
def live(default_model_path, tmp_path_factory):
    server = LiveServer(default_model_path, tmp_path_factory.mktemp("tools-live"),
                        extra_args=["--max-model-len", "512", "--scheduling-policy", "priority"])
    yield server
    server.stop()


def _finished_by_id(server: LiveServer) -> dict[str, dict]:
    out = {}
    for line in server.stderr_path.read_text(encoding="utf-8", errors="replace").splitlines():
        if '"request_finished"' in line:
            rec = json.loads(line[line.index("{"):])
            out[rec["request_id"]] = rec
    return out


@pytest.mark.slow
def test_replay_live_kvserve(live, tmp_path):
    prefix = "You are a terse assistant. " * 6
    requests = [
        TraceRequest(id=f"q{i}", arrival_s=round(0.25 * i, 3), cls=CLASSES[i],
                     prompt=(prefix if CLASSES[i] == "agent" else "") + f"Say a word about {i}.",
                     output_tokens=n, priority=i % 2,
                     prefix_group="agent0" if CLASSES[i] == "agent" else None)
        for i, n in enumerate(MAX_TOKENS)]
    trace = tmp_path / "live.jsonl"
    write_trace(trace, requests, {"arrival": "test"})
    out = tmp_path / "result.json"
    # through `kvserve bench` (the alias of tools/replay.py)
    rc = kvserve_main(["bench", "--trace", str(trace), "--base-url", live.base_url,
                       "--out", str(out), "--goodput", "ttft:60000", "--no-progress", "--quiet"])
    live.assert_alive()
    assert rc == 0
    result = json.loads(out.read_text())
    recs = {r["id"]: r for r in result["requests"]}
    assert sorted(recs) == sorted(r.id for r in requests)  # every request accounted for
    overall = result["summary"]["overall"]
    assert overall["completed"] == len(requests) and overall["failed"] == 0
    assert overall["status_codes"] == {"200": len(requests)}
    logged = _finished_by_id(live)
    for req in requests:
        r = recs[req.id]
        assert r["success"] and r["status"] == 200, r
        assert 0 < r["ttft"] <= r["e2el"]
        assert len(r["itl"]) == r["content_events"] - 1
        assert r["output_tokens_source"] == "usage" and r["prompt_tokens_source"] == "usage"
        # ignore_eos: exactly max_tokens, as the server's usage said and its log counted
        assert r["output_tokens"] == req.output_tokens
        server_rec = logged[r["request_id"]]
        assert server_rec["output_tokens"] == r["output_tokens"]
        assert server_rec["prompt_tokens"] == r["prompt_tokens"]
        assert server_rec["request_class"] == req.cls  # sent as X-Request-Class
    assert overall["total_output_tokens"] == sum(MAX_TOKENS)
    assert overall["itl_ms"]["n"] == sum(r["content_events"] - 1 for r in recs.values())
    assert set(result["summary"]["by_class"]) == set(CLASSES)
    assert overall["goodput"]["good_requests"] == len(requests)
    prov = result["provenance"]
    assert prov["server"]["models"]["data"][0]["id"]
    assert prov["server_url"] == live.base_url

    # record then replay: a trace made from the server's log has the sent offsets
    for r in requests:
        assert isinstance(logged[recs[r.id]["request_id"]]["arrival_time"], float)
    from kvserve.bench.make_trace import main as make_trace_main

    recorded = tmp_path / "recorded.jsonl"
    log_copy = tmp_path / "server.log"
    ours = {recs[r.id]["request_id"] for r in requests}
    log_copy.write_text("\n".join(json.dumps(rec) for rid, rec in logged.items() if rid in ours))
    assert make_trace_main(["--arrival", "log", "--log", str(log_copy), "-o", str(recorded)]) == 0
    replayed, _ = read_trace(recorded)
    sent = sorted(recs[r.id]["sent_s"] for r in requests)
    offsets = [r.arrival_s for r in replayed]
    assert offsets == pytest.approx([s - sent[0] for s in sent], abs=0.05)
    assert [r.output_tokens for r in replayed] == [recs[f"q{i}"]["output_tokens"]
                                                   for i in range(len(requests))]
