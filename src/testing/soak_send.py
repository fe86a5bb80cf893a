"""Sending one soak request and classifying its answer: the outcome classes
(``classify``), the checks of a body or an event stream, the raw-socket
exchange of a smuggling attempt (``wire_outcome``) and ``send``, which turns
every exception into an outcome.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvserve.testing.soak_plans import Plan

#: Every outcome class, in table order.
OUTCOMES = ("complete", "4xx", "429/503", "disconnect", "5xx", "transport_error", "timeout",
            "unexpected_4xx", "unexpected_2xx", "bad_body", "smuggled")
#: The outcomes that fail the soak.
FAILURES = frozenset({"5xx", "transport_error", "timeout", "unexpected_4xx", "unexpected_2xx",
                      "bad_body", "smuggled"})


def classify(expect: str, status: int | None, *, error: str | None = None,
             body_ok: bool = True, hung_up: bool = False) -> str:
    """The outcome class of one request (see ``kvserve.testing.soak``).

    Args:
        expect: ``"ok"`` (well-formed), ``"4xx"`` (any 4xx is right) or
            ``"400"`` (exactly 400 is right, e.g. an oversized prompt).
        status: the HTTP status, None when no response came.
        error: ``"timeout"`` or ``"transport_error"`` when the request raised.
        body_ok: whether a 200's body (or the stream read so far) was well-formed.
        hung_up: whether we closed the stream on purpose before its end.
    """
    if error is not None or status is None:
        return error or "transport_error"
    if status in (429, 503):
        return "429/503"
    if status >= 500:
        return "5xx"
    if 400 <= status < 500:
        right = expect == "4xx" or (expect == "400" and status == 400)
        return "4xx" if right else "unexpected_4xx"
    if expect != "ok":
        return "unexpected_2xx" if 200 <= status < 300 else "bad_body"
    if status != 200 or not body_ok:
        return "bad_body"
    return "disconnect" if hung_up else "complete"


@dataclass
class Attempt:
    """The result of one request (times in seconds)."""

    kind: str
    label: str
    outcome: str
    status: int | None = None
    detail: str | None = None
    seconds: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between content events


@dataclass
class StreamRead:
    """What reading an SSE stream found."""

    events: int = 0
    done: bool = False
    finish_reason: str | None = None
    usage: dict | None = None
    problem: str | None = None
    hung_up: bool = False
    itl: list[float] = field(default_factory=list)


async def sse_payloads(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The ``data:`` payloads of an event stream, one per event."""
    data: list[str] = []
    async for line in lines:
        if line == "":
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[6:] if line[5:6] == " " else line[5:])
    if data:
        yield "\n".join(data)


def _content(choice: dict) -> str:
    delta = choice.get("delta") or choice.get("message") or {}
    text = delta.get("content") if isinstance(delta, dict) else None
    return text if isinstance(text, str) else (choice.get("text") or "")


def usage_problem(usage: dict | None, plan: Plan) -> str | None:
    """Why ``usage`` contradicts ``plan`` (completion tokens above max_tokens,
    or not equal to it with EOS ignored), or None."""
    if not isinstance(usage, dict) or not isinstance(usage.get("completion_tokens"), int):
        return "no usage with completion_tokens"
    got, limit = usage["completion_tokens"], plan.max_tokens
    if limit is not None and (got > limit or (plan.ignore_eos and got != limit)):
        return f"completion_tokens {got} with max_tokens {limit} (ignore_eos {plan.ignore_eos})"
    return None


def finish_problem(reason: Any, plan: Plan) -> str | None:
    """Why ``reason`` cannot end ``plan``'s answer (``stop`` or ``length``;
    ``tool_calls`` too when it offers tools), or None."""
    tools = isinstance(plan.body, dict) and bool(plan.body.get("tools"))
    return None if reason in ("stop", "length") or (tools and reason == "tool_calls") \
        else f"finish_reason {reason!r}"


def body_problem(raw: bytes, plan: Plan) -> str | None:
    """Why a non-streamed 200 body is malformed, or None."""
    try:
        data = json.loads(raw)
    except ValueError:
        return f"body is not JSON: {raw[:80]!r}"
    choices = data.get("choices") if isinstance(data, dict) else None
    if not choices or not isinstance(choices[0], dict):
        return "no choices"
    return finish_problem(choices[0].get("finish_reason"), plan) \
        or usage_problem(data.get("usage"), plan)


def apply_event(st: StreamRead, payload: str, plan: Plan) -> bool:
    """Account for one SSE payload in ``st`` (sets ``st.problem`` when it is
    malformed); True when it carried content (a token)."""
    st.events += 1
    if st.done:
        st.problem = "an event after [DONE]"
        return False
    if payload.strip() == "[DONE]":
        st.done = True
        return False
    try:
        chunk = json.loads(payload)
    except ValueError:
        st.problem = f"event is not JSON: {payload[:80]!r}"
        return False
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not isinstance(choices, list) or "error" in chunk \
            or not all(isinstance(c, dict) for c in choices):
        st.problem = f"error or malformed event: {payload[:160]}"
        return False
    st.usage = chunk.get("usage") or st.usage
    content = False
    for choice in choices:
        st.finish_reason = choice.get("finish_reason") or st.finish_reason
        content = content or bool(_content(choice))
    return content


def stream_end_problem(st: StreamRead, plan: Plan) -> str | None:
    """Why a stream read to its end is not a full answer, or None."""
    if not st.done:
        return f"stream ended without [DONE] after {st.events} events"
    return finish_problem(st.finish_reason, plan) or usage_problem(st.usage, plan)


