"""EngineReplica: one ``AsyncEngine`` inside a Ray actor process.

The API process calls it over Ray: ``generate`` is an async generator that
Ray streams back event by event (``num_returns="streaming"``), ``poll``
returns the replica's load and the KV events since the last poll (for the
router's prefix index), ``metrics_text`` its Prometheus registry. Ray runs
the actor's coroutines on one event loop, the engine's own.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

from kvserve.actors.messages import GenerateRequest, StreamEvent
from kvserve.config import EngineConfig
from kvserve.core.kv_events import KVEvent, KVEventLog
from kvserve.core.router import ReplicaLoad


class EngineReplica:
    """One engine of a data-parallel group (wrap with ``ray.remote``).

    Args:
        index: the replica's number (a label on its metrics and logs).
        config: the engine's configuration.
        model_name: the served model name.
        request_timeout, stats_interval: as ``AsyncEngine.start`` takes them.
    """

    def __init__(self, index: int, config: EngineConfig, model_name: str | None = None,
                 request_timeout: float | None = None, stats_interval: float = 10.0) -> None:
        self.index = index
        self.config = config
        self.model_name = model_name
        self.request_timeout = request_timeout
        self.stats_interval = stats_interval
        self.engine = None
        self.events = KVEventLog()

    async def start(self) -> dict:
        """Load the model and start the engine; returns what the router and
        the API need (``max_model_len``, ``block_size``, KV tokens)."""
        import structlog

        from kvserve.engine import AsyncEngine
        from kvserve.log import configure_logging

        configure_logging("json", "info")
        structlog.contextvars.bind_contextvars(replica=self.index)
        self.engine = await AsyncEngine.start(self.config, self.model_name,
                                              request_timeout=self.request_timeout,
                                              stats_interval=self.stats_interval)
        self.engine.core.scheduler.kv_cache_manager.pool.events = self.events
        plan = self.engine.core.plan
        return {"max_model_len": self.engine.max_model_len, "block_size": plan.block_size,
                "num_kv_tokens": plan.num_tokens, "model_name": self.engine.model_name,
                "pid": os.getpid()}

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]:
        """The request's events, as the engine's stream gives them; the
        request is aborted when the caller stops reading (Ray cancels us)."""
        stream = self.engine.generate(request)
        try:
            async for event in stream:
                yield event
        finally:
            if not stream.all_finished:
                await self.engine.abort(request.request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request (its client left)."""
        await self.engine.abort(request_id)

    def poll(self) -> tuple[ReplicaLoad, tuple[KVEvent, ...], bool]:
        """The replica's load now, its KV events since the last poll, and
        whether its engine runs (False after Ray restarted the process: the
        client calls ``start`` again)."""
        if self.engine is None:
            return ReplicaLoad(), (), False
        core = self.engine.core.scheduler
        load = ReplicaLoad(running=core.num_running, waiting=self.engine.scheduler.num_waiting)
        return load, self.events.drain(), True

    def is_ready(self) -> bool:
        return self.engine is not None and self.engine.is_ready()

    def metrics_text(self) -> str:
        """The replica's Prometheus registry (text format)."""
        return self.engine.metrics.render().decode()

    async def shutdown(self) -> None:
        if self.engine is not None:
            await self.engine.shutdown()
