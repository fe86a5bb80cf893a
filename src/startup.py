"""Start-up: load the checkpoint, profile, size the KV cache, warm up.

``build_engine_core`` is the heavy, synchronous half of starting an engine,
as a few named steps; ``kvserve.engine.AsyncEngine`` wires the actors
around what it returns.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import structlog

from kvserve.config import EngineConfig, ModelConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_events import KVEventLog
from kvserve.core.kv_layout import model_kv_layout
from kvserve.core.scheduler import Scheduler
from kvserve.kv_offload.kv_connector import (KVConnector, KVLayout, build_kv_connector,
                                              log_offload_tier)
from kvserve.constraints.masks import StructuredOutputs
from kvserve.core.plan import (KVCachePlan, cap_to_cache, count_parameters, plan_kv_cache,
                               resolve_max_model_len)
from kvserve.model.backend import Backend, create_backend
from kvserve.model.drafter import DraftProposer, load_draft_model
from kvserve.model.llama import LlamaModel
from kvserve.model.loader import load_checkpoint_weights, load_model_config
from kvserve.model.ops import DecodePath
from kvserve.model.runner import ModelRunner, profile_forward
from kvserve.model.tokenizer import Tokenizer
from kvserve.observability.log import LoadProgress

log = structlog.get_logger("kvserve.engine")

#: Bytes per element of the CPU backend's weights, activations and KV cache (float32).
CPU_DTYPE_BYTES = 4


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
    #: A KV block outside the cache: shape, dtype, model fingerprint (for
    #: the KV connector and the offload tier).
    kv_layout: KVLayout
    #: The path the model's decode steps take (``LlamaModel.decode_path``;
    #: the first stage's in pipeline stages), logged as ``decode_path``.
    decode_path: DecodePath


def build_engine_core(config: EngineConfig, kv_events: KVEventLog | None = None) -> EngineCore:
    """Load the checkpoint, size the KV cache and build runner and scheduler.

    Call it on the thread that will run the steps (the worker's): the
    backend's buffers and streams belong to it. The weights keep the
    checkpoint's dtype until the backend converts them to its own.
    ``max_model_len`` is the checkpoint's context length, capped by
    ``SchedulerConfig.max_model_len`` and by the KV cache size (a request must
    fit alone), with a warning when the cache caps it. ``kv_events``
    records the block pool's events (a data-parallel replica's, for the
    prefix-aware router), or None. Raises ``BackendUnavailable`` when the
    backend cannot run here.

    The steps, in order: ``_load_checkpoint`` (config and tokenizer), the
    backend (``create_backend``), ``_load_model`` (weights, model, draft),
    ``_size_kv_cache`` (profile and plan), ``_build_runner`` (structured
    outputs, KV connector), ``_warm_up`` (kernels, CUDA graphs),
    ``_build_scheduler``, ``_log_ready`` (the start-up lines). Each step
    but the last two logs ``startup_step`` with its seconds when it ends,
    and ``startup_progress`` while it runs, whenever it has been silent for
    ``PROGRESS_INTERVAL`` seconds (``LoadProgress``).
    """
    if config.parallel.enabled:
        return _build_pipelined_core(config, kv_events)
    t0 = time.monotonic()
    with LoadProgress(log) as progress:
        with progress.step("checkpoint", "reading the config and tokenizer"):
            path, model_config, tokenizer = _load_checkpoint(config)
        with progress.step("backend", f"starting the {config.backend} backend"):
            backend = create_backend(config)
        with progress.step("weights", "loading the weights"):
            loaded = _load_model(config, path, model_config, tokenizer, backend)
        with progress.step("kv_cache", "profiling a step and sizing the KV cache"):
            plan = _size_kv_cache(config, model_config, backend, loaded)
        with progress.step("runner", "building the model runner"):
            runner, layout = _build_runner(config, path, model_config, backend, loaded, plan)
        with progress.step("warm_up", "warming up (compiling the kernels)"):
            _warm_up(config, backend, loaded.model, runner, plan.max_model_len)
    scheduler = _build_scheduler(config, plan, layout, runner.kv_connector, kv_events)
    _log_decode_path(loaded.model.decode_path)
    _log_ready(config, path, backend, plan, loaded.weights_bytes, time.monotonic() - t0)
    return EngineCore(config, model_config, tokenizer, backend, runner, scheduler, plan,
                      plan.max_model_len, layout, loaded.model.decode_path)


def check_parallel(config: EngineConfig, model: ModelConfig) -> None:
    """Refuse, with ``--pipeline-parallel-size`` / ``--tensor-parallel-size``,
    what does not run in stage processes yet: the CUDA backend (no NCCL
    path yet), GGUF block weights with tensor parallelism, sliding-window
    layers, speculative decoding and the KV offload tier. Raises
    ``ValueError`` (one line); checks the layer partition
    (``pp_layer_ranges``) and the head split (``tp_head_shards``)."""
    from kvserve.core.parallel import pp_layer_ranges, tp_head_shards
    from kvserve.model.quantization import BLOCK_SCHEMES

    parallel = config.parallel
    if not parallel.enabled:
        return
    pp_layer_ranges(model.num_hidden_layers, parallel.pipeline_parallel_size,
                    parallel.pp_layer_partition)
    tp_head_shards(model.num_attention_heads, model.num_key_value_heads,
                   parallel.tensor_parallel_size)
    flag = "--pipeline-parallel-size/--tensor-parallel-size"
    if parallel.tensor_parallel_size > 1 and config.quantization in BLOCK_SCHEMES:
        raise ValueError(f"--quantization {config.quantization} (GGUF blocks) does not split "
                         "over --tensor-parallel-size yet: use none, int8 or w8a8")
    if config.backend == "cuda":
        raise ValueError(f"{flag} runs on the CPU backend only so far")
    if model_kv_layout(model).is_hybrid:
        raise ValueError(f"{model.name} has sliding-window layers: {flag} does not take such a "
                         "model yet")
    if config.scheduler.speculative is not None:
        raise ValueError(f"--speculative-config does not run with {flag} yet")
    if config.cache.kv_offloading_size or config.cache.kv_offloading_shm_path:
        raise ValueError(f"--kv-offloading-size does not run with {flag} yet")


def _build_pipelined_core(config: EngineConfig, kv_events: KVEventLog | None) -> EngineCore:
    """``build_engine_core`` with the layers in pipeline stages
    (``kvserve.distributed.pipeline``): the engine's process reads the
    config and tokenizer, plans the KV cache for the stage with the most
    layers (``--kv-cache-memory`` is per stage process, as vLLM's
    ``VLLM_CPU_KVCACHE_SPACE`` is per worker), starts the stages on Ray and
    keeps the scheduler and the sampler."""
    from kvserve.core.parallel import pp_layer_ranges, tp_head_shards
    from kvserve.distributed.pipeline import PipelineExecutor, PipelineRunner

    t0 = time.monotonic()
    path, model_config, tokenizer = _load_checkpoint(config)
    check_parallel(config, model_config)
    parallel = config.parallel
    ranges = pp_layer_ranges(model_config.num_hidden_layers, parallel.pipeline_parallel_size,
                             parallel.pp_layer_partition)
    shards = tp_head_shards(model_config.num_attention_heads, model_config.num_key_value_heads,
                            parallel.tensor_parallel_size)
    # the worker that holds the most K/V per token sets the blocks (the same on every worker)
    widest = replace(model_config, num_hidden_layers=max(len(r) for r in ranges),
                     num_key_value_heads=max(len(s.kv_heads) for s in shards), layer_types=())
    requested = resolve_max_model_len(model_config, config.scheduler.max_model_len)
    plan = cap_to_cache(plan_kv_cache(widest, config.cache, requested, CPU_DTYPE_BYTES, None,
                                      config.scheduler.max_num_batched_tokens))
    executor = PipelineExecutor(config, model_config, plan.num_blocks, plan.block_size)
    _log_stages(executor, plan)
    runner = PipelineRunner(
        model_config, executor, plan.block_size, logprobs_mode=config.logprobs_mode,
        seed=config.seed, structured=StructuredOutputs(path / "tokenizer.json",
                                                       model_config.vocab_size,
                                                       model_config.eos_token_ids))
    layout = KVLayout((model_config.num_hidden_layers, 2, plan.block_size,
                       model_config.num_key_value_heads, model_config.head_dim), "<f4",
                      model_fingerprint(path, config, _HostBackend))
    config = replace(config, scheduler=replace(
        config.scheduler, pipeline_parallel_size=parallel.pipeline_parallel_size))
    scheduler = _build_scheduler(config, plan, layout, None, kv_events)
    weights_bytes = sum(info.weights_bytes for info in executor.infos)
    decode_path = executor.infos[0].decode_path
    _log_decode_path(decode_path)
    _log_ready(config, path, _HostBackend, plan, weights_bytes, time.monotonic() - t0)
    return EngineCore(config, model_config, tokenizer, _HostBackend, runner, scheduler, plan,
                      plan.max_model_len, layout, decode_path)


def _log_decode_path(decode_path: DecodePath) -> None:
    """The start-up line of the path the model's decode steps take, and why."""
    log.info("decode_path", path=decode_path.path, reason=decode_path.reason,
             message=f"Decode steps: {decode_path.path} ({decode_path.reason})")


