"""EngineReplica: one ``AsyncEngine`` inside a Ray actor process.

The API process calls it over Ray: ``generate`` is an async generator that
Ray streams back event by event (``num_returns="streaming"``); on a decode
replica it first adopts the KV blocks that ``prefill`` exported on a
prefill replica (disaggregated prefill/decode), which reach it through
Ray's object store; ``poll``
returns the replica's load and the KV events since the last poll (for the
router's prefix index), ``metrics_text`` its Prometheus registry. Ray runs
the actor's coroutines on one event loop, the engine's own.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator

from kvserve.actors.messages import GenerateRequest, RequestFailed, RequestOutput, StreamEvent
from kvserve.config import EngineConfig
from kvserve.core.kv_events import KVEvent, KVEventLog
from kvserve.core.router import ReplicaLoad


#: Seconds a prefill waits for its KV export after the request finished (the
#: next step copies it; only a dead engine takes this long). The decode
#: replica then computes the prompt itself.
EXPORT_TIMEOUT = 60.0


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
        from kvserve.thread_env import apply_thread_pool_env

        apply_thread_pool_env()  # before kvserve.engine loads NumPy (kvserve.thread_env)
        import structlog

        from kvserve.engine import AsyncEngine
        from kvserve.observability.log import configure_logging

        configure_logging("json", "info")
        structlog.contextvars.bind_contextvars(replica=self.index)
        self.engine = await AsyncEngine.start(self.config, self.model_name,
                                              request_timeout=self.request_timeout,
                                              stats_interval=self.stats_interval,
                                              kv_events=self.events)
        plan = self.engine.core.plan
        return {"max_model_len": self.engine.max_model_len, "block_size": plan.block_size,
                "num_kv_tokens": plan.num_tokens, "model_name": self.engine.model_name,
                "pid": os.getpid()}

    async def attach_offload_tier(self, path: str) -> None:
        """Share the node's KV offload tier at ``path`` (the client made it)."""
        await self.engine.attach_offload_tier(path)

    def kv_layout(self) -> dict:
        """What an offload tier for this engine must hold: one block's shape,
        its dtype and the model fingerprint."""
        layout = self.engine.kv_layout
        return {"block_shape": layout.block_shape, "dtype": layout.dtype,
                "fingerprint": layout.fingerprint}

    async def prefill(self, request: GenerateRequest) -> tuple[dict, object]:
        """The prefill half of a disaggregated request (its sampling params
        have ``export_kv`` and ``max_tokens`` 1): compute the prompt, then
        return ``(info, data)``. ``info`` has ``block_hashes`` and
        ``seconds`` (or ``failure``, a ``RequestFailed``, or ``error``);
        ``data`` is the blocks' K/V (``[num_blocks, *block_shape]``) or
        None. Called with ``num_returns=2``, so the K/V stay in Ray's object
        store until the decode replica reads them."""
        t0 = time.perf_counter()
        rid = request.request_id
        future = self.engine.expect_kv_export(rid)
        failure, finished = None, False
        async for event in self.generate(request):
            if isinstance(event, RequestFailed):
                failure = event
            elif isinstance(event, RequestOutput) and event.finish_reason in ("length", "stop"):
                finished = True
        if not finished:
            self.engine.forget_kv_export(rid)
            return {"failure": failure, "error": "the prefill did not finish"}, None
        try:
            exported = await asyncio.wait_for(future, EXPORT_TIMEOUT)
        except asyncio.TimeoutError:
            self.engine.forget_kv_export(rid)
            exported = None
        if exported is None:
            return {"error": "the KV export failed"}, None
        return ({"block_hashes": exported.block_hashes, "bytes": int(exported.data.nbytes),
                 "seconds": time.perf_counter() - t0}, exported.data)

    async def generate(self, request: GenerateRequest,
                       kv: list | None = None) -> AsyncIterator[StreamEvent]:
        """The request's events, as the engine's stream gives them; the
        request is aborted when the caller stops reading (Ray cancels us).
        ``kv``: ``[block_hashes, ObjectRef of their K/V]`` from a prefill
        replica's ``prefill``; the blocks are adopted before the request
        starts (the reference is in a list so that Ray hands it over
        unresolved and the fetch is timed here)."""
        if kv is not None:
            await self._import(request.request_id, kv[0], kv[1])
        stream = self.engine.generate(request)
        try:
            async for event in stream:
                yield event
        finally:
            if not stream.all_finished:
                await self.engine.abort(request.request_id)

    async def _import(self, request_id: str, block_hashes, ref) -> None:
        t0 = time.perf_counter()
        data = await ref
        self.engine.metrics.observe_kv_transfer("fetch", len(block_hashes), int(data.nbytes),
                                                time.perf_counter() - t0)
        self.engine.import_kv(request_id, block_hashes, data)

    async def abort(self, request_id: str) -> None:
        """Stop a request (its client left)."""
        await self.engine.abort(request_id)

    def poll(self) -> tuple[ReplicaLoad, tuple[KVEvent, ...], bool]:
        """The replica's load now, its KV events since the last poll, and
        whether its engine runs (False after Ray restarted the process: the
        client calls ``start`` again)."""
        if self.engine is None:
            return ReplicaLoad(), (), False
        load = ReplicaLoad(running=self.engine.load.num_running,
                           waiting=self.engine.load.num_waiting)
        return load, self.events.drain(), True

    def is_ready(self) -> bool:
        return self.engine is not None and self.engine.is_ready()

    def metrics_text(self) -> str:
        """The replica's Prometheus registry (text format)."""
        return self.engine.metrics.render().decode()

    async def shutdown(self) -> None:
        if self.engine is not None:
            await self.engine.shutdown()
