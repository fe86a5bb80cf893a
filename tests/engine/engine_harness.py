"""Harness for in-process engine tests: real model, real actors, no HTTP.

An ``AsyncEngine`` is bound to the event loop it was started on, so the
engines live on one private event loop per test session (``EngineLoop``),
started lazily -- one engine per configuration -- and shut down at the end.
Tests are plain sync functions that drive that loop with ``run``; between
tests the loop is idle (no step can be in flight, so block accounting can be
inspected safely).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from deadlines import HANG_DEADLINE_S, hang_message
from memory import collect_garbage

from kvserve.actors.messages import (GenerateRequest, RequestAccepted, RequestFailed,
                                     RequestOutput)
from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.core.outputs import SchedulerOutput
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine import AsyncEngine

BLOCK = 16
#: SmolLM2-135M: 2 x 30 layers x 3 KV heads x 64 x 4 bytes (float32).
KV_BYTES_PER_TOKEN = 46080
BLOCK_BYTES = BLOCK * KV_BYTES_PER_TOKEN  # 737,280
#: Enough for every test here (182 blocks, 2,912 tokens) without 1 GiB per engine.
DEFAULT_KV_MEMORY = 128 * 1024**2
#: A hang deadline of ``EngineHandle.run`` (see ``deadlines``), not a speed bound.
STEP_TIMEOUT_S = HANG_DEADLINE_S

# Texts to tokenize into prompts. Each test uses its own text (or a distinct
# tag) so that prefix-cache hits never come from another test's requests.
TEXTS = {
    "long_prefix": (
        "You are a meticulous assistant for a public library. The library lends books, "
        "magazines, films and music, runs a children's reading club every Saturday morning, "
        "and hosts a chess evening on the first Tuesday of each month. Opening hours are "
        "nine to six on weekdays and ten to four on Saturdays; it is closed on Sundays and "
        "public holidays. Members may borrow up to twelve items at a time for three weeks, "
        "and may renew each item twice unless another member has reserved it. Late returns "
        "cost twenty cents per item per day, capped at five euros per item. Lost items are "
        "charged at their replacement cost plus a handling fee of three euros. The reading "
        "room on the second floor is a quiet area; group study rooms can be booked online up "
        "to a week in advance for at most two hours per day. Printing costs ten cents per "
        "page in black and white and fifty cents per page in colour. Wireless internet is "
        "free for everyone, members or not. When you answer, be brief, be polite, and never "
        "invent rules that are not listed here. If a question is not covered by these rules, "
        "say so and suggest asking the staff at the front desk on the ground floor. "),
    "repeat": "Explain in one sentence why the sky looks blue on a clear summer afternoon.",
    "chunked": (
        "The history of the bicycle begins in the early nineteenth century with the "
        "running machine, a wooden frame with two wheels that riders pushed along with their "
        "feet. Pedals attached to the front wheel came decades later, and the high wheeler "
        "followed, fast but dangerous. The safety bicycle, with two wheels of equal size and "
        "a chain driving the rear wheel, changed everything in the eighteen eighties. Air "
        "filled tyres made the ride far more comfortable, and within a few years millions of "
        "people were cycling to work, to the countryside and to races. Women in particular "
        "found new freedom of movement, and clothing fashions changed to suit the machine. "
        "In the twentieth century, gears, lighter alloys and better brakes arrived, while "
        "cities alternately built and removed cycle lanes as cars came and went. Today the "
        "bicycle is again seen as an answer to congestion, pollution and inactivity, and "
        "electric assistance has opened cycling to people who would never have tried it. "
        "Historians still argue about who deserves credit for each invention, because many "
        "workshops in several countries were experimenting at the same time. "),
    "samples": "Write a short, cheerful greeting for a friend who just moved to a new city.",
}


@dataclass
class SampleResult:
    """One sample (``index``) of a finished request."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: list[int] = field(default_factory=list)  # one per RequestOutput
    num_output_tokens: int = 0
    error: str | None = None


@dataclass
class Result:
    """Everything a request's stream delivered."""

    request_id: str
    accepted: RequestAccepted | None = None
    failed: RequestFailed | None = None
    samples: dict[int, SampleResult] = field(default_factory=dict)
    first_output_at: float | None = None

    @property
    def only(self) -> SampleResult:
        assert self.failed is None, self.failed
        assert set(self.samples) == {0}, self.samples
        return self.samples[0]


