"""Prometheus metrics: vLLM's names under the prefix ``kvserve:``.

The only module that imports ``prometheus_client``. Every engine owns one
``EngineMetrics`` with its own ``CollectorRegistry`` (so several engines in
one process, as in the tests, never collide); the HTTP server owns one
``ServerMetrics`` (HTTP requests, the process's CPU, memory and file
descriptors), on a registry of its own too; ``metrics_route`` serves both as
``GET /metrics`` in the Prometheus text format. Every engine series carries
the label ``model_name`` (the served model name), so a vLLM dashboard ports
by renaming the prefix ``vllm:`` to ``kvserve:``.

Definitions follow vLLM's documentation (docs "Production Metrics" and the
"Metrics" design doc); see ``kvserve.core.stats`` for the time stamps. The
"first token" and every later token are stamped when the scheduler actor
emits the ``TokenDelta`` that carries them, i.e. when the token leaves the
engine core (the detokenizer and HTTP add a little on top of that).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from kvserve.core.stats import STEP_PHASES, RequestTimeline, StepStats

# ``*_created`` series add nothing for these metrics (vLLM turns them off too).
prometheus_client.disable_created_metrics()

PREFIX = "kvserve:"

# vLLM's buckets, with finer ones at the bottom for a small model on a CPU.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                         0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5,
                           5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                           480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
#: Labels of ``cache_config_info`` (the settings vLLM's carries that kvserve has).
CACHE_CONFIG_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching",
                       "num_gpu_blocks", "gpu_memory_utilization", "kv_cache_memory_bytes")
STEP_PHASE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                      0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

#: Metric name (without prefix) -> Prometheus type; the issue's list.
METRICS: dict[str, str] = {
    "time_to_first_token_seconds": "histogram",
    "inter_token_latency_seconds": "histogram",
    "request_time_per_output_token_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram",
    "request_queue_time_seconds": "histogram",
    "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram",
    "request_inference_time_seconds": "histogram",
    "request_prompt_tokens": "histogram",
    "request_generation_tokens": "histogram",
    "iteration_tokens_total": "histogram",
    "num_requests_running": "gauge",
    "num_requests_waiting": "gauge",
    "kv_cache_usage_perc": "gauge",
    "prompt_tokens": "counter",
    "prompt_tokens_computed": "counter",
    "generation_tokens": "counter",
    "time_per_output_token_seconds": "histogram",
    "request_max_num_generation_tokens": "histogram",
    "request_params_n": "histogram",
    "request_params_max_tokens": "histogram",
    "cache_config_info": "gauge",
    "decode_path_info": "gauge",
    "request_success": "counter",
    "num_preemptions": "counter",
    "prefix_cache_queries": "counter",
    "prefix_cache_hits": "counter",
    "prefix_cache_divergences": "counter",
    "step_phase_seconds": "histogram",
    "engine_busy_seconds": "counter",
    "pipeline_stage_seconds": "histogram",
    "pipeline_stage_busy_seconds": "counter",
    "kv_offload_queries": "counter",
    "kv_offload_hits": "counter",
    "kv_transfer_blocks": "counter",
    "kv_transfer_bytes": "counter",
    "kv_transfer_seconds": "histogram",
    "spec_decode_num_drafts": "counter",
    "spec_decode_num_draft_tokens": "counter",
    "spec_decode_num_accepted_tokens": "counter",
    "spec_decode_num_accepted_tokens_per_pos": "counter",
}
#: Directions of ``kv_transfer_*``: cache -> offload tier, tier -> cache,
#: cache -> host for a decode replica (prefill side), Ray object store ->
#: decode replica, host -> cache (decode side); disk tier -> cache, blocks
#: written to the disk tier, and writes dropped (the writer's queue was full).
KV_TRANSFER_DIRECTIONS = ("offload", "onload", "export", "fetch", "import",
                          "disk_read", "disk_write", "disk_drop")
#: Tiers of ``kv_offload_queries`` / ``kv_offload_hits``: the shared-memory
#: tier, and the disk tier under it (queried for what memory missed).
KV_OFFLOAD_TIERS = ("memory", "disk")


def exposed_series(name: str) -> tuple[str, ...]:
    """The sample names Prometheus sees for metric ``name`` (without prefix)."""
    kind = METRICS[name]
    full = PREFIX + name
    if kind == "histogram":
        return (full + "_bucket", full + "_sum", full + "_count")
    if kind == "counter":
        return (full + "_total",)
    return (full,)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


class EngineMetrics:
    """All of one engine's metrics, on a registry of its own.

    ``observe_*`` methods are called from the scheduler actor (one event
    loop), so no locking beyond prometheus_client's own is needed.
    """

    def __init__(self, model_name: str, max_model_len: int = 8192,
                 max_num_batched_tokens: int = 2048,
                 registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.registry = registry if registry is not None else CollectorRegistry()
        # Declared family by family, in the order /metrics lists them.
        token_buckets = build_1_2_5_buckets(max(max_model_len, 1))
        self._latency_metrics()
        self._token_histograms(token_buckets, max_num_batched_tokens)
        self._load_metrics()
        self._prompt_token_metrics()
        self._request_param_metrics(token_buckets)
        self._info_metrics()
        self._scheduling_metrics(model_name)
        self._step_metrics(model_name)
        self._kv_transfer_metrics(model_name)
        self._spec_decode_metrics(model_name)
        self._pipeline_metrics(model_name)

    def _histogram(self, name: str, doc: str, buckets: Iterable[float]) -> Histogram:
        """A histogram with only the ``model_name`` label, set to this engine's."""
        return Histogram(PREFIX + name, doc, ["model_name"], registry=self.registry,
                         buckets=tuple(buckets)).labels(self.model_name)

    def _gauge(self, name: str, doc: str) -> Gauge:
        """A gauge with only the ``model_name`` label, set to this engine's."""
        return Gauge(PREFIX + name, doc, ["model_name"],
                     registry=self.registry).labels(self.model_name)

    def _latency_metrics(self) -> None:
        """Per-request latencies: TTFT, ITL, TPOT, end to end, and the time in
        each phase (queue, prefill, decode, inference)."""
        histogram = self._histogram
        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds: from the request's arrival at the "
            "API to the first generated token leaving the engine core.", TTFT_BUCKETS)
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds: time between two consecutive "
            "streamed token events of a request (one observation per event after the first).",
            TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Histogram of time per output token in seconds, excluding the first token: "
            "(e2e - ttft) / (output tokens - 1), per finished request with >= 2 tokens.",
            TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "Histogram of end-to-end request latency in seconds: arrival to finish.",
            REQUEST_LATENCY_BUCKETS)
        self.queue = histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in the WAITING phase in seconds: arrival to the first "
            "scheduling (tokenization and admission included).", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in the PREFILL phase in seconds: first scheduling to "
            "first token.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram(
            "request_decode_time_seconds",
            "Histogram of time spent in the DECODE phase in seconds: first token to finish.",
            REQUEST_LATENCY_BUCKETS)
        self.inference = histogram(
            "request_inference_time_seconds",
            "Histogram of time spent in the RUNNING phase in seconds: prefill + decode, "
            "first scheduling to finish.", REQUEST_LATENCY_BUCKETS)

    def _token_histograms(self, token_buckets: tuple[int, ...],
                          max_num_batched_tokens: int) -> None:
        """Prompt and generated tokens per finished request, tokens per step."""
        histogram = self._histogram
        self.prompt_tokens_hist = histogram(
            "request_prompt_tokens",
            "Histogram of the number of prompt tokens per finished request.", token_buckets)
        self.generation_tokens_hist = histogram(
            "request_generation_tokens",
            "Histogram of the number of generated tokens per finished request.", token_buckets)
        step_buckets = [b for b in (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                    16384) if b <= max(max_num_batched_tokens, 1)]
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Histogram of the number of tokens (prefill + decode) computed per engine step.",
            step_buckets)

    def _load_metrics(self) -> None:
        """The load gauges: running and waiting requests, KV usage, the stall."""
        gauge = self._gauge
        self.running = gauge("num_requests_running",
                             "Number of requests in the running batch (holding KV blocks).")
        self.waiting = gauge("num_requests_waiting",
                             "Number of requests waiting to be scheduled (new or preempted).")
        self.kv_usage = gauge("kv_cache_usage_perc",
                              "KV-cache usage: fraction of KV blocks in use, 0..1 (1 = 100%).")
        self.stall = gauge("engine_stall_seconds",
                           "Seconds the engine has had requests running or waiting without "
                           "finishing a step (0 while idle or progressing; /health answers "
                           "503 from --stall-timeout on). kvserve-specific.")

    def _prompt_token_metrics(self) -> None:
        """Prompt tokens processed (all of each prompt) and computed."""
        counter = self._counter
        self.prompt_tokens = counter(
            "prompt_tokens", "Number of prompt tokens of the requests that started "
            "generating (all of each prompt, prefix-cache hits included, as vLLM counts).")
        self.prompt_tokens_computed = counter(
            "prompt_tokens_computed", "Number of prefill tokens computed (prefix-cache hits "
            "are not; recomputation after preemption is). kvserve-specific.")

    def _request_param_metrics(self, token_buckets: tuple[int, ...]) -> None:
        """vLLM's older TPOT name, the most tokens a sample generated, and the
        ``n`` and ``max_tokens`` request parameters."""
        histogram = self._histogram
        self.tpot_legacy = histogram(
            "time_per_output_token_seconds",
            "Histogram of time per output token in seconds (vLLM's older name of "
            "inter_token_latency_seconds; the same observations).", TOKEN_LATENCY_BUCKETS)
        self.max_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Histogram of the most tokens any sample of a finished request generated.",
            token_buckets)
        self.params_n = histogram("request_params_n", "Histogram of the n request parameter.",
                                  (1, 2, 5, 10, 20))
        self.params_max_tokens = histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter "
            "(the context length when unset).", token_buckets)

    def _info_metrics(self) -> None:
        """The ``*_info`` gauges (value 1, the facts as labels): the KV cache's
        settings and the decode path."""
        self._cache_config = Gauge(PREFIX + "cache_config_info",
                                   "Information of the KV cache's configuration (value 1).",
                                   ["model_name", *CACHE_CONFIG_LABELS], registry=self.registry)
        self._decode_path = Gauge(PREFIX + "decode_path_info",
                                  "The path the model's decode steps take (value 1): fused "
                                  "(one compiled call a step) or ops (op by op).",
                                  ["model_name", "path"], registry=self.registry)

    def _scheduling_metrics(self, model_name: str) -> None:
        """Generated tokens, finished requests by reason, preemptions and the
        prefix cache's queries, hits and divergences."""
        counter = self._counter
        self.generation_tokens = counter("generation_tokens",
                                         "Number of generation tokens processed.")
        self._success = Counter(PREFIX + "request_success",
                                "Count of finished requests, by finished_reason "
                                "(stop, length, abort, error).",
                                ["model_name", "finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:
            self._success.labels(model_name, reason)
        self.preemptions = counter("num_preemptions",
                                   "Cumulative number of preemptions (by recompute).")
        self.prefix_queries = counter(
            "prefix_cache_queries",
            "Prefix-cache queries, in tokens (prompt tokens looked up at admission).")
        self.prefix_hits = counter(
            "prefix_cache_hits", "Prefix-cache hits, in tokens (prompt tokens found cached).")
        self.prefix_divergences = counter(
            "prefix_cache_divergences",
            "Prefix-cache misses caused by a prompt that differs from a cached one "
            "(see the prefix_cache_divergence log event).")

    def _step_metrics(self, model_name: str) -> None:
        """The seconds of each phase of an engine step, and the busy seconds."""
        self._phase = Histogram(
            PREFIX + "step_phase_seconds",
            "Histogram of the seconds of each phase of an engine step: schedule (the core "
            "scheduler), prepare (request states and batch), forward (the model), sample, "
            "emit (applying tokens and sending them to the detokenizer). kvserve-specific.",
            ["model_name", "phase"], registry=self.registry, buckets=STEP_PHASE_BUCKETS)
        self.phases = {phase: self._phase.labels(model_name, phase) for phase in STEP_PHASES}
        self.busy = self._counter(
            "engine_busy_seconds",
            "Seconds the worker spent computing steps; its rate is the busy fraction "
            "(rate(kvserve:engine_busy_seconds_total[1m]), 0..1). kvserve-specific.")

    def _pipeline_metrics(self, model_name: str) -> None:
        """Per pipeline stage (``--pipeline-parallel-size``): each step's
        forward seconds in the stage's process, and their sum, whose rate
        per stage is its busy fraction: the pipeline bubble is
        ``1 - sum over stages of rate(busy) / stages``. kvserve-specific."""
        self._stage = Histogram(
            PREFIX + "pipeline_stage_seconds",
            "Histogram of the seconds one step spent in each pipeline stage's process "
            "(--pipeline-parallel-size). kvserve-specific.",
            ["model_name", "stage"], registry=self.registry, buckets=STEP_PHASE_BUCKETS)
        self._stage_busy = Counter(
            PREFIX + "pipeline_stage_busy_seconds",
            "Seconds each pipeline stage spent computing steps; 1 - the mean of their rates "
            "is the pipeline bubble. kvserve-specific.",
            ["model_name", "stage"], registry=self.registry)
        self._model_name = model_name
        # exposed from the start (a one-process engine's stay at 0)
        self._stage.labels(model_name, "0")
        self._stage_busy.labels(model_name, "0")

    def _counter(self, name: str, doc: str) -> Counter:
        """A counter with only the ``model_name`` label, set to this engine's."""
        return Counter(PREFIX + name, doc, ["model_name"],
                       registry=self.registry).labels(self.model_name)

    def _spec_decode_metrics(self, model_name: str) -> None:
        counter = self._counter
        self.spec_drafts = counter("spec_decode_num_drafts",
                                   "Number of spec decoding drafts (one per speculative step "
                                   "of a request).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens",
                                         "Number of draft tokens proposed.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                            "Number of draft tokens accepted.")
        self._spec_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the draft (0 = the first).",
            ["model_name", "position"], registry=self.registry)
        self._spec_per_pos.labels(model_name, "0")

    def _kv_transfer_metrics(self, model_name: str) -> None:
        queries = Counter(
            PREFIX + "kv_offload_queries", "KV offload tier queries, in tokens, by tier: full "
            "prompt blocks the local prefix cache missed at admission (memory), and those the "
            "memory tier missed too (disk). kvserve-specific.", ["model_name", "tier"],
            registry=self.registry)
        hits = Counter(
            PREFIX + "kv_offload_hits", "KV offload tier hits, in tokens, by tier: prompt tokens "
            "loaded from the tier instead of computed. kvserve-specific.",
            ["model_name", "tier"], registry=self.registry)
        self.offload_tiers = {tier: (queries.labels(model_name, tier),
                                     hits.labels(model_name, tier)) for tier in KV_OFFLOAD_TIERS}
        self.offload_queries, self.offload_hits = self.offload_tiers["memory"]
        labels = ["model_name", "direction"]
        blocks = Counter(PREFIX + "kv_transfer_blocks", "KV blocks moved, by direction "
                         "(offload, onload, export, fetch, import; disk_read, disk_write, "
                         "disk_drop). kvserve-specific.",
                         labels, registry=self.registry)
        nbytes = Counter(PREFIX + "kv_transfer_bytes", "Bytes of KV blocks moved, by "
                         "direction. kvserve-specific.", labels, registry=self.registry)
        seconds = Histogram(PREFIX + "kv_transfer_seconds", "Histogram of the seconds of each "
                            "step's KV copies (and of each Ray fetch), by direction. "
                            "kvserve-specific.", labels, registry=self.registry,
                            buckets=STEP_PHASE_BUCKETS)
        self.kv_transfer = {d: (blocks.labels(model_name, d), nbytes.labels(model_name, d),
                                seconds.labels(model_name, d)) for d in KV_TRANSFER_DIRECTIONS}

    # ------------------------------------------------------------ observers

    def observe_first_token(self, timeline: RequestTimeline) -> None:
        if timeline.ttft is not None:
            self.ttft.observe(timeline.ttft)

    def observe_tokens(self, num_tokens: int, itl: float | None) -> None:
        self.generation_tokens.inc(num_tokens)
        if itl is not None:
            self.itl.observe(itl)
            self.tpot_legacy.observe(itl)

    def observe_params(self, n: int, max_tokens: int) -> None:
        """A request's ``n`` and ``max_tokens``, once per client request."""
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)

    def observe_max_generated(self, num_tokens: int) -> None:
        """A client request finished: the most tokens one of its samples generated."""
        self.max_generation_tokens.observe(num_tokens)

    def observe_prompt(self, prompt_tokens: int) -> None:
        """A request started generating: its whole prompt is processed."""
        self.prompt_tokens.inc(prompt_tokens)

    def set_cache_config(self, **labels: Any) -> None:
        """``cache_config_info`` = 1 with the KV cache's settings as labels
        (``CACHE_CONFIG_LABELS``; vLLM's ``cache_config_info``)."""
        values = [str(labels.get(name, "")) for name in CACHE_CONFIG_LABELS]
        self._cache_config.labels(self.model_name, *values).set(1)

    def set_decode_path(self, path: str) -> None:
        """``decode_path_info`` = 1 with the path (``DecodePath.path``) as a label."""
        self._decode_path.labels(self.model_name, path).set(1)

    def observe_finished(self, timeline: RequestTimeline) -> None:
        reason = timeline.finish_reason or "abort"
        self._success.labels(self.model_name, reason).inc()
        for hist, value in ((self.e2e, timeline.e2e), (self.queue, timeline.queue_time),
                            (self.prefill, timeline.prefill_time),
                            (self.decode, timeline.decode_time),
                            (self.inference, timeline.inference_time),
                            (self.tpot, timeline.tpot)):
            if value is not None:
                hist.observe(value)
        self.prompt_tokens_hist.observe(timeline.prompt_tokens)
        self.generation_tokens_hist.observe(timeline.num_output_tokens)

    def observe_scheduling(self, preemptions: int, queries: int, hits: int,
                           divergences: int) -> None:
        if preemptions:
            self.preemptions.inc(preemptions)
        if queries:
            self.prefix_queries.inc(queries)
        if hits:
            self.prefix_hits.inc(hits)
        if divergences:
            self.prefix_divergences.inc(divergences)

    def observe_offload(self, queries: int, hits: int, tier: str = "memory") -> None:
        """Tokens looked up in / loaded from an offload tier (``KV_OFFLOAD_TIERS``)."""
        tier_queries, tier_hits = self.offload_tiers[tier]
        if queries:
            tier_queries.inc(queries)
        if hits:
            tier_hits.inc(hits)

    def observe_spec_decode(self, stats) -> None:
        """A step's speculative decoding counts (``core.spec_decode.SpecDecodingStats``)."""
        if not stats.num_drafts:
            return
        self.spec_drafts.inc(stats.num_drafts)
        self.spec_draft_tokens.inc(stats.num_draft_tokens)
        self.spec_accepted_tokens.inc(stats.num_accepted_tokens)
        for position, count in enumerate(stats.accepted_per_pos):
            self._spec_per_pos.labels(self.model_name, str(position)).inc(count)

    def observe_kv_transfer(self, direction: str, blocks: int, nbytes: int,
                            seconds: float) -> None:
        """One batch of KV blocks moved (``direction`` in ``KV_TRANSFER_DIRECTIONS``)."""
        block_counter, byte_counter, histogram = self.kv_transfer[direction]
        block_counter.inc(blocks)
        byte_counter.inc(nbytes)
        histogram.observe(seconds)

    def observe_step(self, step: StepStats) -> None:
        self.iteration_tokens.observe(step.num_tokens)
        self.busy.inc(step.seconds)
        for phase, seconds in step.times.as_dict().items():
            if seconds or phase != "draft":  # draft: only steps that ran a draft model
                self.phases[phase].observe(seconds)
        if step.num_prefill_tokens:
            self.prompt_tokens_computed.inc(step.num_prefill_tokens)
        for stage, seconds in enumerate(step.times.stages):
            self._stage.labels(self._model_name, str(stage)).observe(seconds)
            self._stage_busy.labels(self._model_name, str(stage)).inc(seconds)

    def set_load(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)

    def set_stall(self, seconds: float) -> None:
        """``engine_stall_seconds`` (``kvserve.core.stall``)."""
        self.stall.set(seconds)

    # ------------------------------------------------------------ exposition

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)


