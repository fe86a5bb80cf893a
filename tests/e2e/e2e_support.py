"""Helpers of the end-to-end tests: golden cases, an engine on its own event
loop, a live ``kvserve serve`` subprocess, SSE parsing and the greedy
tolerance rule of ``shared/golden/README.md``.

Imported by ``tests/e2e/conftest.py`` and the test modules (pytest puts this
folder on ``sys.path``, as for ``tests/api/fake_engine.py``).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from deadlines import HANG_DEADLINE_S, hang_message
from golden import golden_params
from kvserve.bench.server import ServerProcess, free_port
from kvserve.actors.messages import (
    GenerateRequest,
    RequestAccepted,
    RequestFailed,
    RequestOutput,
)
from kvserve.core.sampling_params import SamplingParams

T = TypeVar("T")

#: ``--max-model-len`` of the live server (so a too-long prompt is cheap to send).
SERVER_MAX_MODEL_LEN = 512
#: Absolute tolerance on logits (shared/golden/README.md).
LOGIT_TOL = 1e-3
EOS_ID = 2

#: One pytest.param per golden case (a loud skip when the folder is absent).
GOLDEN = golden_params()


# --------------------------------------------------------------------------- greedy rule


def first_divergence(expected: Sequence[int] | Sequence[str], got: Sequence[int] | Sequence[str],
                     top2: Sequence[Sequence[float]], what: str,
                     tol: float = LOGIT_TOL) -> int | None:
    """Compare greedy outputs under the golden README's tolerance rule.

    ``top2[i]`` are *our* two largest logits at output position ``i``. The
    outputs must be equal; a divergence is accepted only at a position where
    our top two logits differ by less than ``tol`` (a float near-tie), and
    comparison stops there. Returns that position, or None when the outputs
    are equal (same length included). Raises ``AssertionError`` otherwise.
    """
    for i, (want, have) in enumerate(zip(expected, got)):
        if want == have:
            continue
        assert i < len(top2) and len(top2[i]) >= 2, (
            f"{what}: output differs at position {i} ({have!r} != expected {want!r}) "
            f"and no top-2 logits are available there")
        gap = top2[i][0] - top2[i][1]
        assert gap < tol, (
            f"{what}: output differs at position {i}: got {have!r}, expected {want!r}, but our "
            f"top-2 logits there differ by {gap:.3g} >= {tol} (not a near-tie).\n"
            f"expected: {list(expected)}\ngot:      {list(got)}")
        return i
    assert len(got) == len(expected), (
        f"{what}: {len(got)} output tokens, expected {len(expected)}.\n"
        f"expected: {list(expected)}\ngot:      {list(got)}")
    return None


def assert_top5_close(ours: dict[Any, float], golden_keys: Sequence[Any],
                      golden_logits: Sequence[float], what: str, tol: float = LOGIT_TOL) -> None:
    """Our first-step top-5 (key -> logit) equals the golden one within ``tol``."""
    want = dict(zip(golden_keys, golden_logits))
    assert set(ours) == set(want), f"{what}: top-5 {ours} != golden {want}"
    for key, value in want.items():
        assert abs(ours[key] - value) <= tol, (
            f"{what}: logit of {key!r} is {ours[key]:.5f}, golden {value:.5f} "
            f"(|diff| {abs(ours[key] - value):.2e} > {tol})\nours: {ours}\ngolden: {want}")


# --------------------------------------------------------------------------- in-process engine


@dataclass
class Generation:
    """Everything one in-process request produced."""

    request_id: str
    prompt_token_ids: tuple[int, ...] | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    failed: RequestFailed | None = None
    num_outputs: int = 0

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def top2(self) -> list[list[float]]:
        """Our two largest values at each output position (from the logprob entries)."""
        return [[value for _, value in top[:2]] for _, top in self.logprobs]


def make_request(request_id: str | None = None, *, prompt: str | None = None,
                 messages: Sequence[dict] | None = None,
                 prompt_token_ids: Sequence[int] | None = None, **params: Any) -> GenerateRequest:
    """A ``GenerateRequest`` with greedy defaults (``temperature=0``)."""
    params.setdefault("temperature", 0.0)
    return GenerateRequest(
        request_id=request_id or f"e2e-{uuid.uuid4().hex[:12]}",
        sampling_params=SamplingParams(**params), arrival_time=time.monotonic(),
        prompt=prompt, messages=None if messages is None else tuple(messages),
        prompt_token_ids=None if prompt_token_ids is None else tuple(prompt_token_ids))


async def collect(engine, request: GenerateRequest) -> Generation:
    """Submit ``request`` and read its whole stream (n == 1)."""
    result = Generation(request.request_id)
    async for event in engine.generate(request):
        if isinstance(event, RequestAccepted):
            result.prompt_token_ids = tuple(event.prompt_token_ids)
        elif isinstance(event, RequestFailed):
            result.failed = event
        elif isinstance(event, RequestOutput):
            result.num_outputs += 1
            result.token_ids.extend(event.token_ids)
            result.logprobs.extend(event.logprobs or ())
            result.texts.append(event.text)
            if event.finish_reason is not None:
                result.finish_reason = event.finish_reason
    return result


class EngineThread:
    """An ``AsyncEngine`` running on an event loop of its own thread.

    Sync tests submit coroutines with ``run``; the engine stays bound to the
    one loop it started on, whatever pytest's plugins do with theirs.
    """

    def __init__(self, config, start_timeout: float = HANG_DEADLINE_S) -> None:
        from kvserve.engine import AsyncEngine

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="e2e-engine-loop",
                                       daemon=True)
        self.thread.start()
        try:
            self.engine = self.run(AsyncEngine.start(config), timeout=start_timeout)
        except BaseException:
            self._stop_loop()
            raise

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = HANG_DEADLINE_S) -> T:
        """Run ``coro`` on the engine's loop; its result (or exception).
        ``timeout`` is a hang deadline (its failure says the load average)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise AssertionError(hang_message("the engine did not answer", timeout)) from None

    def generate(self, request: GenerateRequest, timeout: float = HANG_DEADLINE_S) -> Generation:
        """One request, start to end."""
        return self.run(collect(self.engine, request), timeout)

    def close(self) -> None:
        try:
            self.run(self.engine.shutdown(), timeout=60)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        if not self.thread.is_alive():
            self.loop.close()