class _HostBackend:
    """What the engine reads of a backend when the model runs in pipeline
    stages: its name and dtype (the stages' CPU backend, float32) and the
    host array ops the sampler uses."""

    name = "cpu"
    dtype = np.dtype(np.float32)
    ops = None


def _log_stages(executor, plan: KVCachePlan) -> None:
    """One ``pipeline_stage`` line per worker (stage, TP rank, layers,
    heads, process, weights, KV bytes) and ``pipeline_config`` (stages,
    TP size, threads, micro-batches, KV in all)."""
    for info in executor.infos:
        tp = f" TP rank {info.tp_rank}," if executor.tp > 1 else ""
        log.info("pipeline_stage", stage=info.index, tp_rank=info.tp_rank,
                 layers=[info.layers.start, info.layers.stop], q_heads=info.q_heads,
                 kv_heads=info.kv_heads, pid=info.pid, weights_bytes=info.weights_bytes,
                 kv_bytes=info.kv_bytes, seconds=round(info.seconds, 2),
                 message=f"Pipeline stage {info.index},{tp} layers {info.layers.start}-"
                         f"{info.layers.stop - 1} ({len(info.layers)}), {info.q_heads} query / "
                         f"{info.kv_heads} KV heads, process {info.pid}: "
                         f"{info.weights_bytes / 2**20:,.1f} MiB of weights, "
                         f"{info.kv_bytes / 2**20:,.1f} MiB of KV cache "
                         f"({plan.num_tokens:,} tokens)")
    total_kv = sum(info.kv_bytes for info in executor.infos)
    log.info("pipeline_config", pipeline_parallel_size=executor.num_stages,
             tensor_parallel_size=executor.tp, num_threads=executor.num_threads,
             kv_bytes=total_kv, seconds=round(executor.seconds, 2),
             message=f"Model parallelism on Ray: {executor.num_stages} pipeline stage(s) x "
                     f"{executor.tp} tensor-parallel worker(s), {executor.num_threads} CPU "
                     f"thread(s) each, {total_kv / 2**20:,.1f} MiB of KV cache in all; "
                     f"{min(2, executor.num_stages)} micro-batch(es) in flight (the workers "
                     f"started in {executor.seconds:.1f} s)")


