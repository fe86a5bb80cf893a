"""tools/soak.py (``kvserve.testing.soak``): the pure parts (outcome classes,
loopback check, percentile, gauges, stream checks, the seeded mix), the
hostile kinds (constraints sized as kvserve counts them, floods, smuggling
against fake loopback servers), the accounting of every request, then one
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

from kvserve.testing import soak, soak_attacks
from kvserve.testing.soak import (
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
LIVE_SEED, LIVE_CONCURRENCY, LIVE_MAX_TOKENS, LIVE_BURST = 2832, 8, 16, 4


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
                        "unexpected_2xx", "bad_body", "smuggled"}
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
                expect = {"bad": "4xx", "oversized": "400", "flood": "400", "smuggle": "400",
                          "constraint": "ok" if "/large/" in p.label else "400"}
                assert p.expect == expect.get(kind, "ok")
                assert (p.wire is not None) == (kind == "smuggle")
                if p.expect == "ok":
                    assert 1 <= p.body["max_tokens"] <= 16
                    assert p.max_tokens == p.body["max_tokens"] * p.body.get("n", 1)
                assert (p.hangup_after in (1, 2)) == (kind == "disconnect")
                assert (p.pause_s > 0) == (kind == "slow")
    for kind in ("oversized", "flood"):  # unknown limit: a normal stream
        assert make_plans(kind, rng, Target("m", None))[0].expect == "ok"


def test_hostile_kinds_are_a_small_share():
    hostile = ("constraint", "smuggle", "flood")
    assert all(0 < DEFAULT_MIX[k] <= 0.05 for k in hostile)
    assert sum(DEFAULT_MIX[k] for k in hostile) / sum(DEFAULT_MIX.values()) < 0.1


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
    assert {"bad", "disconnect", "constraint", "smuggle", "flood", "samples"} <= kinds
    assert kinds & {"stream", "plain", "burst", "slow"}


def test_table_lists_everything():
    attempts = [soak.Attempt("probe", "probe", "complete", 200, itl=[0.01, 0.02, 0.03]),
                soak.Attempt("bad", "bad/x", "4xx", 400),
                soak.Attempt("plain", "plain/chat", "5xx", 500, "boom")]
    checks = [soak.Check("health", "PASS", "/health 200"),
              soak.Check("fds", "not checked", "no server pid"),
              soak.check_outcomes(Counter(a.outcome for a in attempts))]
    result = soak.summarize(attempts, 2.0, soak.Baseline(None, None, 0.0), [], None, checks, 3)
    assert result["total"] == 3 and result["failures"] == 1 and not result["passed"]
    assert result["accounted"] == {"requests": 3, "outcomes": 3}
    assert result["probe_itl_ms"]["p50"] == pytest.approx(20.0)
    assert result["rss_mib"]["growth"] is None  # no pid: nothing sampled
    grown = soak.summarize(attempts, 2.0, soak.Baseline(20, 100.0, 0.0),
                           [(0.0, 100.0), (1.0, 180.25), (2.0, 150.0)], 21, checks, 3)
    assert grown["rss_mib"]["peak"] == 180.25 and grown["rss_mib"]["end"] == 150.0
    assert grown["rss_mib"]["growth"] == pytest.approx(80.25)
    assert soak.check_rss(soak.Baseline(20, 100.0, 0.0), 180.25, 80.0).status == "FAIL"
    assert soak.check_rss(soak.Baseline(20, 100.0, 0.0), 180.0, 80.0).status == "PASS"
    table = soak.format_table(result)
    for word in (*OUTCOMES, "requests/s", "probe ITL", "RSS baseline / peak", "RSS growth",
                 "fds before", "check health", "not checked", "FAIL",
                 "requests granted / outcomes"):
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
        "rss growth": "PASS", "no failures": "PASS", "accounted": "PASS"}
    assert result["accounted"]["requests"] == result["accounted"]["outcomes"] == result["total"]
    assert result["by_kind"]["bad"].keys() <= {"4xx", "429/503"}
    for kind in ("smuggle", "flood"):
        assert result["by_kind"][kind].keys() <= {"4xx", "429/503"}, result["by_kind"]
    assert result["by_kind"]["samples"].keys() <= {"complete", "429/503"}, result["by_kind"]
    assert result["probe_itl_ms"]["n"] > 0 and result["server"]["max_model_len"] == 512
    assert "kvserve soak" in proc.stdout and "result" in proc.stdout



# --------------------------------------------------------------------------- constraints


VARIANTS = ("oversized", "large", "invalid")


def _server_params(name: str, value):
    """The constraint kvserve makes of ``value`` in field ``name`` (its
    request model; for ``tools``, the grammar of ``tool_choice: "required"``)."""
    from kvserve.api.protocol import ChatCompletionRequest
    from kvserve.api.tool_calls import tool_grammar

    body = {"messages": [{"role": "user", "content": "x"}], **soak.constraint_fields(name, value)}
    if name == "tools":
        return tool_grammar(body["tools"], None, False)
    return ChatCompletionRequest.model_validate(body).structured_outputs_params()


@pytest.mark.parametrize("variant, name", [(v, n) for v in VARIANTS for n in soak.CONSTRAINT_FIELDS
                                           if (v, n) != ("large", "tools")])
def test_constraint_requests(variant, name):
    plan = soak.constraint_request(variant, name, random.Random(3), Target("m", 512))
    assert (plan.kind, plan.label, plan.path) == ("constraint", f"constraint/{variant}/{name}",
                                                  "/v1/chat/completions")
    assert plan.expect == ("ok" if variant == "large" else "400")
    body = plan.body
    assert 4 <= body["max_tokens"] == plan.max_tokens <= 8 and body["temperature"] == 0.0
    assert body.get("tool_choice") == ("required" if name == "tools" else None)
    if name == "response_format":
        assert body[name]["type"] == "json_schema" and body[name]["json_schema"]["name"] == "x"
    if variant == "invalid":
        return
    value = body["tools"][0]["function"]["parameters"] if name == "tools" \
        else body[name]["json_schema"]["schema"] if name == "response_format" else body[name]
    size = _server_params(name, value).size_bytes
    if variant == "large":  # under the limit: 40-56 KB
        assert 40_000 <= size < 57_000 < soak.CONSTRAINT_MAX_BYTES
    else:  # over it: 70-100 KB
        assert soak.CONSTRAINT_MAX_BYTES < 70_000 <= size < 101_000


def test_constraint_plans_draw_every_variant(monkeypatch):
    """Every (variant, field) but a large ``tools`` one: a tool's schema is
    also written into the prompt, too long for a small context."""
    monkeypatch.setattr(soak_attacks, "constraint_request", lambda variant, name, rng, target:
                        (variant, name))
    rng, target = random.Random(2), Target("m", 512)
    drawn = {soak.constraint_plan(rng, target) for _ in range(300)}
    assert drawn == {(v, n) for v in VARIANTS for n in soak.CONSTRAINT_FIELDS
                     if (v, n) != ("large", "tools")}


@pytest.mark.parametrize("name", soak.CONSTRAINT_FIELDS)
def test_constraint_sizes_as_kvserve_counts(name):
    rng = random.Random(4)
    for size in (1_000, 40_000, 70_000):
        value = soak.sized_constraint(name, size, rng)
        got = soak.constraint_bytes(name, value)
        assert size <= got < size + 64  # at least size, at most one item more
        extra = _server_params(name, value).size_bytes - got  # a tool grammar embeds the schema
        assert (0 < extra < 500) if name == "tools" else extra == 0
    # salted: the server's compile cache never has one
    assert soak.sized_constraint(name, 40_000, rng) != soak.sized_constraint(name, 40_000, rng)


@pytest.mark.parametrize("name", soak.CONSTRAINT_FIELDS)
def test_constraints_compile_as_expected(name):
    """By kvserve's own compiler (grammar only, no matcher): a large one
    compiles, an invalid one does not (``GrammarError`` is a ``ValueError``)."""
    from kvserve.constraints.grammar import to_grammar

    assert to_grammar(_server_params(name, soak.sized_constraint(name, 40_000,
                                                                  random.Random(5))))
    with pytest.raises(ValueError):
        to_grammar(_server_params(name, soak.INVALID_CONSTRAINTS[name]))


# --------------------------------------------------------------------------- floods


def test_flood_plans():
    rng, target, seen = random.Random(6), Target("m", 512), set()
    for _ in range(40):
        plan = soak.flood_plan(rng, target)
        seen.add(plan.label)
        count = len(plan.body["messages"])
        assert plan.kind == "flood" and plan.expect == "400" and plan.path == "/v1/chat/completions"
        assert plan.stream == plan.body["stream"] and plan.body["model"] == "m"
        assert (count == 20_000) if plan.label == "flood/large" else 512 < count <= 1512
        assert plan.body["messages"][-1]["role"] == "user"
        assert len(json.dumps(plan.body).encode()) <= soak.FLOOD_MAX_BYTES < 2**20
    assert seen == {"flood/large", "flood/over_context"}


def test_flood_too_big_for_a_body_sends_a_normal_request():
    rng, target = random.Random(7), Target("m", 40_000)  # 40,001+ messages: over 1 MB
    assert soak.flood_plan(rng, target) is None
    assert make_plans("flood", rng, target)[0].expect == "ok"


# --------------------------------------------------------------------------- smuggling


@pytest.mark.parametrize("order", ["cl_first", "te_first"])
@pytest.mark.parametrize("encoding", sorted(soak.SMUGGLE_ENCODINGS))
@pytest.mark.parametrize("desync", ["cl.te", "te.cl"])
def test_smuggle_request(desync, encoding, order):
    raw = soak.smuggle_request(desync, order, encoding)
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("ascii").split("\r\n")
    assert lines[0] == "POST /v1/completions HTTP/1.1"
    names = [line.split(":")[0].lower() for line in lines[1:]]
    assert {"content-length", "transfer-encoding"} <= set(names)
    assert (names.index("content-length") < names.index("transfer-encoding")) == \
        (order == "cl_first")
    te_name, te_value = soak.SMUGGLE_ENCODINGS[encoding]
    assert f"{te_name}: {te_value}" in lines
    length = int(next(line for line in lines if line.startswith("Content-Length")).split()[1])
    if desync == "cl.te":  # the chunks end at once; the length covers the hidden request
        assert length == len(body) and body == b"0\r\n\r\n" + soak.SMUGGLED
    else:  # the length ends at the chunk size; the chunk holds the hidden request
        assert body[length:].startswith(soak.SMUGGLED) and body.endswith(b"\r\n0\r\n\r\n")
        assert int(body[:length], 16) == len(soak.SMUGGLED)


def test_smuggle_plans():
    rng = random.Random(8)
    plans = [make_plans("smuggle", rng, Target("m", 512))[0] for _ in range(60)]
    assert all(p.kind == "smuggle" and p.expect == "400" and p.wire for p in plans)
    assert len({p.label for p in plans}) == 12  # 2 desyncs x 3 encodings x 2 orders


RESPONSE_400 = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                b"content-length: 27\r\nconnection: close\r\n\r\n"
                b'{"error": {"message": "x"}}')
RESPONSE_200 = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"


@pytest.mark.parametrize("data, outcome, status", [
    (RESPONSE_400, "4xx", 400),
    (RESPONSE_400 + RESPONSE_200, "smuggled", 400),
    (RESPONSE_400 + RESPONSE_400, "smuggled", 400),
    (b"", "transport_error", None),
    (RESPONSE_200, "unexpected_2xx", 200),
    (RESPONSE_400.replace(b"400 Bad Request", b"413 Content Too Large"), "unexpected_4xx", 413),
    (RESPONSE_400.replace(b"400 Bad Request", b"503 Service Unavailable"), "429/503", 503),
    (b"garbage\r\n\r\n", "bad_body", None),
    (RESPONSE_400[:-27] + b'HTTP/1.1 200 OK\r\n\r\n{"a": 1}', "4xx", 400),  # in the body: one
    (RESPONSE_400.replace(b"content-length: 27\r\n", b"") + RESPONSE_200, "smuggled", 400),
])
def test_wire_outcome(data, outcome, status):
    got, got_status, detail = soak.wire_outcome("400", data)
    assert (got, got_status) == (outcome, status) and outcome in OUTCOMES
    if data == RESPONSE_400:
        assert detail == '{"error": {"message": "x"}}'


def _send_to_fake_server(answer: bytes | None, close: bool = True,
                         timeout_s: float = 10.0) -> soak.Attempt:
    """``send`` a smuggling attempt to a loopback server that reads the
    request, writes ``answer`` (None: nothing) and closes (or not)."""
    import httpx

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if answer:
            writer.write(answer)
            await writer.drain()
        if close:
            writer.close()
        else:
            await asyncio.sleep(timeout_s * 2)

    async def go() -> soak.Attempt:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        plan = make_plans("smuggle", random.Random(9), Target("m", 512))[0]
        async with server, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            return await soak.send(client, plan, timeout_s)

    return asyncio.run(go())


def test_smuggle_against_fake_servers():
    ok = _send_to_fake_server(RESPONSE_400)
    assert (ok.kind, ok.outcome, ok.status) == ("smuggle", "4xx", 400)
    assert _send_to_fake_server(RESPONSE_400 + RESPONSE_200).outcome == "smuggled"
    assert _send_to_fake_server(None).outcome == "transport_error"
    assert _send_to_fake_server(RESPONSE_400, close=False, timeout_s=0.3).outcome == "timeout"


def test_finish_reasons():
    plain = make_plans("plain", random.Random(1), Target("m", 512))[0]
    tools = soak.constraint_request("invalid", "tools", random.Random(1), Target("m", 512))
    for reason in ("stop", "length"):
        assert soak.finish_problem(reason, plain) is None is soak.finish_problem(reason, tools)
    assert soak.finish_problem("tool_calls", tools) is None
    assert soak.finish_problem("tool_calls", plain) and soak.finish_problem(None, tools)


# --------------------------------------------------------------------------- accounting


def test_check_accounted():
    attempts = [soak.Attempt("plain", "plain/chat", "complete", 200),
                soak.Attempt("smuggle", "smuggle/x", "smuggled", 400)]
    assert soak.check_accounted(2, attempts).status == "PASS"
    assert soak.check_accounted(3, attempts).status == "FAIL"  # one request lost
    assert "2 outcomes for 3 requests" in soak.check_accounted(3, attempts).detail
    stray = [*attempts[:1], soak.Attempt("plain", "plain/chat", "mystery", 200)]
    assert soak.check_accounted(2, stray).status == "FAIL"  # not in the table
    budget = Budget(deadline=float("inf"), max_requests=5)
    budget.take(3), budget.take(3), budget.take(1)
    assert budget.granted == 5


def test_run_load_accounts_for_every_request():
    """Against a closed port (every kind refused at connect): the load stops,
    and every request granted has its one outcome."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mix = dict.fromkeys(DEFAULT_MIX, 1.0)
    load = asyncio.run(soak.run_load(
        f"http://127.0.0.1:{port}", Target("m", 512, max_tokens=8, burst_size=3),
        concurrency=6, mix=mix, seed=1, duration_s=30.0, max_requests=200, timeout_s=10.0,
        headers={}))
    assert load.stopped and "cannot connect" in load.stopped
    assert 0 < load.granted == len(load.attempts)
    assert {a.outcome for a in load.attempts} == {"transport_error"}
    assert soak.check_accounted(load.granted, load.attempts).status == "PASS"
