"""AsyncEngine: wires the actors around the engine core and runs them.

    engine = await AsyncEngine.start(EngineConfig(model=path))
    stream = engine.generate(GenerateRequest(...))
    async for event in stream: ...
    await engine.shutdown()

The core (model, KV cache, scheduler) is built by ``kvserve.startup``; the
engine builds every actor's mailbox first, then each actor with its own
and its peers' (``kvserve.actors.base``), and from then on talks to them
only by message.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import structlog

from kvserve.actors.admission import AdmissionActor
from kvserve.actors.detokenizer import DetokenizerActor
from kvserve.actors.messages import (
    AbortRequest,
    AdoptBlocks,
    AttachTier,
    CloseStream,
    Deliver,
    FlushStats,
    GenerateRequest,
    HealthQuery,
    ImportBlocks,
    LoadReport,
    OpenStream,
    RequestFailed,
    RequestReceived,
    shutdown_failure,
)
from kvserve.actors.registry import StreamRegistry, child_request_ids
from kvserve.actors.scheduler import SchedulerActor
from kvserve.actors.stats import StatsActor
from kvserve.actors.stream import RequestStream
from kvserve.actors.tokenizer import TokenizerActor
from kvserve.actors.worker import WorkerActor, worker_executor
from kvserve.config import EngineConfig
from kvserve.constraints.compiler import ConstraintCompiler
from kvserve.core.admission_queue import AdmissionLimits, AdmissionQueue
from kvserve.core.stall import EngineHealth
from kvserve.model.gguf_model import served_name
from kvserve.observability.metrics import EngineMetrics
from kvserve.observability.stats_logger import StatsObserver
from kvserve.startup import EngineCore, build_engine_core  # noqa: F401 - re-exported

log = structlog.get_logger("kvserve.engine")

#: Seconds ``check_health`` waits for the scheduler actor's answer.
HEALTH_QUERY_TIMEOUT = 2.0
#: Seconds between two readings of the stall watch (at most a quarter of
#: ``--stall-timeout``).
STALL_WATCH_INTERVAL = 1.0
#: The actors in data-flow order (the order they stop in).
ACTORS = (TokenizerActor, AdmissionActor, SchedulerActor, WorkerActor, DetokenizerActor,
          StatsActor)


def _runner_with_faults(core: EngineCore):
    """The runner the worker drives: the core's, wrapped in a ``FaultyRunner``
    when the config injects step faults (tests only, ``kvserve.testing``)."""
    faults = core.config.fault_injection
    if faults is None or not faults.faults_steps:
        return core.runner
    from kvserve.testing.faults import FaultyRunner

    return FaultyRunner(core.runner, faults)


class AsyncEngine:
    """The engine's public face: ``generate``, ``abort``, ``shutdown``.

    Implements ``kvserve.actors.stream.EngineClient`` for the API. Must be
    used from one event loop (the one ``start`` ran on).

    The engine opens each request's stream and keeps the ids in use
    (``streams``, its own registry: the detokenizer, which alone writes the
    streams, tells it when one closes); everything else it learns or does
    by message: arrivals go to the tokenizer, the stream to the
    detokenizer, health questions to the scheduler, KV imports and tiers to
    the worker.

    Observability: ``metrics`` (``kvserve.observability.metrics.EngineMetrics``, its own
    Prometheus registry, served as ``/metrics`` by the CLI), lifecycle and
    step log events (the stats actor's ``StatsObserver``) and an
    ``engine_stats`` line every ``stats_interval`` seconds (0 = off).
    ``log_prompts`` adds the prompt to ``request_received``.
    """

    def __init__(self, core: EngineCore, model_name: str | None = None,
                 admission: AdmissionLimits | None = None,
                 request_timeout: float | None = None, stats_interval: float = 10.0,
                 log_prompts: bool = False,
                 executor: ThreadPoolExecutor | None = None) -> None:
        self.core = core
        self.request_timeout = request_timeout
        self.stats_interval = stats_interval
        self.log_prompts = log_prompts
        self.tokenizer = core.tokenizer
        self.model_name = model_name or served_name(core.config.model)
        self.max_model_len = core.max_model_len
        #: The layout an offload tier for this engine must have.
        self.kv_layout = core.kv_layout
        self.streams = StreamRegistry()  # the requests open now (ids in use)
        self.streams.on_close = self._cancel_deadline
        self._deadlines: dict[str, asyncio.TimerHandle] = {}
        self._kv_exports: dict[str, asyncio.Future] = {}
        self.load = LoadReport(0, 0, 0.0)  # the scheduler's latest, via the stats actor
        self.metrics = EngineMetrics(self.model_name, core.max_model_len,
                                     core.scheduler.config.max_num_batched_tokens)
        cache = core.config.cache
        self.metrics.set_cache_config(
            block_size=core.plan.block_size,
            cache_dtype=(cache.kv_cache_dtype if cache.kv_cache_dtype != "auto"
                         else str(core.backend.dtype)),
            enable_prefix_caching=cache.enable_prefix_caching,
            num_gpu_blocks=core.plan.num_blocks,
            gpu_memory_utilization=cache.gpu_memory_utilization,
            kv_cache_memory_bytes=cache.kv_cache_memory)
        self.metrics.set_decode_path(core.decode_path.path)
        self._build_actors(core, admission, executor)
        self._watch_task: asyncio.Task[None] | None = None
        self._ready = False
        self._stopping = False
        #: Why the engine stopped serving (an actor died), or None while healthy.
        self.dead_reason: str | None = None
        self._inject_faults(core.config.fault_injection)

    def _build_actors(self, core: EngineCore, admission: AdmissionLimits | None,
                      executor: ThreadPoolExecutor | None) -> None:
        """Every mailbox first, then each actor with its own and its peers'."""
        box = {actor.name: actor.mailbox() for actor in ACTORS}
        sched = core.scheduler.config
        queue = AdmissionQueue(
            admission or AdmissionLimits(policy=sched.policy,
                                         priority_aging_seconds=sched.priority_aging_seconds),
            core.scheduler.block_size, sched.max_num_batched_tokens)
        layout, ops = core.kv_layout, core.backend.ops
        self.tokenizer_actor = TokenizerActor(
            core.tokenizer, core.max_model_len, box["admission"], box["detokenizer"],
            compiler=ConstraintCompiler(Path(core.config.model) / "tokenizer.json",
                                        core.model_config.vocab_size,
                                        core.model_config.eos_token_ids,
                                        core.config.structured_outputs),
            inbox=box["tokenizer"])
        self.admission = AdmissionActor(box["scheduler"], box["detokenizer"], box["stats"], queue,
                                        core.model_config.eos_token_ids, core.max_model_len,
                                        inbox=box["admission"])
        self.scheduler = SchedulerActor(core.scheduler, box["worker"], box["detokenizer"],
                                        box["admission"], box["stats"], core.config.stall_timeout,
                                        on_kv_export=self._on_kv_export,
                                        attach_tier=layout.attach_tier, inbox=box["scheduler"])
        self.worker = WorkerActor(_runner_with_faults(core), box["scheduler"], executor,
                                  make_connector=lambda: layout.connector(ops),
                                  inbox=box["worker"])
        self.detokenizer = DetokenizerActor(core.tokenizer, box["admission"],
                                            on_closed=self._on_stream_closed,
                                            inbox=box["detokenizer"])
        self.stats = StatsActor(StatsObserver(self.metrics), self.stats_interval,
                                on_load=self._on_load, inbox=box["stats"])
        self._actors = [self.tokenizer_actor, self.admission, self.scheduler, self.worker,
                        self.detokenizer, self.stats]

    def _inject_faults(self, faults) -> None:
        """Test-only faults (``kvserve.testing.faults.FaultInjection``): off
        unless the config asks; that module is imported only then."""
        if faults is None:
            return
        from kvserve.testing.faults import arm_actor_death

        log.warning("fault_injection_enabled", faults=repr(faults),
                    message="Fault injection is on: this engine fails on purpose (tests only)")
        if faults.kill_actor is not None:
            actor = next(a for a in self._actors if a.name == faults.kill_actor)
            arm_actor_death(actor, faults.kill_after_messages)

    @classmethod
    async def start(cls, config: EngineConfig, model_name: str | None = None,
                    request_timeout: float | None = None, stats_interval: float = 10.0,
                    log_prompts: bool = False, kv_events=None) -> AsyncEngine:
        """Build the engine on the worker's thread (off the event loop), then
        start the actors.

        Admission limits come from ``config.scheduler`` (policy,
        ``max_waiting_requests``, ``max_waiting_tokens``). ``kv_events``: a
        ``core.kv_events.KVEventLog`` the block pool records its events in
        from its construction on (a data-parallel replica's, for the
        prefix-aware router), or None. Raises ``BackendUnavailable`` when
        the backend cannot run here.
        """
        executor = worker_executor()
        try:
            core = await asyncio.get_running_loop().run_in_executor(
                executor, partial(build_engine_core, config, kv_events=kv_events))
        except BaseException:
            executor.shutdown(wait=False)
            raise
        sched = config.scheduler
        limits = AdmissionLimits(policy=sched.policy, max_waiting_requests=sched.max_waiting_requests,
                                 max_waiting_tokens=sched.max_waiting_tokens,
                                 priority_aging_seconds=sched.priority_aging_seconds)
        engine = cls(core, model_name, limits, request_timeout, stats_interval, log_prompts,
                     executor)
        engine.start_actors()
        return engine

    def start_actors(self) -> None:
        """Start every actor's run loop (the stats actor's timer with it) on
        the running loop; an actor whose loop ends before ``shutdown`` kills
        the engine (``_on_actor_exit``)."""
        for actor in self._actors:
            task = actor.start()
            task.add_done_callback(lambda t, name=actor.name: self._on_actor_exit(name, t))
        self._watch_task = asyncio.create_task(self._watch_loop(), name="stall-watch")
        self._ready = True

    # ------------------------------------------------------------- queries

    async def log_stats(self, force: bool = False) -> dict | None:
        """Have the stats actor write one ``engine_stats`` line now (after
        every report sent before this call); its fields, or None when it
        was skipped (see ``StatsObserver.log_stats``)."""
        reply = asyncio.get_running_loop().create_future()
        self.stats.send(FlushStats(force, reply))
        return await reply

    def _on_load(self, report: LoadReport) -> None:
        self.load = report

    async def check_health(self, timeout: float = HEALTH_QUERY_TIMEOUT) -> EngineHealth | None:
        """Ask the scheduler actor for a stall reading (``HealthQuery``);
        None when it does not answer within ``timeout`` seconds (its loop is
        blocked, or it died)."""
        reply = asyncio.get_running_loop().create_future()
        self.scheduler.send(HealthQuery(reply))
        try:
            return await asyncio.wait_for(reply, timeout)
        except TimeoutError:
            return None

    async def _watch_loop(self) -> None:
        """Read the stall watch every ``STALL_WATCH_INTERVAL`` s, so that the
        gauge and the ``engine_stalled`` line come with no probe asking."""
        while True:
            await asyncio.sleep(min(STALL_WATCH_INTERVAL, self.core.config.stall_timeout / 4))
            try:
                await self.check_health()
            except Exception:  # noqa: BLE001 - the watch must never stop the engine
                log.exception("stall_watch_failed")

    def is_ready(self) -> bool:
        """True while the engine accepts requests."""
        return self._ready

    def health(self) -> dict:
        """``/health``'s body while ready: ``{"status": "ok"}``, or
        ``"unavailable"`` with ``pipeline_stages_down`` while a pipeline stage
        does not answer (Ray restarts it; ``kvserve.distributed.pipeline``):
        every step needs every stage, so none can run meanwhile (``/health``
        answers 503; requests wait for the stage)."""
        down = self.core.runner.stages_down()
        if down:
            return {"status": "unavailable", "pipeline_stages_down": down}
        return {"status": "ok"}

    # ------------------------------------------------------------ requests

    def generate(self, request: GenerateRequest) -> RequestStream:
        """Submit a request; its events arrive on the returned stream.

        Never raises for a refused request: a draining engine answers 503, a
        request id already in use 400, both as a ``RequestFailed`` event.
        With ``request_timeout`` set, the request is aborted when its
        deadline passes and its stream ends with a 504 ``RequestFailed``.
        """
        n = request.sampling_params.n
        rid = request.request_id
        refusal = self._refuse(request)
        if refusal is not None:
            stream = RequestStream(rid, n)
            stream.put(refusal)  # never registered: no actor will write it
            return stream
        stream = self.streams.open(rid, n)
        self.detokenizer.send(OpenStream(rid, n, stream))
        prompt = request.prompt if request.prompt is not None else (
            request.messages if request.messages is not None else request.prompt_token_ids)
        self.stats.send(RequestReceived(rid, request.arrival_time, request.priority,
                                        request.request_class, n, prompt, self.log_prompts,
                                        stream=request.stream,
                                        max_tokens=request.sampling_params.max_tokens))
        self.tokenizer_actor.send(request)
        if self.request_timeout is not None:
            self._deadlines[rid] = asyncio.get_running_loop().call_later(
                self.request_timeout, self._expire, rid, stream)
        return stream

    def _refuse(self, request: GenerateRequest) -> RequestFailed | None:
        rid = request.request_id
        if self.dead_reason is not None:
            return RequestFailed(rid, 503, f"The engine failed: {self.dead_reason}.",
                                 type="service_unavailable")
        if not self._ready:
            return RequestFailed(rid, 503, "The server is not accepting requests "
                                 "(starting up or draining).", type="service_unavailable")
        if not self.streams.can_open(rid, request.sampling_params.n):
            return RequestFailed(rid, 400, f"Request id {rid!r} is already in use.",
                                 param="X-Request-Id")
        return None

    def _end(self, request_id: str, failure: RequestFailed | None, reason: str = "abort") -> None:
        """End an open request from outside the pipeline: forget its id, have
        the detokenizer close its stream (with ``failure`` as the last
        event, or silently when None: the client left) and abort its samples
        wherever they are (the tokenizer passes the abort on)."""
        stream = self.streams.close(request_id)
        if stream is None:
            return
        if failure is None:
            self.detokenizer.send(CloseStream(request_id))
        else:
            self.detokenizer.send(Deliver(request_id, failure))
        self.tokenizer_actor.send(AbortRequest(child_request_ids(request_id, stream.n),
                                               reason=reason))

    def _on_stream_closed(self, request_id: str, stream: RequestStream) -> None:
        """The detokenizer closed a stream (it ended, failed or was closed):
        its id is free again, unless a new request already reuses it."""
        if self.streams.get(request_id) is stream:
            self.streams.close(request_id)

    def _cancel_deadline(self, request_id: str, stream: RequestStream | None = None) -> None:
        handle = self._deadlines.pop(request_id, None)
        if handle is not None:
            handle.cancel()

    def _expire(self, request_id: str, stream: RequestStream) -> None:
        """Deadline passed: end the stream with 504 and abort the request."""
        if self.streams.get(request_id) is not stream:
            return  # finished (or aborted) in time
        self._end(request_id, RequestFailed(
            request_id, 504, f"The request did not finish within --request-timeout "
            f"{self.request_timeout:g} s.", type="timeout", code="request_timeout"))
        log.info("request_timed_out", request_id=request_id, timeout_s=self.request_timeout)

    async def abort(self, request_id: str) -> None:
        """Stop a request (client gone); its blocks are freed at the next step."""
        if self.streams.is_open(request_id):
            self._end(request_id, None)
            log.info("request_aborted", request_id=request_id)

    # ----------------------------------------------- disaggregated prefill

    def expect_kv_export(self, request_id: str) -> asyncio.Future:
        """A future for the K/V a request with ``SamplingParams.export_kv``
        exports when it finishes: a ``kv_connector.ExportedKV`` (its full
        prompt blocks' hashes and K/V), or None if the export failed. Call
        before ``generate``; await only if the request finished with
        ``length`` or ``stop`` (an aborted or failed one exports nothing)."""
        future = asyncio.get_running_loop().create_future()
        self._kv_exports[request_id] = future
        return future

    def _on_kv_export(self, request_id: str, data) -> None:
        future = self._kv_exports.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(data)

    def forget_kv_export(self, request_id: str) -> None:
        """Drop the future of an export that will not come."""
        future = self._kv_exports.pop(request_id, None)
        if future is not None:
            future.cancel()

    def import_kv(self, request_id: str, block_hashes, data) -> None:
        """Adopt a prefill replica's blocks for ``request_id`` before it is
        submitted: ``block_hashes`` (its full prompt blocks, in order) and
        their K/V ``data`` (``[len(block_hashes), *block_shape]``). The
        worker keeps them; the scheduler adopts the hashes, so the request
        finds them as prefix-cache hits, and the step that first schedules
        it loads them (the worker handles the import first: its inbox is in
        order, and the step is sent after the scheduler adopted)."""
        hashes = tuple(block_hashes)
        self.worker.send(ImportBlocks(request_id, hashes, data))
        self.scheduler.send(AdoptBlocks(request_id, hashes))

    async def attach_offload_tier(self, path: str) -> None:
        """Use the KV offload tier another process created at ``path`` (a
        data-parallel client's, shared by its replicas): the worker maps it
        for its saves and loads, then the scheduler for its look-ups.
        Raises ``ValueError`` if it holds another model's blocks."""
        for actor in (self.worker, self.scheduler):
            reply = asyncio.get_running_loop().create_future()
            actor.send(AttachTier(path, reply))
            error = await reply
            if error is not None:
                raise error

    # ----------------------------------------------------------- lifecycle

    def _on_actor_exit(self, name: str, task: asyncio.Task[None]) -> None:
        """An actor's loop ended: expected at shutdown; otherwise the engine
        is dead. Every open request ends with a 500 error event (none hangs),
        new ones get 503 and ``/health`` 503 with ``dead_reason``."""
        if self._stopping:
            return
        exc = None if task.cancelled() else task.exception()
        cause = f"{type(exc).__name__}: {exc}" if exc is not None else "its loop ended"
        self.dead_reason = f"the {name} actor died ({cause})"
        self._ready = False
        log.error("actor_died", actor=name, error=cause, open_requests=len(self.streams),
                  exc_info=exc, message=f"The engine stopped serving: {self.dead_reason}")
        for request_id in self.streams.ids():
            stream = self.streams.close(request_id)
            failure = RequestFailed(request_id, 500, f"The engine failed: {self.dead_reason}.",
                                    type="server_error")
            if self.detokenizer.running:
                self.detokenizer.send(Deliver(request_id, failure))
            else:  # its writer is gone: nobody else writes this stream now
                stream.put(failure)

    async def drain(self, timeout: float) -> int:
        """Graceful drain: refuse new requests (503), let accepted ones finish
        for up to ``timeout`` seconds, then end the rest with a 503
        ``RequestFailed`` (nothing accepted is dropped silently).

        Returns the number of requests that had to be failed.
        """
        self._ready = False
        log.info("drain_started", open_requests=len(self.streams), timeout_s=timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.streams) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = self.streams.ids()
        for request_id in left:
            self._end(request_id, shutdown_failure(request_id, timeout), reason="abort")
        log.info("drain_finished", failed_requests=len(left))
        return len(left)

    async def shutdown(self) -> None:
        """Stop the actors in data-flow order; the stats actor, last, writes
        a last ``engine_stats`` line; the worker closes the KV connector."""
        self._ready = False
        self._stopping = True
        if self._watch_task is not None:
            self._watch_task.cancel()
            self._watch_task = None
        for actor in self._actors:
            await actor.stop()
        self.core.runner.close()  # the pipeline stages' processes, if any