@dataclass(frozen=True)
class KVSnapshot:
    usage: float
    num_free_blocks: int
    num_blocks: int
    num_unfinished: bool
    held: dict[str, int]
    counts: tuple[int, int, int]

    @property
    def all_free(self) -> bool:
        return (self.usage == 0.0 and self.num_free_blocks == self.num_blocks
                and not self.num_unfinished and not self.held)


async def kv_snapshot(engine) -> KVSnapshot:
    """The KV cache manager's counters, read on the engine's loop."""
    scheduler = engine.core.scheduler
    kv = scheduler.kv_cache_manager
    return KVSnapshot(kv.usage, kv.num_free_blocks, kv.num_blocks,
                      scheduler.has_unfinished_requests(),
                      {rid: len(blocks) for rid, blocks in kv.req_to_blocks.items() if blocks},
                      kv.pool.count_blocks())


async def wait_all_blocks_free(engine, timeout: float = HANG_DEADLINE_S / 2) -> KVSnapshot:
    """Poll until no request holds a KV block (the last step's bookkeeping
    may still be in flight); the last snapshot, whether or not it got there
    (``timeout``: a hang deadline, inside ``EngineThread.run``'s)."""
    deadline = time.monotonic() + timeout
    while True:
        snap = await kv_snapshot(engine)
        if snap.all_free or time.monotonic() > deadline:
            return snap
        await asyncio.sleep(0.02)


# --------------------------------------------------------------------------- live server


class LiveServer(ServerProcess):
    """``python -m kvserve.cli serve`` in a subprocess (``kvserve.bench.server``),
    with the e2e defaults; its output (JSON logs) goes to ``stderr_path``."""

    def __init__(self, model: Path, log_dir: Path, extra_args: Sequence[str] = (),
                 start_timeout: float = 600.0, env: dict[str, str] | None = None) -> None:
        self.stderr_path = log_dir / "kvserve-server.log"
        super().__init__(["--model", str(model), "--logprobs-mode", "raw_logits",
                          "--kv-cache-memory", "256MiB", *extra_args],
                         log_path=self.stderr_path, start_timeout=start_timeout,
                         health_paths=("/health",), env=env)

    def assert_alive(self) -> None:
        assert self.proc.poll() is None, (
            f"kvserve serve died (exit {self.proc.returncode}):\n{self.log_tail()}")

    def log_events(self, name: str) -> list[dict]:
        """The JSON log events named ``name`` the server (or its replicas) wrote so far."""
        found = []
        decoder = json.JSONDecoder()
        for line in self.stderr_path.read_text().splitlines():
            # several processes write here (Ray forwards the replicas' lines),
            # so a line may hold more than one object
            pos = line.find("{")
            while pos >= 0:
                try:
                    event, end = decoder.raw_decode(line, pos)
                except ValueError:
                    break
                if isinstance(event, dict) and event.get("event") == name:
                    found.append(event)
                pos = line.find("{", end)
        return found

@dataclass
class SSEResult:
    """A parsed SSE response."""

    status: int
    headers: httpx.Headers
    chunks: list[dict] = field(default_factory=list)
    done: bool = False
    raw_lines: list[str] = field(default_factory=list)
    body: Any = None  # JSON body when the answer was not an event stream

    def choice_chunks(self) -> list[dict]:
        return [c for c in self.chunks if c.get("choices")]

    def usage(self) -> dict | None:
        usages = [c["usage"] for c in self.chunks if c.get("usage")]
        return usages[-1] if usages else None


def iter_sse_data(lines: Iterator[str]) -> Iterator[str]:
    """The ``data:`` payloads of an event stream, one per event."""
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            data.append(value)
    if data:
        yield "\n".join(data)


def post_stream(client: httpx.Client, path: str, body: dict) -> SSEResult:
    """POST ``body`` with ``stream: true`` and parse the event stream."""
    body = {**body, "stream": True}
    with client.stream("POST", path, json=body) as response:
        result = SSEResult(response.status_code, response.headers)
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            response.read()
            result.body = response.json()
            return result
        lines = []
        for payload in iter_sse_data(_recorded(response.iter_lines(), lines)):
            assert not result.done, f"event after [DONE]: {payload!r}"
            if payload == "[DONE]":
                result.done = True
                continue
            result.chunks.append(json.loads(payload))
        result.raw_lines = lines
    return result


def _recorded(lines: Iterator[str], sink: list[str]) -> Iterator[str]:
    for line in lines:
        sink.append(line)
        yield line


def assert_openai_error(response: httpx.Response, status: int | tuple[int, ...]) -> dict:
    """The response is a JSON OpenAI error object with a 4xx ``status``."""
    statuses = (status,) if isinstance(status, int) else status
    assert response.status_code in statuses, (response.status_code, response.text)
    assert 400 <= response.status_code < 500
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    return error
