"""Per-request timelines and per-step statistics, as plain dataclasses.

No asyncio, no logging, no Prometheus: the engine's observer
(``kvserve.observability.stats_logger``) feeds these from the scheduler actor and turns
them into log lines and metrics. All times are ``time.monotonic()`` seconds
except ``arrival_wall`` (Unix epoch seconds, for replay).

Phase definitions follow vLLM's metrics documentation ("Metrics" design doc,
``vllm/v1/metrics/stats.py``)::

    arrival ──queue──> first scheduled ──prefill──> first token ──decode──> finished
    |<───────────── TTFT ────────────────────────>|
    |<──────────────────────────── E2E ───────────────────────────────────────>|
                       |<────────────── inference = prefill + decode ─────────>|

- arrival: ``GenerateRequest.arrival_time``, set by the API when the HTTP
  request was parsed.
- first scheduled: the scheduler actor's ``schedule()`` call that admitted
  the request for the first time (a resume after preemption does not count).
- first token / each later token: when the scheduler actor emits the
  ``TokenDelta`` carrying it (the moment the token leaves the engine core;
  detokenization and SSE add a little more before the client sees it).
- finished: the ``TokenDelta`` with the finish reason (or, for a stop string
  that the detokenizer matched, when that stop reaches the scheduler).

Because queue, prefill and decode are differences of the same four time
stamps, ``queue + prefill + decode == e2e`` exactly (up to float rounding).
TPOT excludes the first token: ``(e2e - ttft) / (output_tokens - 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestTimeline:
    """The life of one sequence (one sample of a request) in the engine."""

    request_id: str
    arrival_time: float
    arrival_wall: float
    prompt_tokens: int
    parent_id: str | None = None
    priority: int = 0
    request_class: str | None = None
    n: int = 1
    stream: bool | None = None  # whether the client asked for a stream (None: not said)
    queued_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0
    num_token_events: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None

    # -------------------------------------------------------------- events

    def scheduled(self, now: float) -> bool:
        """Record the first scheduling; False if it was already scheduled."""
        if self.first_scheduled_time is not None:
            return False
        self.first_scheduled_time = now
        return True

    def tokens(self, now: float, num_new: int) -> float | None:
        """Record ``num_new`` tokens leaving the engine at ``now``.

        Returns the inter-token latency of this event (seconds since the
        previous token event), or None for the first token event.
        """
        itl = None if self.last_token_time is None else now - self.last_token_time
        if self.first_token_time is None:
            self.first_token_time = now
            if self.first_scheduled_time is None:  # defensive: never seen scheduled
                self.first_scheduled_time = now
        self.last_token_time = now
        self.num_output_tokens += num_new
        self.num_token_events += 1
        return itl

    def finish(self, now: float, reason: str, num_output_tokens: int | None = None,
               num_cached_tokens: int | None = None, num_preemptions: int | None = None) -> None:
        """Record the finish; counts given here (the scheduler's) win."""
        self.finished_time = now
        self.finish_reason = reason
        if num_output_tokens is not None:
            self.num_output_tokens = num_output_tokens
        if num_cached_tokens is not None:
            self.num_cached_tokens = max(num_cached_tokens, 0)
        if num_preemptions is not None:
            self.num_preemptions = num_preemptions

    # -------------------------------------------------------------- phases

    @property
    def queue_time(self) -> float | None:
        """Arrival to first scheduling (seconds)."""
        return _diff(self.first_scheduled_time, self.arrival_time)

    @property
    def prefill_time(self) -> float | None:
        """First scheduling to first token (seconds)."""
        return _diff(self.first_token_time, self.first_scheduled_time)

    @property
    def decode_time(self) -> float | None:
        """First token to finish (seconds)."""
        return _diff(self.finished_time, self.first_token_time)

    @property
    def inference_time(self) -> float | None:
        """Prefill + decode: first scheduling to finish (seconds)."""
        return _diff(self.finished_time, self.first_scheduled_time)

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to first token (seconds)."""
        return _diff(self.first_token_time, self.arrival_time)

    @property
    def e2e(self) -> float | None:
        """End-to-end latency: arrival to finish (seconds)."""
        return _diff(self.finished_time, self.arrival_time)

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: decode / (output - 1)."""
        decode = self.decode_time
        if decode is None or self.num_output_tokens < 2:
            return None
        return decode / (self.num_output_tokens - 1)

    def log_fields(self) -> dict[str, Any]:
        """The fields of the ``request_finished`` log event."""
        return {
            "request_id": self.request_id, "parent_id": self.parent_id,
            "arrival_time": round(self.arrival_wall, 6),
            "finish_reason": self.finish_reason, "priority": self.priority,
            "request_class": self.request_class, "n": self.n, "stream": self.stream,
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.num_cached_tokens,
            "output_tokens": self.num_output_tokens, "preemptions": self.num_preemptions,
            "queue_s": _r(self.queue_time), "prefill_s": _r(self.prefill_time),
            "decode_s": _r(self.decode_time), "inference_s": _r(self.inference_time),
            "ttft_s": _r(self.ttft), "e2e_s": _r(self.e2e), "tpot_s": _r(self.tpot),
        }


def _diff(end: float | None, start: float | None) -> float | None:
    return None if end is None or start is None else max(end - start, 0.0)


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


#: The phases of one engine step, in the order they happen.
STEP_PHASES = ("schedule", "prepare", "forward", "sample", "draft", "emit")


@dataclass(frozen=True)
class StepTimes:
    """Wall-clock seconds of the phases of one step.

    - ``schedule``: the core scheduler's ``schedule()`` (scheduler actor).
    - ``prepare``: the runner's request-state update and batch building.
    - ``forward``: the model's forward pass.
    - ``sample``: sampling and logprobs.
    - ``draft``: the draft model's passes (``draft_model`` speculation).
    - ``emit``: applying the sampled tokens (``update_from_output``) and
      sending the token deltas to the detokenizer (scheduler actor).

    ``stages``: with pipeline parallelism, each stage's forward seconds in
    its own process (``forward`` is the engine's wait for all of them, so
    ``forward - sum(stages)`` is the transfer and queueing time).
    """

    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    draft: float = 0.0
    emit: float = 0.0
    stages: tuple[float, ...] = ()

    def as_dict(self) -> dict[str, float]:
        """Phase name -> seconds, in ``STEP_PHASES`` order."""
        return {phase: getattr(self, phase) for phase in STEP_PHASES}


@dataclass(frozen=True)
class StepStats:
    """One model step as the scheduler actor saw it.

    ``start``/``end`` bracket the worker's forward pass (monotonic seconds);
    token counts are in tokens; ``kv_cache_usage`` is the fraction (0..1) of
    KV blocks in use after scheduling; ``num_running``/``num_waiting`` are
    the queue lengths after scheduling.
    """

    step_id: int
    start: float
    end: float
    batch_size: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preemptions: int
    kv_cache_usage: float
    num_running: int
    num_waiting: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    times: StepTimes = field(default_factory=StepTimes)

    @property
    def seconds(self) -> float:
        """Duration of the forward pass."""
        return max(self.end - self.start, 0.0)

    @property
    def num_tokens(self) -> int:
        """Tokens computed in the step (prefill + decode)."""
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclass
class IntervalStats:
    """What happened since the last periodic ``engine_stats`` line."""

    start: float
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_steps: int = 0
    busy_seconds: float = 0.0
    finished_requests: int = 0
    kv_usage_sum: float = 0.0
    kv_usage_max: float = 0.0
    max_waiting: int = 0
    phase_seconds: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(STEP_PHASES, 0.0))

    def add_step(self, step: StepStats) -> None:
        """Account one finished step (prompt tokens = prefill tokens computed)."""
        self.prompt_tokens += step.num_prefill_tokens
        self.num_steps += 1
        self.busy_seconds += step.seconds
        for phase, seconds in step.times.as_dict().items():
            self.phase_seconds[phase] += seconds
        self.kv_usage_sum += step.kv_cache_usage
        self.kv_usage_max = max(self.kv_usage_max, step.kv_cache_usage)
        self.max_waiting = max(self.max_waiting, step.num_waiting)

    def add_scheduling(self, preemptions: int, queries: int, hits: int) -> None:
        """Account one ``schedule()``'s preemptions and prefix-cache look-ups."""
        self.preemptions += preemptions
        self.prefix_cache_queries += queries
        self.prefix_cache_hits += hits

    @property
    def is_idle(self) -> bool:
        """True when nothing was computed and nothing finished."""
        return not self.num_steps and not self.finished_requests

    def snapshot(self, now: float, num_running: int, num_waiting: int,
                 kv_cache_usage: float, total_preemptions: int) -> EngineStatsSnapshot:
        """The figures of one periodic stats line."""
        elapsed = max(now - self.start, 1e-9)
        hit_rate = (self.prefix_cache_hits / self.prefix_cache_queries
                    if self.prefix_cache_queries else 0.0)
        return EngineStatsSnapshot(
            interval_s=elapsed,
            prompt_throughput=self.prompt_tokens / elapsed,
            generation_throughput=self.generation_tokens / elapsed,
            num_running=num_running, num_waiting=num_waiting,
            max_waiting=max(self.max_waiting, num_waiting),
            preemptions=self.preemptions, total_preemptions=total_preemptions,
            kv_cache_usage=kv_cache_usage,
            kv_cache_usage_mean=(self.kv_usage_sum / self.num_steps if self.num_steps
                                 else kv_cache_usage),
            kv_cache_usage_max=max(self.kv_usage_max, kv_cache_usage),
            prefix_cache_hit_rate=hit_rate,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_steps=self.num_steps, busy_fraction=min(self.busy_seconds / elapsed, 1.0),
            finished_requests=self.finished_requests,
            step_ms={phase: 1000 * seconds / max(self.num_steps, 1)
                     for phase, seconds in self.phase_seconds.items()})


