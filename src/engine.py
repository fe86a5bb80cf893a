"""AsyncEngine: loads the model, sizes the KV cache, wires and runs the actors.

    engine = await AsyncEngine.start(EngineConfig(model=path))
    stream = engine.generate(GenerateRequest(...))
    async for event in stream: ...
    await engine.shutdown()
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import structlog

from kvserve.actors.admission import AdmissionActor
from kvserve.core.admission_queue import AdmissionLimits, AdmissionQueue
from kvserve.actors.detokenizer import DetokenizerActor
from kvserve.actors.messages import (AbortRequest, AdoptBlocks, GenerateRequest, HealthQuery,
                                     RequestFailed, shutdown_failure)
from kvserve.actors.registry import StreamRegistry, child_request_ids
from kvserve.actors.scheduler import SchedulerActor
from kvserve.actors.stream import RequestStream
from kvserve.actors.tokenizer import TokenizerActor
from kvserve.actors.worker import WorkerActor, worker_executor
from kvserve.config import EngineConfig, ModelConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.scheduler import Scheduler
from kvserve.core.stall import EngineHealth
from kvserve.distributed.kv_connector import KVConnector, build_kv_connector
from kvserve.faults import FaultInjection, FaultyRunner, arm_actor_death
from kvserve.metrics import EngineMetrics
from kvserve.model.llama import LlamaModel
from kvserve.model.loader import load_gguf_blocks, load_model_config, load_weights
from kvserve.model.backend import Backend, create_backend
from kvserve.model.drafter import DraftProposer, load_draft_model
from kvserve.model.runner import ModelRunner, profile_forward
from kvserve.model.tokenizer import Tokenizer
from kvserve.plan import (  # noqa: F401 - KVCachePlan re-exported
    KVCachePlan, cap_to_cache, plan_kv_cache, resolve_max_model_len)
from kvserve.stats_logger import StatsObserver
from kvserve.structured.compiler import ConstraintCompiler
from kvserve.structured.grammar import load_tokenizer
from kvserve.structured.masks import StructuredOutputs

log = structlog.get_logger("kvserve.engine")

#: Seconds ``check_health`` waits for the scheduler actor's answer.
HEALTH_QUERY_TIMEOUT = 2.0
#: Seconds between two readings of the stall watch (at most a quarter of
#: ``--stall-timeout``).
STALL_WATCH_INTERVAL = 1.0


@dataclass
class EngineCore:
    """The synchronous parts, built once at start-up (heavy: loads weights)."""

    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Tokenizer
    backend: Backend
    runner: ModelRunner
    scheduler: Scheduler
    plan: KVCachePlan
    max_model_len: int
    #: llguidance's tokenizer for the constraint compiler (``structured.grammar``).
    constraint_tokenizer: object = None


def build_engine_core(config: EngineConfig) -> EngineCore:
    """Load the checkpoint, size the KV cache and build runner and scheduler.

    Call it on the thread that will run the steps (the worker's): the
    backend's buffers and streams belong to it. The weights keep the
    checkpoint's dtype until the backend converts them to its own.
    ``max_model_len`` is the checkpoint's context length, capped by
    ``SchedulerConfig.max_model_len`` and by the KV cache size (a request must
    fit alone), with a warning when the cache caps it. Raises
    ``BackendUnavailable`` when the backend cannot run here.
    """
    t0 = time.monotonic()
    path = Path(config.model)
    log.info("engine_loading", model=str(path), message=f"Loading {path.name} "
             f"({sum(p.stat().st_size for p in path.glob('*.safetensors')) / 2**20:,.1f} MiB "
             f"of safetensors) on the {config.backend} backend...")
    model_config = load_model_config(path)
    tokenizer = Tokenizer(path)
    backend = create_backend(config)
    weights = load_weights(path, model_config, dtype=None)
    float_bytes = sum(array.size for array in weights.values()) * backend.dtype.itemsize
    if config.quantization == "q4":
        weights.update(load_gguf_blocks(path, model_config))
    model = LlamaModel(model_config, weights, backend.ops, config.quantization)
    del weights
    spec = config.scheduler.speculative
    draft = (load_draft_model(spec, model_config, tokenizer, backend.ops)
             if spec is not None and spec.uses_draft_model else None)
    weights_bytes = model.weights_nbytes + (draft.weights_nbytes if draft is not None else 0)
    if config.quantization != "none":
        _log_quantization(config.quantization, model_config, float_bytes, weights_bytes,
                          backend.dtype.itemsize)
    requested = resolve_max_model_len(model_config, config.scheduler.max_model_len)
    kv_bytes = backend.kv_cache_bytes(model_config, weights_bytes, lambda: profile_forward(
        model, backend.ops, config.scheduler.max_num_batched_tokens, config.cache.block_size))
    plan = cap_to_cache(plan_kv_cache(model_config, replace(config.cache, kv_cache_memory=kv_bytes),
                                      requested, backend.dtype.itemsize,
                                      draft.config if draft is not None else None))
    max_len = plan.max_model_len
    if max_len < requested:
        log.warning("max_model_len_capped", max_model_len=max_len, requested=requested,
                    reason="KV cache holds fewer tokens than the context length")
    structured = StructuredOutputs(path / "tokenizer.json", model_config.vocab_size,
                                   model_config.eos_token_ids)
    # The constraint compiler's tokenizer: built now, as it holds the GIL ~0.5 s.
    constraint_tokenizer = load_tokenizer(path / "tokenizer.json", model_config.vocab_size,
                                          model_config.eos_token_ids)
    runner = ModelRunner(model_config, model, backend.ops, plan.num_blocks, plan.block_size,
                         logprobs_mode=config.logprobs_mode, seed=config.seed,
                         structured=structured,
                         drafter=None if draft is None else DraftProposer(
                             draft, backend.ops, plan.num_blocks, plan.block_size, config.seed,
                             max_catch_up=config.scheduler.max_num_batched_tokens))
    runner.kv_connector = connector = build_kv_connector(
        backend.ops, runner.kv_caches, config.cache, model_fingerprint(path, config, backend))
    _log_offload_tier(connector, plan)
    backend.warmup()
    if backend.name == "cuda":
        from kvserve.cuda.backend import capture_graphs
        runner.graphs = capture_graphs(backend, model, runner.kv_caches,
                                       config.scheduler.max_num_seqs, max_len)
    kv = KVCacheManager(plan.num_blocks, plan.block_size, config.cache.enable_prefix_caching,
                        external=connector if connector.tier is not None else None)
    scheduler = Scheduler(replace(config.scheduler, max_model_len=max_len), kv, plan.block_size)
    log.info("kv_cache_size", message=f"KV cache size: {plan.num_tokens:,} tokens",
             num_tokens=plan.num_tokens, num_blocks=plan.num_blocks,
             block_size=plan.block_size, kv_bytes_per_token=plan.bytes_per_token)
    log.info("max_concurrency", message=f"Maximum concurrency for {max_len:,} tokens per "
             f"request: {plan.max_concurrency:.2f}x", max_model_len=max_len,
             max_concurrency=round(plan.max_concurrency, 2))
    sched = config.scheduler
    _log_speculative(sched)
    step_ms = None if sched.max_step_seconds is None else round(sched.max_step_seconds * 1000, 1)
    log.info("scheduler_config", message=f"Step budget: {sched.max_num_batched_tokens} tokens"
             + (f", step-time target {step_ms} ms" if step_ms else "")
             + f", at most {sched.max_num_seqs} sequences, {sched.policy} policy, "
             + f"{sched.max_steps_in_flight} step(s) in flight",
             max_num_batched_tokens=sched.max_num_batched_tokens, max_step_ms=step_ms,
             max_num_seqs=sched.max_num_seqs, policy=sched.policy,
             async_scheduling=sched.async_scheduling)
    seconds = round(time.monotonic() - t0, 3)
    log.info("engine_loaded", model=str(path), backend=backend.name,
             dtype=str(backend.dtype), weights_bytes=weights_bytes, seconds=seconds,
             message=f"Loaded in {seconds} s: {weights_bytes / 2**20:,.1f} MiB of weights, "
                     f"{plan.num_tokens:,} KV tokens")
    return EngineCore(config, model_config, tokenizer, backend, runner, scheduler, plan, max_len,
                      constraint_tokenizer)


def model_fingerprint(path: Path, config: EngineConfig, backend: Backend) -> str:
    """What the K/V of a block depend on besides its tokens: the model's
    config.json, the weights' quantization and the backend's dtype. Engines
    share an offload tier only if their fingerprints are equal."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    digest.update(f"|{config.quantization}|{backend.name}|{backend.dtype}".encode())
    return f"{path.name}:{digest.hexdigest()[:16]}"


def _log_speculative(sched) -> None:
    spec = sched.speculative
    if spec is None:
        return
    if spec.uses_draft_model:
        log.info("speculative_config", method=spec.method,
                 num_speculative_tokens=spec.num_speculative_tokens, draft_model=spec.model,
                 draft_quantization=spec.quantization,
                 message=f"Speculative decoding: draft model {spec.model} "
                         f"({spec.quantization}), up to {spec.num_speculative_tokens} draft "
                         "tokens per step")
        return
    log.info("speculative_config", method=spec.method,
             num_speculative_tokens=spec.num_speculative_tokens,
             prompt_lookup_max=spec.prompt_lookup_max, prompt_lookup_min=spec.prompt_lookup_min,
             message=f"Speculative decoding: {spec.method}, up to {spec.num_speculative_tokens} "
                     f"draft tokens per step (suffixes of {spec.prompt_lookup_min}-"
                     f"{spec.prompt_lookup_max} tokens)")


def _log_offload_tier(connector: KVConnector, plan: KVCachePlan) -> None:
    tier = connector.tier
    if tier is None:
        return
    size = tier.num_slots * tier.slot_bytes
    log.info("kv_offload_tier", path=str(tier.path), num_blocks=tier.num_slots,
             num_tokens=tier.num_slots * plan.block_size, bytes=size, created=connector.owns_tier,
             message=f"KV offload tier: {size / 2**30:.2f} GiB of shared memory, "
                     f"{tier.num_slots:,} blocks ({tier.num_slots * plan.block_size:,} tokens), "
                     f"{'created' if connector.owns_tier else 'attached'} at {tier.path}")


def _log_quantization(scheme: str, model: ModelConfig, float_bytes: int, weights_bytes: int,
                      dtype_bytes: int) -> None:
    """``quantization``: weight bytes before and after, and the KV tokens the
    saved bytes would hold (at this model's KV bytes per token)."""
    saved = float_bytes - weights_bytes
    tokens = max(saved, 0) // model.kv_bytes_per_token(dtype_bytes)
    log.info("quantization", message=f"Quantization {scheme}: weights {float_bytes / 2**20:,.1f} "
             f"MiB -> {weights_bytes / 2**20:,.1f} MiB; the {saved / 2**20:,.1f} MiB saved hold "
             f"{tokens:,} more KV tokens", quantization=scheme, float_weights_bytes=float_bytes,
             weights_bytes=weights_bytes, kv_tokens_gained=tokens)


class AsyncEngine:
    """The engine's public face: ``generate``, ``abort``, ``shutdown``.

    Implements ``kvserve.actors.stream.EngineClient`` for the API. Must be
    used from one event loop (the one ``start`` ran on).

    Observability: ``metrics`` (``kvserve.metrics.EngineMetrics``, its own
    Prometheus registry, served as ``/metrics`` by the CLI), lifecycle and
    step log events (``kvserve.stats_logger.StatsObserver``) and an
    ``engine_stats`` line every ``stats_interval`` seconds (0 = off).
    ``log_prompts`` adds the prompt to ``request_received``.
    """

    def __init__(self, core: EngineCore, model_name: str | None = None,
                 admission: AdmissionLimits | None = None,
                 request_timeout: float | None = None, stats_interval: float = 10.0,
                 log_prompts: bool = False, executor: ThreadPoolExecutor | None = None) -> None:
        self.core = core
        self.request_timeout = request_timeout
        self.stats_interval = stats_interval
        self.log_prompts = log_prompts
        self.tokenizer = core.tokenizer
        self.model_name = model_name or Path(core.config.model).name
        self.max_model_len = core.max_model_len
        self.streams = StreamRegistry()
        self._deadlines: dict[str, asyncio.TimerHandle] = {}
        self.streams.on_close = self._cancel_deadline
        self.metrics = EngineMetrics(self.model_name, core.max_model_len,
                                     core.scheduler.config.max_num_batched_tokens)
        cache = core.config.cache
        self.metrics.set_cache_config(
            block_size=core.plan.block_size, cache_dtype=str(core.backend.dtype),
            enable_prefix_caching=cache.enable_prefix_caching,
            num_gpu_blocks=core.plan.num_blocks,
            gpu_memory_utilization=cache.gpu_memory_utilization,
            kv_cache_memory_bytes=cache.kv_cache_memory)
        self.observer = StatsObserver(self.metrics)
        self._stats_task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self.scheduler = SchedulerActor(core.scheduler, core.config.stall_timeout)
        self.scheduler.observer = self.observer
        self._kv_exports: dict[str, asyncio.Future] = {}
        self.scheduler.on_kv_export = self._on_kv_export
        self.scheduler.kv_connector = core.runner.kv_connector
        self.worker = WorkerActor(core.runner, self.scheduler, executor)
        self.detokenizer = DetokenizerActor(core.tokenizer, self.streams)
        sched = core.scheduler.config
        queue = AdmissionQueue(
            admission or AdmissionLimits(policy=sched.policy,
                                         priority_aging_seconds=sched.priority_aging_seconds),
            core.scheduler.block_size, sched.max_num_batched_tokens)
        self.admission = AdmissionActor(self.streams, self.scheduler, self.detokenizer, queue,
                                        core.model_config.eos_token_ids, core.max_model_len)
        self.admission.observer = self.observer
        self.scheduler.admission = self.admission
        self.tokenizer_actor = TokenizerActor(
            core.tokenizer, core.max_model_len, self.streams, self.admission,
            compiler=ConstraintCompiler(Path(core.config.model) / "tokenizer.json",
                                        core.model_config.vocab_size,
                                        core.model_config.eos_token_ids,
                                        core.config.structured_outputs,
                                        core.constraint_tokenizer))
        self.scheduler.worker = self.worker
        self.scheduler.detokenizer = self.detokenizer
        self.detokenizer.admission = self.admission
        self._actors = [self.tokenizer_actor, self.admission, self.scheduler, self.worker,
                        self.detokenizer]
        self._ready = False
        self._stopping = False
        #: Why the engine stopped serving (an actor died), or None while healthy.
        self.dead_reason: str | None = None
        self._inject_faults(core.config.fault_injection)

    def _inject_faults(self, faults: FaultInjection | None) -> None:
        """Test-only faults (``kvserve.faults``): off unless the config asks."""
        if faults is None:
            return
        log.warning("fault_injection_enabled", faults=repr(faults),
                    message="Fault injection is on: this engine fails on purpose (tests only)")
        if faults.faults_steps:
            self.worker.runner = FaultyRunner(self.worker.runner, faults)
        if faults.kill_actor is not None:
            actor = next(a for a in self._actors if a.name == faults.kill_actor)
            arm_actor_death(actor, faults.kill_after_messages)

    @classmethod
    async def start(cls, config: EngineConfig, model_name: str | None = None,
                    request_timeout: float | None = None, stats_interval: float = 10.0,
                    log_prompts: bool = False) -> AsyncEngine:
        """Build the engine on the worker's thread (off the event loop), then
        start the actors.

        Admission limits come from ``config.scheduler`` (policy,
        ``max_waiting_requests``, ``max_waiting_tokens``). Raises
        ``BackendUnavailable`` when the backend cannot run here.
        """
        executor = worker_executor()
        try:
            core = await asyncio.get_running_loop().run_in_executor(
                executor, build_engine_core, config)
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
        """Start every actor's run loop (and the stats logger) on the running
        loop; an actor whose loop ends before ``shutdown`` kills the engine
        (``_on_actor_exit``)."""
        for actor in self._actors:
            task = actor.start()
            task.add_done_callback(lambda t, name=actor.name: self._on_actor_exit(name, t))
        if self.stats_interval and self.stats_interval > 0:
            self._stats_task = asyncio.create_task(self._log_stats_loop(), name="stats")
        self._watch_task = asyncio.create_task(self._watch_loop(), name="stall-watch")
        self._ready = True

    def log_stats(self, force: bool = False) -> dict | None:
        """Write one ``engine_stats`` line now (see ``StatsObserver.log_stats``)."""
        sched = self.core.scheduler
        return self.observer.log_stats(sched.num_running, self.scheduler.num_waiting,
                                       sched.kv_cache_manager.usage, force=force)

    async def _log_stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.stats_interval)
            try:
                self.log_stats()
            except Exception:  # noqa: BLE001 - statistics must never stop the engine
                log.exception("engine_stats_failed")

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
            self.streams.fail(RequestFailed(request_id, 500, f"The engine failed: "
                                            f"{self.dead_reason}.", type="server_error"))

    def is_ready(self) -> bool:
        """True while the engine accepts requests."""
        return self._ready

    def generate(self, request: GenerateRequest) -> RequestStream:
        """Submit a request; its events arrive on the returned stream.

        Never raises for a refused request: a draining engine answers 503, a
        request id already in use 400, both as a ``RequestFailed`` event.
        With ``request_timeout`` set, the request is aborted when its
        deadline passes and its stream ends with a 504 ``RequestFailed``.
        """
        n = request.sampling_params.n
        refusal = self._refuse(request)
        if refusal is not None:
            stream = RequestStream(request.request_id, n)
            stream.put(refusal)
            return stream
        stream = self.streams.open(request.request_id, n)
        prompt = request.prompt if request.prompt is not None else (
            request.messages if request.messages is not None else request.prompt_token_ids)
        self.observer.on_received(request.request_id, request.arrival_time, request.priority,
                                  request.request_class, n, prompt, self.log_prompts,
                                  stream=request.stream,
                                  max_tokens=request.sampling_params.max_tokens)
        self.tokenizer_actor.send(request)
        if self.request_timeout is not None:
            self._deadlines[request.request_id] = asyncio.get_running_loop().call_later(
                self.request_timeout, self._expire, request.request_id, stream)
        return stream

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
        their K/V ``data`` (``[len(block_hashes), *block_shape]``). The next
        step loads them; the request then finds them as prefix-cache hits."""
        self.core.runner.kv_connector.add_import(request_id, block_hashes, data)
        self.scheduler.send(AdoptBlocks(request_id, tuple(block_hashes)))

    def attach_offload_tier(self, path: str) -> None:
        """Use the KV offload tier another process created at ``path`` (a
        data-parallel client's, shared by its replicas). Raises
        ``ValueError`` if it holds another model's blocks."""
        connector = self.core.runner.kv_connector
        connector.attach_tier(path)
        self.core.scheduler.kv_cache_manager.set_external(connector)
        _log_offload_tier(connector, self.core.plan)

    def _cancel_deadline(self, request_id: str) -> None:
        handle = self._deadlines.pop(request_id, None)
        if handle is not None:
            handle.cancel()

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

    def _expire(self, request_id: str, stream: RequestStream) -> None:
        """Deadline passed: end the stream with 504 and abort the request."""
        if self.streams.get(request_id) is not stream:
            return  # finished (or aborted) in time
        self.streams.fail(RequestFailed(
            request_id, 504, f"The request did not finish within --request-timeout "
            f"{self.request_timeout:g} s.", type="timeout", code="request_timeout"))
        self.admission.send(AbortRequest(child_request_ids(request_id, stream.n), reason="abort"))
        log.info("request_timed_out", request_id=request_id, timeout_s=self.request_timeout)

    async def abort(self, request_id: str) -> None:
        """Stop a request (client gone); its blocks are freed at the next step."""
        stream = self.streams.close(request_id)
        if stream is None:
            return
        self.admission.send(AbortRequest(child_request_ids(request_id, stream.n), reason="abort"))
        log.info("request_aborted", request_id=request_id)

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
            stream = self.streams.get(request_id)
            self.streams.fail(shutdown_failure(request_id, timeout))
            if stream is not None:
                self.admission.send(AbortRequest(child_request_ids(request_id, stream.n)))
        log.info("drain_finished", failed_requests=len(left))
        return len(left)

    async def shutdown(self) -> None:
        """Stop the stats logger (after a last ``engine_stats`` line) and the
        actors in data-flow order."""
        self._ready = False
        self._stopping = True
        if self._watch_task is not None:
            self._watch_task.cancel()
            self._watch_task = None
        if self._stats_task is not None:
            self._stats_task.cancel()
            try:
                await self._stats_task
            except asyncio.CancelledError:
                pass
            self._stats_task = None
            self.log_stats()
        for actor in self._actors:
            await actor.stop()
        if self.core.runner.kv_connector is not None:
            self.core.runner.kv_connector.close()