def _check_sliding_layers(config: EngineConfig, model: ModelConfig) -> None:
    """Refuse, for a model with sliding-window layers, what does not run
    with several KV-cache groups yet: the offload tier (its blocks hold every
    layer) and speculative decoding (rejected drafts move a request back
    behind blocks its window already freed). Raises ``ValueError``."""
    if not model_kv_layout(model).is_hybrid:
        return
    name = f"{model.name} has sliding-window layers"
    if config.cache.kv_offloading_size or config.cache.kv_offloading_shm_path:
        raise ValueError(f"{name}: --kv-offloading-size does not take such a model yet")
    if config.scheduler.speculative is not None:
        raise ValueError(f"{name}: --speculative-config does not take such a model yet")


def check_before_load(config: EngineConfig, max_model_len: int | None = None) -> None:
    """Judge, before any weight loads, what ``kvserve plan`` judges from
    ``config.json`` and the safetensors headers alone, so that a mistake
    costs seconds, not a load.

    ``max_model_len``: the context length the user asked for (None: the
    model's). Checks that the checkpoint's ``config.json`` describes a model
    kvserve runs and its safetensors headers are readable; that
    ``max_model_len`` is at most the model's ``max_position_embeddings``
    (vLLM refuses a longer one too); and on the CPU backend, whose KV memory
    is ``--kv-cache-memory``, that it holds a KV block and, when
    ``max_model_len`` is given, one request of that length (a draft model's
    K/V included). On CUDA the KV memory is known only after the weights
    load and a step is profiled (``_size_kv_cache``).

    Raises:
        ValueError: a setting the checkpoint or the memory cannot serve, as
            one line with the numbers.
        FileNotFoundError: no ``config.json`` or ``*.safetensors`` file.
    """
    path = Path(config.model)
    model = load_model_config(path)
    count_parameters(path, model)  # every safetensors header parses
    context = model.max_position_embeddings
    if max_model_len is not None and max_model_len > context:
        raise ValueError(f"--max-model-len {max_model_len} is larger than the model's context "
                         f"length, {context} tokens (max_position_embeddings in "
                         f"{path / 'config.json'}); give at most {context}")
    _check_sliding_layers(config, model)
    if config.backend != "cpu":
        return
    spec = config.scheduler.speculative
    draft = (load_model_config(Path(spec.model))
             if spec is not None and spec.uses_draft_model else None)
    requested = max_model_len or context
    plan = plan_kv_cache(model, config.cache, requested, CPU_DTYPE_BYTES, draft,
                         config.scheduler.max_num_batched_tokens)
    if max_model_len is not None and plan.num_tokens < max_model_len:
        raise ValueError(
            f"--max-model-len {max_model_len} needs {max_model_len * plan.bytes_per_token:,} "
            f"bytes of KV cache for one request ({plan.bytes_per_token:,} bytes per token), more "
            f"than --kv-cache-memory {config.cache.kv_cache_memory:,} bytes holds "
            f"({plan.num_tokens:,} tokens); give --max-model-len {plan.num_tokens} or less, or "
            f"--kv-cache-memory {_mib_up(max_model_len * plan.bytes_per_token)} or more")


def _mib_up(nbytes: int) -> str:
    """``nbytes`` as whole MiB, rounded up, e.g. ``'352MiB'``."""
    return f"{-(-nbytes // 2**20)}MiB"


class _LoadedModel(NamedTuple):
    """What ``_load_model`` built: the model, its draft model (or None) and
    the bytes both take on the backend."""

    model: LlamaModel
    draft: LlamaModel | None
    weights_bytes: int


#: Chat templates kvserve ships (``docs/chat_templates``), for models whose files have none.
SHIPPED_TEMPLATES = Path(__file__).resolve().parents[1] / "docs" / "chat_templates"


def _load_checkpoint(config: EngineConfig) -> tuple[Path, ModelConfig, Tokenizer]:
    """The checkpoint folder, its ``ModelConfig`` and tokenizer (with the
    ``--chat-template`` text, when given, checked: ``Tokenizer.
    check_chat_template``); logs ``engine_loading`` first. Raises what the
    loader raises (a missing or unreadable checkpoint) and ValueError for a
    chat template that loops, recurses or overflows on a one-message chat."""
    path = Path(config.model)
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.gguf"))
    what = "GGUF" if files and files[0].suffix == ".gguf" else "safetensors"
    from kvserve.model.gguf_model import served_name

    log.info("engine_loading", model=str(path), message=f"Loading {served_name(path)} "
             f"({sum(p.stat().st_size for p in files) / 2**20:,.1f} MiB of {what}) on the "
             f"{config.backend} backend...")
    # ``EngineConfig.chat_template`` (``--chat-template``) replaces the checkpoint's.
    model_config = load_model_config(path)
    tokenizer = Tokenizer(path, config.chat_template)
    tokenizer.check_chat_template()  # before serving, off the event loop
    if not tokenizer.chat_template and model_config.model_type in ("gemma3", "gemma3_text"):
        # a base Gemma 3 GGUF ships none; kvserve ships Google's
        tokenizer.chat_template_hint = str(SHIPPED_TEMPLATES / "gemma3.jinja")
    return path, model_config, tokenizer


def _load_model(config: EngineConfig, path: Path, model_config: ModelConfig,
                tokenizer: Tokenizer, backend: Backend) -> _LoadedModel:
    """The weights on the backend (``--quantization`` applied; GGUF blocks
    for ``q4`` / ``w4a8``, and for a folder served from its GGUF), the model over them and the speculative draft model when
    one is configured; logs ``quantization`` for a quantized model."""
    weights = load_checkpoint_weights(path, model_config, config.quantization)
    float_bytes = count_parameters(path, model_config) * backend.dtype.itemsize
    model = LlamaModel(model_config, weights, backend.ops, config.quantization)
    del weights
    spec = config.scheduler.speculative
    draft = (load_draft_model(spec, model_config, tokenizer, backend.ops)
             if spec is not None and spec.uses_draft_model else None)
    weights_bytes = model.weights_nbytes + (draft.weights_nbytes if draft is not None else 0)
    if config.quantization != "none":
        _log_quantization(config.quantization, model_config, float_bytes, weights_bytes,
                          backend.dtype.itemsize, config.cache.kv_cache_dtype)
    return _LoadedModel(model, draft, weights_bytes)


def _size_kv_cache(config: EngineConfig, model_config: ModelConfig, backend: Backend,
                   loaded: _LoadedModel) -> KVCachePlan:
    """The KV cache's plan: the bytes the backend allows after the weights
    and a profiling forward pass at the largest step, in blocks, with
    ``max_model_len`` capped to what the cache holds (warning
    ``max_model_len_capped``). Raises ``ValueError`` when nothing is left."""
    requested = resolve_max_model_len(model_config, config.scheduler.max_model_len)
    kv_bytes = backend.kv_cache_bytes(model_config, loaded.weights_bytes, lambda: profile_forward(
        loaded.model, backend.ops, config.scheduler.max_num_batched_tokens,
        config.cache.block_size, config.cache.kv_cache_dtype))
    draft = loaded.draft.config if loaded.draft is not None else None
    plan = cap_to_cache(plan_kv_cache(model_config, replace(config.cache, kv_cache_memory=kv_bytes),
                                      requested, backend.dtype.itemsize, draft,
                                      config.scheduler.max_num_batched_tokens))
    if plan.max_model_len < requested:
        log.warning("max_model_len_capped", max_model_len=plan.max_model_len,
                    requested=requested,
                    reason="KV cache holds fewer tokens than the context length",
                    message=f"max_model_len lowered from {requested:,} to "
                            f"{plan.max_model_len:,} tokens: the KV cache holds no more")
    return plan


def _build_runner(config: EngineConfig, path: Path, model_config: ModelConfig,
                  backend: Backend, loaded: _LoadedModel,
                  plan: KVCachePlan) -> tuple[ModelRunner, KVLayout]:
    """The model runner over a KV cache of ``plan``'s blocks, with
    structured outputs (llguidance loads on the first constrained request),
    the draft proposer, and a KV connector when an offload tier is
    configured (``runner.kv_connector``, else None; its tier logged); and
    the layout of a KV block outside the cache."""
    structured = StructuredOutputs(path / "tokenizer.json", model_config.vocab_size,
                                   model_config.eos_token_ids)
    draft = loaded.draft
    runner = ModelRunner(model_config, loaded.model, backend.ops, plan.num_blocks,
                         plan.block_size, logprobs_mode=config.logprobs_mode, seed=config.seed,
                         structured=structured, kv_cache_dtype=config.cache.kv_cache_dtype,
                         drafter=None if draft is None else DraftProposer(
                             draft, backend.ops, plan.num_blocks, plan.block_size, config.seed,
                             max_catch_up=config.scheduler.max_num_batched_tokens,
                             kv_cache_dtype=config.cache.kv_cache_dtype))
    layout = KVLayout.of(runner.kv_caches, model_fingerprint(path, config, backend))
    runner.kv_connector = build_kv_connector(backend.ops, layout, config.cache)
    if runner.kv_connector is not None:
        log_offload_tier(runner.kv_connector)
    return runner, layout


def _warm_up(config: EngineConfig, backend: Backend, model: LlamaModel, runner: ModelRunner,
             max_model_len: int) -> None:
    """Compile every kernel once; on CUDA, capture the decode step's graphs
    (``runner.graphs``; None with ``--enforce-eager`` or where capture fails)."""
    backend.warmup()
    if backend.name == "cuda":
        from kvserve.cuda.backend import capture_graphs
        runner.graphs = capture_graphs(backend, model, runner.kv_caches,
                                       config.scheduler.max_num_seqs, max_model_len)


def _build_scheduler(config: EngineConfig, plan: KVCachePlan, layout: KVLayout,
                     connector: KVConnector | None,
                     kv_events: KVEventLog | None = None) -> Scheduler:
    """The scheduler over a block manager of ``plan``'s blocks, which looks
    blocks up in the offload tier when there is one, through a mapping of
    its own (the connector is the worker's), and records its block events
    in ``kv_events`` when given."""
    tier = connector.tier if connector is not None else None
    use_tier = tier is not None and config.cache.enable_prefix_caching
    external = connector.lookup_view() if use_tier else None  # memory tier (+ disk tier)
    windows = plan.layout.windows if plan.layout is not None else (None,)
    kv = KVCacheManager(plan.num_blocks, plan.block_size, config.cache.enable_prefix_caching,
                        events=kv_events, external=external, windows=windows)
    return Scheduler(replace(config.scheduler, max_model_len=plan.max_model_len), kv,
                     plan.block_size)


def _log_ready(config: EngineConfig, path: Path, backend: Backend, plan: KVCachePlan,
               weights_bytes: int, seconds: float) -> None:
    """The start-up lines: ``kv_cache_size``, ``max_concurrency``,
    ``speculative_config``, ``scheduler_config``, ``engine_loaded``."""
    groups = ""
    if plan.layout is not None:
        windows = plan.layout.windows
        sliding = [g for g in plan.layout.groups if g.window is not None]
        groups = (f" for one request ({len(windows)} block tables of "
                  f"{plan.layout.group_size} layers; the {sum(len(g.layers) for g in sliding)} "
                  f"sliding-window layers keep {sliding[0].window:,} tokens)")
    kv_dtype = config.cache.kv_cache_dtype
    stored = (f" ({kv_dtype} K/V, {plan.bytes_per_token:,} bytes per token)"
              if kv_dtype != "auto" else "")
    log.info("kv_cache_size", message=f"KV cache size: {plan.num_tokens:,} tokens{groups}{stored}",
             num_tokens=plan.num_tokens, num_blocks=plan.num_blocks,
             block_size=plan.block_size, kv_bytes_per_token=plan.bytes_per_token,
             kv_cache_dtype=kv_dtype)
    max_len = plan.max_model_len
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
    seconds = round(seconds, 3)
    log.info("engine_loaded", model=str(path), backend=backend.name,
             dtype=str(backend.dtype), weights_bytes=weights_bytes, seconds=seconds,
             message=f"Loaded in {seconds} s: {weights_bytes / 2**20:,.1f} MiB of weights, "
                     f"{plan.num_tokens:,} KV tokens")


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


def _log_quantization(scheme: str, model: ModelConfig, float_bytes: int, weights_bytes: int,
                      dtype_bytes: int, kv_cache_dtype: str = "auto") -> None:
    """``quantization``: weight bytes before and after, and the KV tokens the
    saved bytes would hold (at this model's KV bytes per token). A block
    scheme (``q4``, ``w4a8``) that saved nothing also logs
    ``quantization_no_blocks``: it serves a GGUF's own blocks and keeps float
    tensors float, so on a float checkpoint (an F16 GGUF) it quantized
    nothing, which the user should not have to infer from a 0."""
    from kvserve.model.quantization import BLOCK_SCHEMES

    saved = float_bytes - weights_bytes
    if scheme in BLOCK_SCHEMES and saved <= 0:
        log.warning("quantization_no_blocks", quantization=scheme,
                    message=f"-q {scheme} quantized nothing: it serves a GGUF's own Q4/Q8 blocks "
                            "and keeps float tensors float, and this checkpoint's weights are "
                            "float; -q int8 or w8a8 quantize float weights, or serve a "
                            "quantized GGUF")
    tokens = max(saved, 0) // model.kv_bytes_per_token(dtype_bytes, kv_cache_dtype)
    log.info("quantization", message=f"Quantization {scheme}: weights {float_bytes / 2**20:,.1f} "
             f"MiB -> {weights_bytes / 2**20:,.1f} MiB; the {saved / 2**20:,.1f} MiB saved hold "
             f"{tokens:,} more KV tokens", quantization=scheme, float_weights_bytes=float_bytes,
             weights_bytes=weights_bytes, kv_tokens_gained=tokens)