#: ``http_request_duration_seconds`` buckets: prometheus-fastapi-instrumentator's
#: "highr" set (its labelled histogram has only 0.1, 0.5 and 1, too coarse
#: for generation requests of seconds).
HTTP_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5,
                        3.0, 3.5, 4.0, 4.5, 5.0, 7.5, 10.0, 30.0, 60.0)


class ServerMetrics:
    """The HTTP server process's metrics, on a registry of its own.

    - ``http_requests_total{handler,method,status}`` and
      ``http_request_duration_seconds{handler,method}``: the names, labels
      and status groups (``2xx``, ``4xx``, ...) of
      prometheus-fastapi-instrumentator's defaults, which vLLM's server
      exposes; ``observe_http`` is fed by ``kvserve.api.http_metrics``.
    - ``kvserve:http_error_responses_total{status}``: responses of status
      >= 400 by exact code (429 apart from 400 and 499), which the grouped
      ``status`` hides. kvserve-specific.
    - prometheus_client's process, platform and GC collectors
      (``process_resident_memory_bytes``, ``process_cpu_seconds_total``,
      ``process_open_fds``, ``python_info``, ``python_gc_*``), as on
      prometheus_client's default registry that vLLM serves. Once per
      server: with data parallelism they describe the API process (the
      replicas' registries carry engine metrics only).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        prometheus_client.ProcessCollector(registry=self.registry)
        prometheus_client.PlatformCollector(registry=self.registry)
        prometheus_client.GCCollector(registry=self.registry)
        self._requests = Counter(
            "http_requests", "Total number of requests by method, status and handler.",
            ["handler", "method", "status"], registry=self.registry)
        self._duration = Histogram(
            "http_request_duration_seconds", "Histogram of HTTP request latency in seconds: "
            "from the request's arrival to its response's last byte, by handler and method.",
            ["handler", "method"], registry=self.registry, buckets=HTTP_LATENCY_BUCKETS)
        self._errors = Counter(
            PREFIX + "http_error_responses", "HTTP responses with status >= 400, by exact "
            "status code. kvserve-specific.", ["status"], registry=self.registry)

    def observe_http(self, handler: str, method: str, status: int, seconds: float) -> None:
        """One HTTP request answered ``status`` after ``seconds``; ``handler``
        and ``method`` must come from a bounded set (a route's path template,
        a known method), never straight from the client."""
        self._requests.labels(handler, method, f"{status // 100}xx").inc()
        self._duration.labels(handler, method).observe(seconds)
        if status >= 400:
            self._errors.labels(str(status)).inc()

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)


#: ``--metric-names`` values: kvserve's prefix, vLLM's, or both.
METRIC_NAMES = ("kvserve", "vllm", "both")
#: vLLM's names that have another kvserve name: the dashboard vLLM publishes
#: (``examples/online_serving/prometheus_grafana/grafana.json``) reads KV
#: usage as ``vllm:gpu_cache_usage_perc``, the name before
#: ``kv_cache_usage_perc``.
VLLM_ALIASES = {"kv_cache_usage_perc": "gpu_cache_usage_perc"}


def with_metric_names(text: bytes, names: str) -> bytes:
    """The Prometheus text ``text`` (``kvserve:`` names) under ``names``
    (``METRIC_NAMES``): as it is; every ``kvserve:`` series renamed
    ``vllm:`` (with ``VLLM_ALIASES`` added), so that vLLM's own Grafana
    dashboard and alerts read a kvserve server unchanged; or both."""
    if names == "kvserve":
        return text
    vllm = text.replace(b"kvserve:", b"vllm:")
    lines = vllm.split(b"\n")
    for ours, theirs in VLLM_ALIASES.items():
        old, new = f"vllm:{ours}".encode(), f"vllm:{theirs}".encode()
        lines += [line.replace(old, new) for line in lines if old in line]
    vllm = b"\n".join(line for line in lines if line) + b"\n"
    return vllm if names == "vllm" else text + vllm


def metrics_route(server: ServerMetrics,
                  engine: EngineMetrics | Callable[[], Awaitable[str]], names: str = "kvserve"):
    """A Starlette ``Route`` for ``GET /metrics``: the engine's metrics
    (``EngineMetrics``, or a coroutine function giving the data-parallel
    replicas' text), then ``server``'s, under ``names`` (``--metric-names``:
    :func:`with_metric_names`)."""
    from starlette.responses import Response
    from starlette.routing import Route

    async def endpoint(request) -> Response:
        text = engine.render() if isinstance(engine, EngineMetrics) else (await engine()).encode()
        return Response(with_metric_names(text + server.render(), names),
                        media_type=CONTENT_TYPE_LATEST)

    return Route("/metrics", endpoint, methods=["GET"])


def parse_metrics_text(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Parse Prometheus text into ``{sample name: [(labels, value), ...]}``."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples
