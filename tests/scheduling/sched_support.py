"""Helpers of the scheduling-policy tests (issue 4).

Reuses the existing harnesses -- ``tests/engine/engine_harness.py`` (engines on
a private event loop) and ``tests/e2e/e2e_support.py`` (``EngineThread``,
``LiveServer``, SSE parsing, KV snapshots) -- and adds only what they lack:

* ``submit``/``Tracked``: an in-process request *with a priority*, recording
  when its first output and its end arrived (completion order is the order of
  those end events);
* ``sse_stream``: an async streaming HTTP call that records the same times;
* ``AppServer``: the real Starlette app served by uvicorn on the loop of an
  ``EngineThread``, so a test can make real TCP requests (and really drop the
  connection) while reading the engine's scheduler and KV cache directly.

``tests/scheduling/conftest.py`` puts ``tests/engine`` and ``tests/e2e`` on
``sys.path`` before this module is imported.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from deadlines import HANG_DEADLINE_S, hang_message
from e2e_support import EngineThread, free_port, iter_sse_data  # noqa: F401 - re-exported

from kvserve.actors.messages import GenerateRequest, RequestAccepted, RequestFailed, RequestOutput
from kvserve.core.sampling_params import SamplingParams

MODEL_NAME = "SmolLM2-135M-Instruct"
#: A long-enough prompt for every request here (tokenized once per engine).
PROMPT = "Tell me a long story about a dragon who learns to cook."


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    """Greedy sampling that never stops early (``ignore_eos``): the request
    runs exactly ``max_tokens`` decode steps, so durations are predictable."""
    kwargs.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


# --------------------------------------------------------------------------- in-process


@dataclass
class Tracked:
    """What one in-process request's stream delivered, with monotonic times."""

    request_id: str
    priority: int
    submitted_at: float
    accepted: bool = False
    failed: RequestFailed | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    first_output_at: float | None = None
    done_at: float | None = None


async def _follow(stream, tracked: Tracked) -> Tracked:
    async for event in stream:
        if isinstance(event, RequestAccepted):
            tracked.accepted = True
        elif isinstance(event, RequestFailed):
            tracked.failed = event
        elif isinstance(event, RequestOutput):
            if tracked.first_output_at is None and event.token_ids:
                tracked.first_output_at = time.monotonic()
            tracked.token_ids.extend(event.token_ids)
            if event.finish_reason is not None:
                tracked.finish_reason = event.finish_reason
    tracked.done_at = time.monotonic()
    return tracked


def submit(engine, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
           priority: int = 0) -> tuple[Tracked, asyncio.Task]:
    """Submit now (must run on the engine's loop); the record and the task
    that follows the stream to its end."""
    tracked = Tracked(request_id, priority, time.monotonic())
    stream = engine.generate(GenerateRequest(request_id, params, tracked.submitted_at,
                                             prompt_token_ids=tuple(prompt_ids),
                                             priority=priority))
    return tracked, asyncio.ensure_future(_follow(stream, tracked))


async def wait_until(predicate, what: str, timeout: float = HANG_DEADLINE_S,
                     poll: float = 0.005) -> None:
    """Poll ``predicate()`` on the running loop; ``AssertionError`` (saying
    the load average) after ``timeout`` seconds, a hang deadline."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(hang_message(f"not reached: {what}", timeout))
        await asyncio.sleep(poll)


def completion_order(records: Sequence[Tracked]) -> list[str]:
    """Request ids in the order their streams ended."""
    assert all(r.done_at is not None for r in records), records
    return [r.request_id for r in sorted(records, key=lambda r: r.done_at)]


# --------------------------------------------------------------------------- HTTP


@dataclass
class HTTPRecord:
    """One streaming HTTP call: status, parsed events and monotonic times."""

    name: str
    status: int | None = None
    headers: httpx.Headers | None = None
    body: Any = None  # JSON body when the answer was not an event stream
    chunks: list[dict] = field(default_factory=list)
    done: bool = False
    sent_at: float = 0.0
    first_content_at: float | None = None
    done_at: float | None = None
    num_content_chunks: int = 0

    @property
    def text(self) -> str:
        return "".join((c["choices"][0].get("delta") or {}).get("content") or ""
                       for c in self.chunks if c.get("choices"))

    @property
    def errors(self) -> list[dict]:
        return [c["error"] for c in self.chunks if "error" in c]

    @property
    def finish_reason(self) -> str | None:
        reasons = [c["choices"][0].get("finish_reason") for c in self.chunks if c.get("choices")]
        reasons = [r for r in reasons if r]
        return reasons[-1] if reasons else None

    @property
    def usage(self) -> dict | None:
        usages = [c["usage"] for c in self.chunks if c.get("usage")]
        return usages[-1] if usages else None


def chat_body(content: str, max_tokens: int, **extra: Any) -> dict:
    """A greedy streaming chat body that runs exactly ``max_tokens`` tokens
    (``stream=False`` in ``extra``: a plain one, without ``stream_options``,
    which OpenAI and kvserve refuse on a non-streaming request)."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    if not body["stream"]:
        body.pop("stream_options")
    return body