class EngineHandle:
    """An engine started on the session's private event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, engine: AsyncEngine) -> None:
        self.loop = loop
        self.engine = engine
        self._ids = itertools.count()
        self._references: dict[tuple, list[int]] = {}

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def scheduler(self):
        """The core (synchronous) scheduler."""
        return self.engine.core.scheduler

    @property
    def kv(self):
        return self.engine.core.scheduler.kv_cache_manager

    def run(self, coro, timeout: float = STEP_TIMEOUT_S):
        """Run ``coro`` on the engine's loop; an ``AssertionError`` that says
        the load average when it is still running after ``timeout`` seconds."""
        try:
            return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))
        except TimeoutError:
            raise AssertionError(hang_message("the engine did not finish", timeout)) from None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def new_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def agenerate(self, prompt_ids: Sequence[int], params: SamplingParams,
                        request_id: str | None = None) -> Result:
        request_id = request_id or self.new_id()
        stream = self.engine.generate(GenerateRequest(
            request_id, params, time.monotonic(), prompt_token_ids=tuple(prompt_ids)))
        result = Result(request_id)
        async for event in stream:
            if isinstance(event, RequestAccepted):
                result.accepted = event
            elif isinstance(event, RequestFailed):
                result.failed = event
            elif isinstance(event, RequestOutput):
                if result.first_output_at is None:
                    result.first_output_at = time.monotonic()
                sample = result.samples.setdefault(event.index, SampleResult())
                sample.token_ids.extend(event.token_ids)
                sample.text += event.text
                sample.num_cached_tokens.append(event.num_cached_tokens)
                sample.num_output_tokens = event.num_output_tokens
                if event.finish_reason is not None:
                    sample.finish_reason = event.finish_reason
                    sample.error = event.error
        return result

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 request_id: str | None = None) -> Result:
        return self.run(self.agenerate(prompt_ids, params, request_id))

    def reference_tokens(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The tokens of one request run alone, computed once per prompt and
        parameters for the session (references that several modules compare
        against; deterministic for greedy and seeded requests only)."""
        key = (tuple(prompt_ids), params)
        if key not in self._references:
            self._references[key] = self.generate(prompt_ids, params).only.token_ids
        return self._references[key]

    def generate_all(self, prompts: Sequence[Sequence[int]], params: SamplingParams
                     ) -> list[Result]:
        """Submit all prompts at once; results in prompt order."""
        async def go():
            return await asyncio.gather(*(self.agenerate(p, params) for p in prompts))
        return self.run(go())

    @contextmanager
    def record_steps(self) -> Iterator[list[SchedulerOutput]]:
        """Record every ``SchedulerOutput`` the engine's scheduler builds."""
        sched = self.scheduler
        steps: list[SchedulerOutput] = []
        original = sched.schedule

        def recording_schedule(*args, **kwargs):
            output = original(*args, **kwargs)
            steps.append(output)
            return output

        sched.schedule = recording_schedule
        try:
            yield steps
        finally:
            del sched.schedule

    def wait_idle(self, timeout: float = STEP_TIMEOUT_S) -> None:
        """Let the actors finish (no request live, no step in flight)."""
        async def idle():
            while self.scheduler.has_unfinished_requests() or self.engine.scheduler._in_flight:
                await asyncio.sleep(0.01)
            for _ in range(5):  # let queued deltas reach their streams
                await asyncio.sleep(0)
        self.run(idle(), timeout)

    def assert_all_blocks_free(self) -> None:
        """Acceptance item: every KV block is free once the requests finished."""
        self.wait_idle()
        kv = self.kv
        assert not self.scheduler.has_unfinished_requests()
        assert kv.usage == 0, f"{kv.num_blocks - kv.num_free_blocks} blocks still held: " \
                              f"{ {k: len(v) for k, v in kv.req_to_blocks.items()} }"
        assert kv.num_free_blocks == kv.num_blocks
        assert not kv.req_to_blocks
        kv.check_consistency()


class EngineLoop:
    """A private event loop and the engines started on it, one per config.

    Engines of ``get(..., shared=True)`` live until the loop closes (when
    the run leaves the folder: ``folder_scope``); the others a test module
    asked for are stopped when it ends (``release``): each holds its own
    weights and KV cache, and engines kept for the whole session took the
    suite's process past 14 GiB (issue 33)."""

    #: Every loop alive (the module fixture releases their engines).
    live: list[EngineLoop] = []

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self.loop = asyncio.new_event_loop()
        self.engines: dict[tuple, EngineHandle] = {}
        self.shared: set[tuple] = set()
        EngineLoop.live.append(self)

    def config(self, cache: CacheConfig | None = None,
               scheduler: SchedulerConfig | None = None) -> EngineConfig:
        return EngineConfig(model=self.model_path,
                            cache=cache or CacheConfig(kv_cache_memory=DEFAULT_KV_MEMORY),
                            scheduler=scheduler or SchedulerConfig())

    def start(self, config: EngineConfig) -> EngineHandle:
        """A new engine (the caller shuts it down with ``stop``), started
        once the engines stopped before it are freed (``collect_garbage``)."""
        collect_garbage()
        engine = self.loop.run_until_complete(AsyncEngine.start(config))
        return EngineHandle(self.loop, engine)

    def stop(self, handle: EngineHandle) -> None:
        self.loop.run_until_complete(handle.engine.shutdown())

    def get(self, cache: CacheConfig | None = None,
            scheduler: SchedulerConfig | None = None, shared: bool = False) -> EngineHandle:
        """The engine for this configuration (started on first use), kept
        until the test module ends, or until the loop closes when ``shared``."""
        config = self.config(cache, scheduler)
        key = (config.cache, config.scheduler)
        if key not in self.engines:
            self.engines[key] = self.start(config)
        if shared:
            self.shared.add(key)
        return self.engines[key]

    def release(self) -> None:
        """Stop every engine but the shared ones."""
        for key in [k for k in self.engines if k not in self.shared]:
            self.stop(self.engines.pop(key))

    def close(self) -> None:
        for handle in self.engines.values():
            self.stop(handle)
        self.engines.clear()
        self.loop.close()
        if self in EngineLoop.live:
            EngineLoop.live.remove(self)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def full_block_tokens(num_tokens: int) -> int:
    """Tokens of full blocks reused when a prompt of ``num_tokens`` was cached
    whole (the last prompt token is always recomputed)."""
    return ((num_tokens - 1) // BLOCK) * BLOCK