async def read_stream(resp: httpx.Response, plan: Plan) -> StreamRead:
    """Read (or hang up on) a 200 event stream, checking every event; ITL
    gaps (seconds) between content events are recorded."""
    st = StreamRead()
    last: float | None = None
    async for payload in sse_payloads(resp.aiter_lines()):
        if apply_event(st, payload, plan):
            now = time.perf_counter()
            if last is not None:
                st.itl.append(now - last)
            last = now
        if st.problem:
            return st
        if plan.hangup_after and st.events >= plan.hangup_after and not st.done:
            st.hung_up = True
            return st
        if plan.pause_s and not st.done:
            await asyncio.sleep(plan.pause_s)
    st.problem = stream_end_problem(st, plan)
    return st


def _error_text(raw: bytes) -> str:
    return raw[:200].decode("utf-8", "replace")


#: A response's status line, and a ``Content-Length`` header line within its head.
STATUS_LINE = re.compile(rb"HTTP/\d(?:\.\d)? (\d{3})[^\r\n]*\r\n")
CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
#: The most bytes read back on a raw connection (``Plan.wire``): 1 MiB.
WIRE_MAX_BYTES = 1024 * 1024


def http_statuses(data: bytes) -> list[int]:
    """The statuses of the HTTP responses in ``data``, one after another:
    each body is skipped by its ``Content-Length``; after a head without
    one, the next status line anywhere starts another response."""
    statuses, pos = [], 0
    while (line := STATUS_LINE.search(data, pos)) is not None:
        statuses.append(int(line[1]))
        end = data.find(b"\r\n\r\n", line.start())
        if end < 0:
            break
        length = CONTENT_LENGTH.search(data, line.end() - 2, end + 2)
        pos = end + 4 + (int(length[1]) if length else 0)
    return statuses


def wire_outcome(expect: str, data: bytes) -> tuple[str, int | None, str | None]:
    """(outcome, status, detail) of all that came back on a raw connection
    before its close: one response, classified by its status (``classify``);
    ``smuggled`` for more than one (a request hidden in the body ran);
    ``transport_error`` for nothing; ``bad_body`` for bytes that are not
    an HTTP response."""
    statuses = http_statuses(data)
    if not data:
        return "transport_error", None, "connection closed with no response"
    if not data.startswith(b"HTTP/") or not statuses:
        return "bad_body", None, f"not an HTTP response: {data[:80]!r}"
    if len(statuses) > 1:
        return "smuggled", statuses[0], f"{len(statuses)} responses, statuses {statuses}"
    return classify(expect, statuses[0]), statuses[0], _error_text(data.partition(b"\r\n\r\n")[2])


async def _exchange_wire(client: httpx.AsyncClient, plan: Plan) -> Attempt:
    """Send ``plan.wire`` on a new TCP connection to ``client``'s server, read
    until the server closes it (``WIRE_MAX_BYTES`` at most) and classify
    what came (``wire_outcome``). A reset after some bytes ends the read;
    one before any raises (``ConnectionResetError``)."""
    url, data = client.base_url, b""
    tls = url.scheme == "https"
    reader, writer = await asyncio.open_connection(url.host, url.port or (443 if tls else 80),
                                                   ssl=tls or None)
    try:
        writer.write(plan.wire or b"")
        await writer.drain()
        while len(data) < WIRE_MAX_BYTES and (chunk := await reader.read(65536)):
            data += chunk
    except ConnectionResetError:
        if not data:
            raise
    finally:
        writer.close()
    outcome, status, detail = wire_outcome(plan.expect, data)
    return Attempt(plan.kind, plan.label, outcome, status, detail)


async def _exchange(client: httpx.AsyncClient, plan: Plan) -> Attempt:
    """Send ``plan`` and classify the answer (exceptions propagate)."""
    if plan.wire is not None:
        return await _exchange_wire(client, plan)
    if plan.raw is not None:
        kwargs: dict[str, Any] = {"content": plan.raw,
                                  "headers": {"content-type": "application/json"}}
    else:
        kwargs = {"json": plan.body}
    async with client.stream("POST", plan.path, **kwargs) as resp:
        status = resp.status_code
        if status != 200 or not plan.stream:
            raw = await resp.aread()
            problem = body_problem(raw, plan) if status == 200 else None
            outcome = classify(plan.expect, status, body_ok=problem is None)
            detail = problem if status == 200 else _error_text(raw)
            return Attempt(plan.kind, plan.label, outcome, status, detail)
        st = await read_stream(resp, plan)
        outcome = classify(plan.expect, status, body_ok=st.problem is None, hung_up=st.hung_up)
        return Attempt(plan.kind, plan.label, outcome, status, st.problem, itl=st.itl)


async def send(client: httpx.AsyncClient, plan: Plan, timeout_s: float) -> Attempt:
    """Send one request with a total deadline of ``timeout_s`` seconds; any
    exception becomes a ``timeout`` or ``transport_error`` outcome."""
    start = time.perf_counter()
    try:
        attempt = await asyncio.wait_for(_exchange(client, plan), timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException) as exc:
        attempt = Attempt(plan.kind, plan.label, "timeout", detail=type(exc).__name__)
    except (httpx.HTTPError, OSError) as exc:
        attempt = Attempt(plan.kind, plan.label, "transport_error",
                          detail=f"{type(exc).__name__}: {exc}"[:200])
    except Exception as exc:  # noqa: BLE001 - an answer malformed in a way the checks missed
        attempt = Attempt(plan.kind, plan.label, "bad_body",
                          detail=f"{type(exc).__name__}: {exc}"[:200])
    attempt.seconds = time.perf_counter() - start
    return attempt