async def _aiter_sse(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The ``data:`` payloads of an event stream (async ``iter_sse_data``)."""
    event: list[str] = []
    async for line in lines:
        if line == "":
            for payload in iter_sse_data(iter([*event, ""])):
                yield payload
            event = []
        else:
            event.append(line)
    for payload in iter_sse_data(iter(event)):
        yield payload


async def sse_stream(client: httpx.AsyncClient, body: dict, headers: dict | None = None,
                     name: str = "", accepted: asyncio.Event | None = None,
                     first_content: asyncio.Event | None = None,
                     path: str = "/v1/chat/completions",
                     record: HTTPRecord | None = None) -> HTTPRecord:
    """POST a streaming request and read it to the end.

    ``accepted`` is set once the response status is known (the server
    answered: admitted, or refused); ``first_content`` once the first chunk
    with generated text (or the end) arrived. Pass ``record`` to watch it fill.
    """
    record = record or HTTPRecord(name)
    record.sent_at = time.monotonic()
    try:
        async with client.stream("POST", path, json=body, headers=headers or {}) as response:
            record.status = response.status_code
            record.headers = response.headers
            if accepted is not None:
                accepted.set()
            if not response.headers.get("content-type", "").startswith("text/event-stream"):
                await response.aread()
                record.body = response.json()
                return record
            async for payload in _aiter_sse(response.aiter_lines()):
                if payload == "[DONE]":
                    record.done = True
                    continue
                chunk = json.loads(payload)
                record.chunks.append(chunk)
                choices = chunk.get("choices") or []
                content = choices and ((choices[0].get("delta") or {}).get("content")
                                       or choices[0].get("text"))
                if content:
                    record.num_content_chunks += 1
                    if record.first_content_at is None:
                        record.first_content_at = time.monotonic()
                        if first_content is not None:
                            first_content.set()
    finally:
        record.done_at = time.monotonic()
        if accepted is not None:
            accepted.set()
        if first_content is not None:
            first_content.set()
    return record


def assert_error_body(body: Any, status: int) -> dict:
    """An OpenAI error object (``{"error": {message, type, param, code}}``)."""
    assert isinstance(body, dict) and set(body) == {"error"}, (status, body)
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    return error


# --------------------------------------------------------------------------- app server


class AppServer:
    """The Starlette API app served by uvicorn on an ``EngineThread``'s loop.

    Requests travel over real TCP, so a client closing its socket is a real
    ``http.disconnect`` for the app, while the test can read the engine's
    scheduler and KV cache with ``engine_thread.run(...)``.
    """

    def __init__(self, engine_thread: EngineThread,
                 start_timeout: float = HANG_DEADLINE_S) -> None:
        from kvserve.api.app import build_app
        from kvserve.config import ServerConfig

        self.engine_thread = engine_thread
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        app = build_app(engine_thread.engine, ServerConfig(port=self.port))
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None,
                                access_log=False, lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self._future = asyncio.run_coroutine_threadsafe(self.server.serve(),
                                                        engine_thread.loop)
        deadline = time.monotonic() + start_timeout
        while not self.server.started:
            if self._future.done():
                self._future.result()  # raises what stopped it
                raise RuntimeError("uvicorn stopped before it started")
            if time.monotonic() > deadline:
                raise RuntimeError(hang_message("uvicorn did not start", start_timeout))
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self._future.result(timeout=30)
