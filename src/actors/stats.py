"""StatsActor: the one owner of the engine's statistics (timelines, log events, metrics)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvserve.actors.base import Actor, Mailbox
from kvserve.actors.messages import (
    FlushStats,
    LoadReport,
    RequestQueued,
    RequestReceived,
    RequestsUpdated,
    StallReport,
    StepFinished,
    StepScheduled,
)
from kvserve.observability.stats_logger import StatsObserver


class StatsActor(Actor):
    """Keeps the ``StatsObserver`` (``kvserve.observability.stats_logger``) and feeds it the
    other actors' reports, in the order they were sent.

    The engine reports arrivals (``RequestReceived``), admission queueings
    (``RequestQueued``), the scheduler steps, token deltas, load and stall
    readings. Every report carries the monotonic time of what it reports, so
    a report's wait in this inbox never shows in a request's timings. Every
    ``interval`` seconds (0: never) and on ``FlushStats`` it writes one
    ``engine_stats`` line; ``on_load`` (the engine's) receives each
    ``LoadReport`` so the engine can answer "how loaded are you" without
    asking the scheduler's core.
    """

    name = "stats"
    accepts = (RequestReceived, RequestQueued, StepScheduled, StepFinished, RequestsUpdated,
               LoadReport, StallReport, FlushStats)

    def __init__(self, observer: StatsObserver, interval: float = 10.0,
                 on_load: Callable[[LoadReport], None] | None = None,
                 inbox: Mailbox | None = None) -> None:
        super().__init__(inbox)
        self.observer = observer
        self.interval = interval
        self.on_load = on_load
        self._load = LoadReport(0, 0, 0.0)
        self._timer: asyncio.Task[None] | None = None

    def start(self) -> asyncio.Task[None]:
        """Start the run loop and, with ``interval > 0``, the periodic line."""
        task = super().start()
        if self.interval and self.interval > 0:
            self._timer = asyncio.create_task(self._tick(), name="stats-timer")
        return task

    async def stop(self) -> None:
        """Write a last ``engine_stats`` line (after every report sent before
        this call) and end the loop."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.running:
            self.send(FlushStats())
        await super().stop()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.send(FlushStats())

    async def handle(self, message) -> None:
        obs = self.observer
        if isinstance(message, RequestsUpdated):
            for update, emitted in message.updates:
                obs.on_update(update, emitted, now=message.at)
        elif isinstance(message, StepFinished):
            if message.spec is not None:
                obs.on_spec_decode(message.spec)
            if message.transfer is not None:
                obs.on_kv_transfer(message.transfer)
                if obs.metrics is not None:  # tiers below the memory tier (the disk's)
                    for tier, (queries, hits) in getattr(message.transfer, "offload_tiers",
                                                         {}).items():
                        obs.metrics.observe_offload(queries, hits, tier)
            obs.on_step(message.output, message.start, message.end, message.times)
        elif isinstance(message, StepScheduled):
            obs.on_schedule(message.output, message.num_running, message.num_waiting,
                            message.kv_usage, now=message.at)
        elif isinstance(message, LoadReport):
            self._load = message
            obs.set_load(message.num_running, message.num_waiting, message.kv_usage)
            if self.on_load is not None:
                self.on_load(message)
        elif isinstance(message, RequestQueued):
            obs.on_queued(message.request_id, message.parent_id, message.arrival_time,
                          message.prompt_tokens, message.priority, message.request_class,
                          now=message.at)
        elif isinstance(message, RequestReceived):
            obs.on_received(message.request_id, message.arrival_time, message.priority,
                            message.request_class, message.n, message.prompt,
                            message.log_prompts, stream=message.stream,
                            max_tokens=message.max_tokens)
        elif isinstance(message, StallReport):
            obs.set_stall(message.seconds, message.stalled)
        elif isinstance(message, FlushStats):
            fields = obs.log_stats(self._load.num_running, self._load.num_waiting,
                                   self._load.kv_usage, force=message.force)
            if message.reply is not None and not message.reply.done():
                message.reply.set_result(fields)
