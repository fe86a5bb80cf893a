"""The engine's observer: request lifecycle logs, step logs, periodic stats and metrics.

The stats actor (``kvserve.actors.stats``) calls the ``on_*`` hooks as the
other actors' reports arrive (all on the event loop, so no locking); this class keeps the ``RequestTimeline`` of every live sequence
(``kvserve.core.stats``), writes the structured log events and feeds
``EngineMetrics``. Log events (structlog, one JSON object per line):

- ``request_received`` (the engine's ``generate``; arrival at the API),
  ``request_queued`` (reached the admission actor's waiting queue),
  ``request_scheduled`` (first scheduling), ``request_first_token``,
  ``request_preempted`` (logged by the scheduler actor),
  ``request_finished`` (all phase times, token counts, priority, class);
- ``step`` (debug level): batch size, prefill/decode tokens, KV usage, seconds;
- ``engine_stats`` (info, every ``stats_interval`` seconds while busy).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import structlog

from kvserve.core.outputs import RequestUpdate, SchedulerOutput
from kvserve.core.spec_decode import SpecDecodingStats
from kvserve.core.stats import (IntervalStats, RequestTimeline, RequestTracker, StepStats,
                                StepTimes)
from kvserve.observability.metrics import EngineMetrics


_MAX_PENDING = 100_000


def wall_time_of(monotonic_time: float) -> float:
    """Unix epoch seconds of a ``time.monotonic()`` stamp (for replay)."""
    return time.time() - (time.monotonic() - monotonic_time)


class StatsObserver:
    """Timelines, log events and metrics of one engine."""

    def __init__(self, metrics: EngineMetrics | None = None) -> None:
        self.metrics = metrics
        self.tracker = RequestTracker()
        self.log = structlog.get_logger("kvserve.stats")
        self.interval = IntervalStats(start=time.monotonic())
        self.interval_spec = SpecDecodingStats()
        self.total_preemptions = 0
        self.stalled_seconds = 0.0  # while stalled: the latest stall reading
        self._last_idle = False
        # parent id -> n, from request_received (bounded: refused requests never finish)
        #: parent id -> (n, stream) from ``request_received`` until its last sample is queued
        self._received: OrderedDict[str, tuple[int, bool | None]] = OrderedDict()
        #: parent id -> (samples not finished, most tokens of a finished one), for n > 1
        self._samples_left: dict[str, tuple[int, int]] = {}

    # ------------------------------------------------------------- arrival

    def on_received(self, request_id: str, arrival_time: float, priority: int,
                    request_class: str | None, n: int, prompt: Any = None,
                    log_prompts: bool = False, stream: bool | None = None,
                    max_tokens: int | None = None) -> None:
        """``request_received``: the API handed the request to the engine."""
        self._received[request_id] = (n, stream)
        if self.metrics is not None:
            self.metrics.observe_params(n, max_tokens or self.metrics.max_model_len)
        while len(self._received) > _MAX_PENDING:
            self._received.popitem(last=False)
        fields: dict[str, Any] = {}
        if log_prompts and prompt is not None:
            fields["prompt"] = prompt
        self.log.debug("request_received", request_id=request_id,
                      arrival_time=round(wall_time_of(arrival_time), 6), priority=priority,
                      request_class=request_class, n=n, stream=stream, **fields)

    def on_queued(self, request_id: str, parent_id: str, arrival_time: float,
                  prompt_tokens: int, priority: int, request_class: str | None,
                  now: float | None = None) -> None:
        """``request_queued``: admission added it to the waiting queue (at
        ``now``, monotonic seconds; the present when None)."""
        now = time.monotonic() if now is None else now
        n, stream = self._received.get(parent_id, (1, None))
        if request_id == parent_id or request_id.endswith(f"-{n - 1}"):  # last sample
            self._received.pop(parent_id, None)
        timeline = RequestTimeline(
            request_id=request_id, arrival_time=arrival_time,
            arrival_wall=wall_time_of(arrival_time), prompt_tokens=prompt_tokens,
            parent_id=parent_id, priority=priority, request_class=request_class, n=n,
            stream=stream,
            queued_time=now)
        self.tracker.add(timeline)
        self.log.debug("request_queued", request_id=request_id, prompt_tokens=prompt_tokens,
                      priority=priority, request_class=request_class,
                      since_arrival_s=round(now - arrival_time, 6))

    # ---------------------------------------------------------- scheduling

    def on_schedule(self, output: SchedulerOutput, num_running: int, num_waiting: int,
                    kv_usage: float, now: float | None = None) -> None:
        """A ``schedule()`` returned (at ``now``, monotonic seconds; the
        present when None): first schedulings, preemptions, prefix cache."""
        now = time.monotonic() if now is None else now
        for request_id in output.first_scheduled_request_ids:
            timeline = self.tracker.get(request_id)
            if timeline is None or not timeline.scheduled(now):
                continue
            self.log.debug("request_scheduled", request_id=request_id,
                          queue_s=round(timeline.queue_time or 0.0, 6),
                          prompt_tokens=timeline.prompt_tokens,
                          cached_tokens=_cached(output, request_id),
                          num_running=output.num_running, num_waiting=output.num_waiting,
                          kv_cache_usage=round(output.kv_cache_usage, 4))
        for event in output.preemptions:
            timeline = self.tracker.get(event.request_id)
            if timeline is not None:
                timeline.num_preemptions += 1
        num_preempted = len(output.preemptions)
        self.total_preemptions += num_preempted
        self.interval.add_scheduling(num_preempted, output.prefix_cache_queries,
                                     output.prefix_cache_hits)
        if self.metrics is not None:
            self.metrics.observe_scheduling(num_preempted, output.prefix_cache_queries,
                                            output.prefix_cache_hits, len(output.divergences))
            self.metrics.observe_offload(output.kv_offload_queries, output.kv_offload_hits)
            self.metrics.set_load(num_running, num_waiting, kv_usage)

    def on_spec_decode(self, stats: SpecDecodingStats) -> None:
        """A step's speculative decoding counts: metrics and the interval's
        acceptance (in the ``engine_stats`` line)."""
        if not stats.num_drafts:
            return
        if self.metrics is not None:
            self.metrics.observe_spec_decode(stats)
        spec = self.interval_spec
        spec.num_drafts += stats.num_drafts
        spec.num_draft_tokens += stats.num_draft_tokens
        spec.num_accepted_tokens += stats.num_accepted_tokens

    def on_kv_transfer(self, stats) -> None:
        """A step's KV copies (``kv_connector.TransferStats``): metrics, and a
        ``kv_transfer`` debug event per direction."""
        for direction, (blocks, nbytes, seconds) in stats.by_direction.items():
            if self.metrics is not None:
                self.metrics.observe_kv_transfer(direction, int(blocks), int(nbytes), seconds)
            self.log.debug("kv_transfer", direction=direction, blocks=int(blocks),
                           bytes=int(nbytes), seconds=round(seconds, 6))

    def on_step(self, output: SchedulerOutput, start: float, end: float,
                times: StepTimes | None = None) -> StepStats:
        """A step came back from the worker and its tokens were emitted:
        ``step`` event (debug) and metrics. ``start``/``end``: the worker's
        span (monotonic seconds); ``times``: its phases."""
        times = times or StepTimes()
        step = StepStats(
            step_id=output.step_id, start=start, end=end, batch_size=len(output.scheduled),
            num_prefill_tokens=output.num_prefill_tokens,
            num_decode_tokens=output.num_decode_tokens,
            num_preemptions=len(output.preemptions), kv_cache_usage=output.kv_cache_usage,
            num_running=output.num_running, num_waiting=output.num_waiting,
            prefix_cache_queries=output.prefix_cache_queries,
            prefix_cache_hits=output.prefix_cache_hits, times=times)
        self.interval.add_step(step)
        if self.metrics is not None:
            self.metrics.observe_step(step)
        self.log.debug("step", step_id=step.step_id, batch_size=step.batch_size,
                       prefill_tokens=step.num_prefill_tokens,
                       decode_tokens=step.num_decode_tokens,
                       kv_cache_usage=round(step.kv_cache_usage, 4),
                       num_running=step.num_running, num_waiting=step.num_waiting,
                       preemptions=step.num_preemptions, step_s=round(step.seconds, 6),
                       **{f"{phase}_s": round(sec, 6) for phase, sec in times.as_dict().items()})
        return step

    def set_load(self, num_running: int, num_waiting: int, kv_usage: float) -> None:
        """Refresh the running/waiting/KV gauges (after a step or an abort)."""
        if self.metrics is not None:
            self.metrics.set_load(num_running, num_waiting, kv_usage)

    def set_stall(self, seconds: float, stalled: bool) -> None:
        """The latest stall reading (``kvserve.core.stall``): the gauge, and,
        while ``stalled`` (past ``--stall-timeout``), the stats line's ``stalled_s``."""
        self.stalled_seconds = seconds if stalled else 0.0
        if self.metrics is not None:
            self.metrics.set_stall(seconds)

    # -------------------------------------------------------------- tokens

    def on_update(self, update: RequestUpdate, emitted: bool = True,
                  now: float | None = None) -> None:
        """The scheduler emitted ``update`` (a ``TokenDelta``), or finished it
        without emitting (``emitted=False``: a stop string the detokenizer
        found), at ``now`` (monotonic seconds; the present when None)."""
        now = time.monotonic() if now is None else now
        timeline = self.tracker.get(update.request_id)
        if timeline is None:
            return
        num_new = len(update.new_token_ids) if emitted else 0
        if num_new:
            first = timeline.first_token_time is None
            itl = timeline.tokens(now, num_new)
            self.interval.generation_tokens += num_new
            if self.metrics is not None:
                self.metrics.observe_tokens(num_new, itl)
            if first:
                if self.metrics is not None:
                    self.metrics.observe_first_token(timeline)
                    if _is_first_sample(timeline):  # the prompt counts once per request
                        self.metrics.observe_prompt(timeline.prompt_tokens)
                self.log.debug("request_first_token", request_id=update.request_id,
                              ttft_s=round(timeline.ttft or 0.0, 6),
                              prefill_s=round(timeline.prefill_time or 0.0, 6))
        if update.finish_reason is not None:
            self._finish(timeline, update, now)

    def _finish(self, timeline: RequestTimeline, update: RequestUpdate, now: float) -> None:
        self.tracker.pop(timeline.request_id)
        timeline.finish(now, str(update.finish_reason), update.num_output_tokens,
                        update.num_cached_tokens, update.num_preemptions)
        self.interval.finished_requests += 1
        if self.metrics is not None:
            self.metrics.observe_finished(timeline)
            self._observe_request_max(timeline)
        fields = timeline.log_fields()
        if update.error:
            fields["error"] = update.error
        if update.num_draft_tokens:
            fields.update(spec_draft_tokens=update.num_draft_tokens,
                          spec_accepted_tokens=update.num_accepted_tokens,
                          spec_acceptance_rate=round(
                              update.num_accepted_tokens / update.num_draft_tokens, 4))
        self.log.info("request_finished", **fields)

    def _observe_request_max(self, timeline: RequestTimeline) -> None:
        """``request_max_num_generation_tokens`` once the last of a
        request's ``n`` samples finished."""
        if timeline.n == 1:
            self.metrics.observe_max_generated(timeline.num_output_tokens)
            return
        left, most = self._samples_left.get(timeline.parent_id, (timeline.n, 0))
        most = max(most, timeline.num_output_tokens)
        if left <= 1:
            self._samples_left.pop(timeline.parent_id, None)
            self.metrics.observe_max_generated(most)
        else:
            self._samples_left[timeline.parent_id] = (left - 1, most)

    # ------------------------------------------------------------ periodic

    def log_stats(self, num_running: int, num_waiting: int, kv_usage: float,
                  force: bool = False) -> dict[str, Any] | None:
        """Write one ``engine_stats`` line and start a new interval.

        Skipped (returns None) when the engine was idle for this interval
        and the previous one, unless ``force``.
        """
        now = time.monotonic()
        idle = self.interval.is_idle and not num_running and not num_waiting
        if idle and self._last_idle and not force:
            self.interval = IntervalStats(start=now)
            return None
        self._last_idle = idle
        snap = self.interval.snapshot(now, num_running, num_waiting, kv_usage,
                                      self.total_preemptions)
        self.interval = IntervalStats(start=now)
        fields, message = snap.log_fields(), snap.message()
        spec, self.interval_spec = self.interval_spec, SpecDecodingStats()
        if spec.num_drafts:
            rate = spec.num_accepted_tokens / spec.num_draft_tokens
            fields.update(spec_mean_acceptance_length=round(spec.mean_acceptance_length, 3),
                          spec_draft_acceptance_rate=round(rate, 4), spec_drafts=spec.num_drafts)
            message += (f", Spec decode: mean acceptance length "
                        f"{spec.mean_acceptance_length:.2f}, draft acceptance rate {rate:.1%}")
        if self.stalled_seconds:
            fields["stalled_s"] = round(self.stalled_seconds, 1)
            message += f", STALLED {self.stalled_seconds:.0f} s (no step finished)"
        self.log.info("engine_stats", message=message, **fields)
        return fields


def _cached(output: SchedulerOutput, request_id: str) -> int:
    for new in output.new_requests:
        if new.request_id == request_id:
            return new.num_cached_tokens
    return 0


def _is_first_sample(timeline: RequestTimeline) -> bool:
    """Sample 0 of its request (the request itself when ``n == 1``)."""
    return timeline.request_id == timeline.parent_id or timeline.request_id.endswith("-0")