@dataclass(frozen=True)
class EngineStatsSnapshot:
    """One periodic stats line (vLLM's "Avg prompt throughput: ..." line).

    Throughputs in tokens/s over the interval; ``kv_cache_usage`` now (0..1)
    with its step mean and max over the interval; ``busy_fraction`` is the
    share of the interval the worker spent computing steps; ``step_ms`` the
    mean milliseconds per step of each phase (``STEP_PHASES``).
    """

    interval_s: float
    prompt_throughput: float
    generation_throughput: float
    num_running: int
    num_waiting: int
    max_waiting: int
    preemptions: int
    total_preemptions: int
    kv_cache_usage: float
    kv_cache_usage_mean: float
    kv_cache_usage_max: float
    prefix_cache_hit_rate: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_steps: int
    busy_fraction: float
    finished_requests: int
    step_ms: dict[str, float] = field(default_factory=dict)

    def message(self) -> str:
        """The human-readable line."""
        return (f"Avg prompt throughput: {self.prompt_throughput:.1f} tokens/s, "
                f"Avg generation throughput: {self.generation_throughput:.1f} tokens/s, "
                f"Running: {self.num_running} reqs, Waiting: {self.num_waiting} reqs, "
                f"Preemptions: {self.preemptions}, "
                f"KV cache usage: {self.kv_cache_usage * 100:.1f}%, "
                f"Prefix cache hit rate: {self.prefix_cache_hit_rate * 100:.1f}%, "
                f"Busy: {self.busy_fraction * 100:.0f}%, Step: {self._step_text()}")

    def _step_text(self) -> str:
        """``"total 123.4 ms (schedule 1.0, prepare 0.5, ...)"``, or ``"-"``."""
        if not self.num_steps or not self.step_ms:
            return "-"
        parts = ", ".join(f"{phase} {ms:.1f}" for phase, ms in self.step_ms.items()
                          if ms or phase != "draft")  # draft: only with a draft model
        return f"{sum(self.step_ms.values()):.1f} ms ({parts})"

    def log_fields(self) -> dict[str, Any]:
        """The fields of the ``engine_stats`` log event."""
        return {
            "interval_s": round(self.interval_s, 3),
            "prompt_throughput": round(self.prompt_throughput, 2),
            "generation_throughput": round(self.generation_throughput, 2),
            "num_running": self.num_running, "num_waiting": self.num_waiting,
            "max_waiting": self.max_waiting, "preemptions": self.preemptions,
            "total_preemptions": self.total_preemptions,
            "kv_cache_usage": round(self.kv_cache_usage, 4),
            "kv_cache_usage_mean": round(self.kv_cache_usage_mean, 4),
            "kv_cache_usage_max": round(self.kv_cache_usage_max, 4),
            "prefix_cache_hit_rate": round(self.prefix_cache_hit_rate, 4),
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "num_steps": self.num_steps, "busy_fraction": round(self.busy_fraction, 3),
            "finished_requests": self.finished_requests,
            "step_ms": {phase: round(ms, 3) for phase, ms in self.step_ms.items()},
        }


@dataclass
class RequestTracker:
    """The live timelines, keyed by sequence id (pure bookkeeping)."""

    timelines: dict[str, RequestTimeline] = field(default_factory=dict)

    def add(self, timeline: RequestTimeline) -> None:
        self.timelines[timeline.request_id] = timeline

    def get(self, request_id: str) -> RequestTimeline | None:
        return self.timelines.get(request_id)

    def pop(self, request_id: str) -> RequestTimeline | None:
        return self.timelines.pop(request_id, None)

    def __len__(self) -> int:
        return len(self.timelines)
