"""Command line: ``kvserve serve``, ``kvserve generate``, ``kvserve plan``,
``kvserve fetch-model``, ``kvserve analyze LOGFILE``, ``kvserve diagnose --url URL``.

The only module that turns flags into config objects (``kvserve.config``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import re
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

from kvserve.config import (DEFAULT_MAX_NUM_BATCHED_TOKENS, CacheConfig, EngineConfig,
                            SchedulerConfig, ServerConfig, SpeculativeConfig,
                            StructuredOutputsConfig, parse_size)
from kvserve.thread_env import apply_thread_pool_env


def _positive(kind: type, allow_zero: bool = False) -> Callable[[str], int | float]:
    """An argparse type: a number > 0 (>= 0 with ``allow_zero``; never NaN) of
    ``kind`` (a clear usage error otherwise)."""
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if value < 0 or (value == 0 and not allow_zero) or value != value:
            raise argparse.ArgumentTypeError(f"must be {'>=' if allow_zero else '>'} 0, "
                                             f"got {text}")
        return value
    parse.__name__ = f"{'non-negative' if allow_zero else 'positive'} {kind.__name__}"
    return parse


POSITIVE_INT, POSITIVE_FLOAT = _positive(int), _positive(float)
NON_NEGATIVE_FLOAT = _positive(float, allow_zero=True)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="local Hugging Face-layout checkpoint folder (config.json, "
                        "*.safetensors, tokenizer.json) of a llama, mistral or qwen2 model; not "
                        "a GGUF file nor a hub id (default: SmolLM2-135M-Instruct, fetched and "
                        "converted from its GGUF on first use)")
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda when the start-up probe (a Numba kernel, a cuBLAS "
                        "product, a copy back) passes on a GPU, else cpu with a warning")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16"],
                   help="weights, activations and KV cache: auto = float32 on the CPU, "
                        "float16 on a GPU")
    p.add_argument("--quantization", "-q", default="none",
                   choices=["none", "int8", "w8a8", "q4", "w4a8"],
                   help="int8: int8 weights with per-channel scales, float activations; "
                        "w8a8: also int8 activations per token (for both, embeddings, norms "
                        "and the LM head stay float); q4: serve the model's GGUF blocks "
                        "(Q4_0/Q4_1/Q8_0, LM head included) as shipped; w4a8: q4 with "
                        "activations quantized to int8 blocks in CPU decode steps "
                        "(llama.cpp's scheme, fastest on a CPU)")
    p.add_argument("--kv-cache-memory", default="1GiB",
                   help="bytes for KV blocks on the CPU backend, e.g. 512MiB, 1GiB")
    p.add_argument("--gpu-memory-utilization", type=POSITIVE_FLOAT, default=0.9,
                   help="cuda: fraction of the GPU's memory for weights, activations and the "
                        "KV cache, which gets what the other two leave (default 0.9)")
    p.add_argument("--block-size", type=POSITIVE_INT, default=16, help="tokens per KV block")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", help="turn automatic prefix caching off")
    p.add_argument("--kv-offloading-size", type=NON_NEGATIVE_FLOAT, default=0.0, metavar="GIB",
                   help="GiB of host shared memory for a KV offload tier: evicted prefix "
                        "blocks go there and are loaded back instead of recomputed; shared "
                        "by the data-parallel replicas of a node (default 0: none)")
    p.add_argument("--max-num-batched-tokens", type=POSITIVE_INT, default=None,
                   help="token budget of one step (prefill chunks + decodes); default 128 on "
                        "the CPU backend (keeps decodes flowing while long prompts prefill), "
                        "2048 on CUDA")
    p.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="while others wait, one prompt's prefill takes at most this many "
                        "tokens of a step (default: half the step budget; 0: no cap)")
    p.add_argument("--max-num-seqs", type=POSITIVE_INT, default=64, help="most sequences in one step")
    p.add_argument("--max-step-ms", type=POSITIVE_FLOAT, default=None,
                   help="target milliseconds per step: each step's token budget is sized from "
                        "the measured cost per token so that long prompts are prefilled in "
                        "chunks that keep inter-token latency near it (default: off)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule step N+1 while step N computes (two steps in flight); a "
                        "request that stops may compute one token more, which is dropped "
                        "(default: on)")
    p.add_argument("--speculative-config", type=_speculative_config, default=None,
                   metavar="JSON",
                   help='speculative decoding in vLLM\'s shape: {"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                        '"prompt_lookup_min": 2} (prompt lookup) or {"method": '
                        '"draft_model", "model": PATH, "num_speculative_tokens": 4, '
                        '"quantization": "int8"} (a smaller model of the same tokenizer; '
                        'default: off)')
    p.add_argument("--max-model-len", type=POSITIVE_INT, default=None,
                   help="longest prompt + output in tokens (default: the model's)")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs, or priority from X-Priority / body 'priority' (lower first)")
    p.add_argument("--priority-aging-seconds", type=POSITIVE_FLOAT, default=None,
                   help="under priority: a waiting request gains one level per S seconds")
    p.add_argument("--max-waiting-requests", type=POSITIVE_INT, default=None,
                   help="waiting-queue bound; beyond it requests get 429 with Retry-After")
    p.add_argument("--max-waiting-tokens", type=POSITIVE_INT, default=None,
                   help="bound on waiting prompt tokens; beyond it requests get 429")
    p.add_argument("--logprobs-mode", default="processed_logprobs",
                   choices=["processed_logprobs", "raw_logprobs", "raw_logits"])
    p.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling")
    p.add_argument("--num-threads", type=POSITIVE_INT, default=None,
                   help="CPU threads for both BLAS and Numba kernels (default: the CPUs this "
                        "process may use); logged at start-up as 'thread_policy'")
    p.add_argument("--structured-outputs-max-bytes", default="64KiB", metavar="SIZE",
                   help="largest output constraint accepted (a JSON schema, regex, grammar or "
                        "list of choices), e.g. 64KiB; larger ones get 400 (default 64KiB)")
    p.add_argument("--structured-outputs-timeout", type=POSITIVE_FLOAT, default=5.0,
                   metavar="SECONDS",
                   help="seconds of CPU a new output constraint may take to compile (in a "
                        "child process, before the request is queued); longer ones get 400 "
                        "(default 5)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="cuda: run decode steps eagerly instead of replaying the CUDA graphs "
                        "captured at start-up per batch size (vLLM's flag)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a request's tokens do not depend on what else is batched with it "
                        "(per-row kernels for every product and attention; slower prefill and "
                        "large batches; CPU, --quantization none or q4; vLLM's "
                        "VLLM_BATCH_INVARIANT=1)")
    p.add_argument("--stall-timeout", type=POSITIVE_FLOAT, default=60.0, metavar="SECONDS",
                   help="/health answers 503 when requests run or wait and no step finished "
                        "for this long (the role of vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S; "
                        "default 60)")
    p.add_argument("--log-format", default="json", choices=["json", "console"])
    p.add_argument("--log-level", default="info",
                   help="debug adds a 'step' event per model step")
    p.add_argument("--stats-interval", type=float, default=10.0,
                   help="seconds between 'engine_stats' log lines (throughput, running, "
                        "waiting, preemptions, KV usage, prefix hit rate); 0 = off")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the ``EngineConfig``; fetches the default model when ``--model`` is absent."""
    from kvserve.model.backend import resolve_backend

    if args.backend == "auto" and (args.batch_invariant or args.quantization == "w4a8"):
        args.backend = "cpu"  # both are the CPU backend's kernels: no GPU probe
    args.backend = resolve_backend(args.backend)
    if args.backend == "cuda":
        from kvserve.cuda.backend import check_available
        check_available()
    model = args.model
    if model is None:
        from kvserve.model.default_model import ensure_default_model
        model = str(ensure_default_model())
    budget = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS[args.backend]
    threshold = args.long_prefill_token_threshold
    scheduler = SchedulerConfig(
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=budget // 2 if threshold is None else threshold,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len or 1 << 30, policy=args.scheduling_policy,
        priority_aging_seconds=args.priority_aging_seconds,
        max_waiting_requests=args.max_waiting_requests, max_waiting_tokens=args.max_waiting_tokens,
        max_step_seconds=args.max_step_ms / 1000 if args.max_step_ms else None,
        async_scheduling=args.async_scheduling, speculative=args.speculative_config)
    cache = CacheConfig(block_size=args.block_size, kv_cache_memory=parse_size(args.kv_cache_memory),
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        enable_prefix_caching=args.enable_prefix_caching,
                        kv_offloading_size=args.kv_offloading_size)
    if cache.kv_offloading_size:
        from kvserve.distributed.host_tier import check_tier_size
        check_tier_size(int(cache.kv_offloading_size * 2**30))
    return EngineConfig(model=model, backend=args.backend, dtype=args.dtype,
                        quantization=args.quantization, cache=cache,
                        scheduler=scheduler,
                        logprobs_mode=args.logprobs_mode, seed=args.seed,
                        num_threads=args.num_threads,
                        structured_outputs=StructuredOutputsConfig(
                            max_bytes=parse_size(args.structured_outputs_max_bytes),
                            timeout=args.structured_outputs_timeout),
                        stall_timeout=args.stall_timeout, enforce_eager=args.enforce_eager,
                        batch_invariant=args.batch_invariant,
                        fault_injection=getattr(args, "fault_injection", None))


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error on two lines (the error, then where the
    flags are listed) rather than the whole usage block first."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\nSee '{self.prog} --help' for the options.\n")


#: Sub-commands whose arguments live in tooling modules (NumPy, the replay
#: client): those modules are imported only to parse their own command.
TOOL_COMMANDS = ("analyze", "bench")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``kvserve`` argument parser with its sub-commands.

    ``command``: the sub-command about to be parsed (``main`` passes the
    first word of argv). The arguments of ``analyze`` and ``bench`` are added
    only for that command or for None (every command: docs and tests), so
    ``kvserve serve`` never imports the log analyser or the bench client."""
    parser = _Parser(prog="kvserve", description="kvserve LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' (or set KVSERVE_API_KEY, or "
                            "use --api-key-file, which keep the key out of 'ps')")
    serve.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="read the API key from the first line of this file")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--max-request-bytes", type=POSITIVE_INT, default=1024 * 1024,
                       help="larger request bodies get 413")
    serve.add_argument("--log-prompts", action="store_true",
                       help="log prompts and generated texts (never logged without it)")
    serve.add_argument("--request-timeout", type=POSITIVE_FLOAT, default=None,
                       help="abort a request that has not finished after this many seconds")
    serve.add_argument("--drain-timeout", type=POSITIVE_FLOAT, default=30.0,
                       help="on SIGTERM, seconds to let accepted requests finish")
    _add_connection_args(serve)
    serve.add_argument("--data-parallel-size", type=POSITIVE_INT, default=1,
                       help="engine replicas, each a Ray actor with its own KV cache; "
                            "requests go to the replica holding their prefix (vLLM's flag)")
    serve.add_argument("--data-parallel-routing", default="prefix",
                       choices=["prefix", "round_robin"],
                       help="prefix: the replica holding the longest cached prefix unless "
                            "overloaded, else the least loaded; round_robin: in turn")
    serve.add_argument("--prefill-replicas", type=POSITIVE_INT, default=None,
                       help="disaggregated prefill/decode: replicas that only prefill and hand "
                            "the KV blocks to a decode replica (with --decode-replicas)")
    serve.add_argument("--decode-replicas", type=POSITIVE_INT, default=None,
                       help="disaggregated prefill/decode: replicas that adopt the prefilled "
                            "blocks and decode (with --prefill-replicas)")
    serve.add_argument("--ray-address", default=None,
                       help="an existing Ray cluster (default: a local Ray started with no "
                            "set-up)")
    serve.add_argument("--fault-injection", type=_fault_injection, default=None,
                       metavar="JSON", help="TESTS ONLY: make steps fail or actors die "
                       "on purpose (kvserve.testing.faults); never in production")
    gen = sub.add_parser("generate", help="generate a completion for one prompt, in-process")
    _add_engine_args(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=POSITIVE_INT, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--raw", action="store_true", help="no chat template: a plain completion")
    sub.add_parser("fetch-model", help="fetch and convert the default model; print its folder")
    _add_plan_parser(sub)
    analyze = sub.add_parser("analyze", help="analyse a kvserve JSON log: phase breakdown, "
                             "percentiles, bottleneck diagnosis, Markdown report and plots")
    if command in (None, "analyze"):
        from kvserve.observability.analysis import add_arguments as add_analyze_arguments

        add_analyze_arguments(analyze)
    diag = sub.add_parser("diagnose", help="diagnose a running server's bottleneck from two "
                          "scrapes of its /metrics")
    diag.add_argument("--url", required=True, help="server base URL (or the /metrics URL)")
    diag.add_argument("--interval", type=POSITIVE_FLOAT, default=10.0,
                      help="seconds between the two scrapes")
    diag.add_argument("--json", action="store_true", help="print JSON")
    bench = sub.add_parser("bench", help="replay a JSONL trace against a server "
                           "(tools/replay.py; see tools/README.md)")
    if command in (None, "bench"):
        from kvserve.bench.replay import add_arguments as add_bench_arguments

        add_bench_arguments(bench)
    return parser


def _add_plan_parser(sub) -> None:
    """``kvserve plan``: capacity arithmetic from config.json and safetensors headers."""
    plan = sub.add_parser(
        "plan", help="print weights, KV cache size and concurrency without loading weights")
    plan.add_argument("--model", default=None,
                      help="checkpoint folder (default: the default model, fetched if needed)")
    plan.add_argument("--max-model-len", type=POSITIVE_INT, default=None,
                      help="request length for the concurrency figure, in tokens "
                           "(default: the model's max_position_embeddings)")
    memory = plan.add_mutually_exclusive_group()
    memory.add_argument("--kv-cache-memory", default=None,
                        help="CPU backend: bytes for KV blocks, e.g. 1GiB (default 1GiB)")
    memory.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="GPU: total GPU memory in GiB (plans for the cuda backend)")
    plan.add_argument("--gpu-memory-utilization", type=float, default=None,
                      help="GPU: fraction of the GPU memory to use (default 0.9)")
    plan.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                      help="weights and KV dtype (CPU: float32; GPU default float16)")
    plan.add_argument("--block-size", type=POSITIVE_INT, default=16, help="tokens per KV block")
    plan.add_argument("--max-num-batched-tokens", type=POSITIVE_INT, default=2048,
                      help="GPU: step token budget, for the activation estimate")
    plan.add_argument("--max-num-seqs", type=POSITIVE_INT, default=64,
                      help="GPU: most sequences per step, for the activation estimate")
    plan.add_argument("--json", action="store_true", help="print one JSON object")


def _fault_injection(text: str):
    from kvserve.testing.faults import FaultInjection

    try:
        return FaultInjection.from_json(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_connection_args(serve: argparse.ArgumentParser) -> None:
    """Connection limits (``kvserve.api.connections``); defaults from ``ServerConfig``."""
    d = ServerConfig()
    serve.add_argument("--timeout-keep-alive", type=POSITIVE_FLOAT, default=d.timeout_keep_alive,
                       help="close a connection idle this many seconds (new, or between "
                            "requests; uvicorn's flag)")
    serve.add_argument("--timeout-request-head", type=POSITIVE_FLOAT,
                       default=d.timeout_request_head,
                       help="408 when a request head takes longer than this many seconds")
    serve.add_argument("--timeout-request-body", type=POSITIVE_FLOAT,
                       default=d.timeout_request_body,
                       help="408 when a request body takes longer than this many seconds")
    serve.add_argument("--max-connections", type=POSITIVE_INT, default=d.max_connections,
                       help="open connections above this get 503 and are closed at once")
    serve.add_argument("--max-header-bytes", type=POSITIVE_INT, default=d.max_header_bytes,
                       help="larger request headers get 431")


async def _serve(args: argparse.Namespace, engine_config: EngineConfig) -> None:
    import os

    import uvicorn

    from kvserve.api.app import build_app
    from kvserve.api.http_metrics import instrument
    from kvserve.api.server import DrainingServer, fit_file_limit, uvicorn_config

    from kvserve.observability.metrics import ServerMetrics, metrics_route

    api_key = resolve_api_key(args, os.environ)  # before minutes of loading, not after
    _require_model_folder(engine_config.model)
    if args.data_parallel_size > 1:
        engine = await _start_replicas(args, engine_config)
        engine_metrics = engine.metrics_text  # every replica's, labelled replica="i"
    else:
        engine = await _start_engine(engine_config, args.served_model_name,
                                     request_timeout=args.request_timeout,
                                     stats_interval=args.stats_interval,
                                     log_prompts=getattr(args, "log_prompts", False))
        engine_metrics = engine.metrics
    server_metrics = ServerMetrics()  # this process's HTTP requests, CPU and memory
    server_config = ServerConfig(
        host=args.host, port=args.port, api_key=api_key,
        served_model_name=args.served_model_name, max_request_bytes=args.max_request_bytes,
        log_prompts=args.log_prompts, timeout_keep_alive=args.timeout_keep_alive,
        timeout_request_head=args.timeout_request_head,
        timeout_request_body=args.timeout_request_body,
        max_connections=fit_file_limit(args.max_connections),
        max_header_bytes=args.max_header_bytes)
    app = instrument(build_app(engine, server_config, extra_routes=[
        metrics_route(server_metrics, engine_metrics)]), server_metrics)
    config = uvicorn_config(app, server_config)
    try:
        await DrainingServer(config, engine, args.drain_timeout).serve()
    finally:
        await engine.shutdown()


def resolve_api_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """The API key from ``--api-key``, ``--api-key-file`` or ``KVSERVE_API_KEY``
    (first found), or None for a server without one.

    Raises ``SystemExit`` (a one-line error) for an empty key: an empty
    ``--api-key ''`` used to turn authentication off without a word.
    """
    sources = [("--api-key", args.api_key)]
    if getattr(args, "api_key_file", None):
        try:
            with open(args.api_key_file, encoding="utf-8") as handle:
                sources.append(("--api-key-file", handle.readline().strip()))
        except OSError as exc:
            _die(f"--api-key-file: {exc}")
    sources.append(("KVSERVE_API_KEY", environ.get("KVSERVE_API_KEY")))
    for name, key in sources:
        if key is not None:
            if not key.strip():
                _die(f"{name} is empty; give a key, or none of --api-key, --api-key-file "
                     "and KVSERVE_API_KEY to serve without one")
            return key
    return None


def _die(message: str) -> None:
    print(f"kvserve: error: {message}", file=sys.stderr)
    raise SystemExit(2)


#: The checkpoint layout ``--model`` takes (``kvserve.model.loader`` and ``.tokenizer``).
CHECKPOINT_FILES = "config.json, *.safetensors, tokenizer.json"
#: A hub model id such as ``HuggingFaceTB/SmolLM2-135M-Instruct``.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+$")


def model_folder_problem(model: str) -> str | None:
    """Why ``--model model`` is not a checkpoint folder kvserve can load, as
    one line, or None when it is one. Only the layout is checked (a folder
    with ``config.json``, ``*.safetensors`` and ``tokenizer.json``); their
    contents are the loader's (its errors are one line too). A GGUF file, or
    a folder of one, is named as such: it is not loaded directly (yet)."""
    from kvserve.model.loader import SUPPORTED_MODEL_TYPES

    *others, last = SUPPORTED_MODEL_TYPES
    accepts = (f"pass a Hugging Face-layout folder ({CHECKPOINT_FILES}) of a "
               f"{', '.join(others)} or {last} model")
    gguf = (f"a GGUF file is not loaded directly yet; {accepts} (`kvserve fetch-model` makes "
            "one for the default model from its GGUF)")
    path = Path(model)
    if not path.exists():
        hub = (f"; model ids from a hub are not fetched: pass a local folder ({CHECKPOINT_FILES})"
               if _HUB_ID.match(model) else "")
        return f"--model {model}: no such folder{hub}"
    if not path.is_dir():
        if path.suffix.lower() == ".gguf":
            return f"--model {model}: {gguf}"
        return f"--model {model} is a file, not a folder; {accepts}"
    missing = [name for name, found in (
        ("config.json", (path / "config.json").is_file()),
        ("*.safetensors", any(path.glob("*.safetensors"))),
        ("tokenizer.json", (path / "tokenizer.json").is_file())) if not found]
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if "config.json" in missing and ggufs:
        return f"--model {model} holds a GGUF file ({ggufs[0]}) but no config.json: {gguf}"
    if missing:
        return f"--model {model}: no {', '.join(missing)} in this folder; {accepts}"
    return None


def _require_model_folder(model: str) -> None:
    """``_die`` with ``model_folder_problem``'s line, before any loading."""
    problem = model_folder_problem(model)
    if problem is not None:
        _die(problem)


def _speculative_config(text: str) -> SpeculativeConfig:
    """argparse type of ``--speculative-config`` (a usage error names the
    problem, a missing draft checkpoint included, before any model loads)."""
    try:
        config = SpeculativeConfig.from_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if config.uses_draft_model and not (Path(config.model) / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"'model': {config.model} is not a checkpoint folder "
                                         "(no config.json in it)")
    return config


def _resolve_replica_roles(args: argparse.Namespace) -> None:
    """``--prefill-replicas P --decode-replicas D`` means P + D replicas;
    one without the other, or a ``--data-parallel-size`` that is not P + D,
    is an error."""
    prefill, decode = args.prefill_replicas, args.decode_replicas
    if prefill is None and decode is None:
        args.prefill_replicas = 0
        return
    if prefill is None or decode is None:
        _die("--prefill-replicas and --decode-replicas go together")
    if args.data_parallel_size not in (1, prefill + decode):
        _die(f"--data-parallel-size {args.data_parallel_size} is not --prefill-replicas "
             f"{prefill} + --decode-replicas {decode}")
    args.data_parallel_size = prefill + decode
    spec = args.speculative_config
    if spec is not None and spec.uses_draft_model:
        _die("a draft model keeps its own KV cache, which a prefill replica does not hand "
             "over: use --prefill-replicas or a draft model, not both")


#: What ``--data-parallel-size`` and disaggregated prefill/decode need, and
#: where it comes from (Ray is no serving dependency of one engine).
DISTRIBUTED_EXTRA = "pip install 'kvserve[distributed]'"


def _check_replica_flags(args: argparse.Namespace) -> None:
    """Before anything loads: settle the replica roles (``_resolve_replica_roles``)
    and, when they ask for more than one engine, ``_die`` with the command
    that installs Ray if it is not installed (found without importing it)."""
    _resolve_replica_roles(args)
    if args.data_parallel_size > 1 and importlib.util.find_spec("ray") is None:
        flags = ("--prefill-replicas/--decode-replicas" if args.prefill_replicas
                 else f"--data-parallel-size {args.data_parallel_size}")
        _die(f"{flags} runs engine replicas on Ray, which is not installed: "
             f"{DISTRIBUTED_EXTRA}")


async def _start_replicas(args: argparse.Namespace, config: EngineConfig):
    """``--data-parallel-size`` replicas on Ray (a ``DataParallelClient``)."""
    from kvserve.distributed.client import DataParallelClient

    return await DataParallelClient.start(
        config, args.data_parallel_size, ray_address=args.ray_address,
        model_name=args.served_model_name, request_timeout=args.request_timeout,
        stats_interval=args.stats_interval, routing=args.data_parallel_routing,
        prefill_replicas=args.prefill_replicas)


async def _start_engine(config: EngineConfig, *args, **kwargs):
    """``AsyncEngine.start``, with the errors a user's settings cause at load
    time (no such file, a model the settings cannot serve, no backend) as one
    line on stderr and exit status 2 instead of a traceback."""
    from kvserve.engine import AsyncEngine
    from kvserve.model.backend import BackendUnavailable

    try:
        return await AsyncEngine.start(config, *args, **kwargs)
    except (FileNotFoundError, ValueError, BackendUnavailable) as exc:
        _die(str(exc))


async def _generate(args: argparse.Namespace, engine_config: EngineConfig) -> int:
    from kvserve.actors.messages import GenerateRequest, RequestFailed, RequestOutput
    from kvserve.core.sampling_params import SamplingParams

    _require_model_folder(engine_config.model)
    engine = await _start_engine(engine_config, stats_interval=args.stats_interval)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    request = GenerateRequest(
        request_id=uuid.uuid4().hex, sampling_params=params, arrival_time=time.monotonic(),
        prompt=args.prompt if args.raw else None,
        messages=None if args.raw else ({"role": "user", "content": args.prompt},))
    status = 0
    try:
        async for event in engine.generate(request):
            if isinstance(event, RequestFailed):
                print(f"error: {event.message}", file=sys.stderr)
                status = 1
            elif isinstance(event, RequestOutput):
                print(event.text, end="", flush=True)
        print()
    finally:
        await engine.shutdown()
    return status


def _run(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _plan(args: argparse.Namespace) -> int:
    """Run ``kvserve plan``; prints the table (or JSON) and returns the exit
    status (2 with a message on standard error for bad flags or memory that
    holds no KV block)."""
    import json

    from kvserve.core.plan import format_plan, plan_capacity

    try:
        if args.gpu_memory_utilization is not None and args.gpu_memory_gib is None:
            raise ValueError("--gpu-memory-utilization needs --gpu-memory-gib")
        model = args.model
        if model is None:
            from kvserve.model.default_model import ensure_default_model
            model = str(ensure_default_model())
        plan = plan_capacity(
            model, max_model_len=args.max_model_len,
            kv_cache_memory=None if args.kv_cache_memory is None
            else parse_size(args.kv_cache_memory),
            gpu_memory_gib=args.gpu_memory_gib,
            gpu_memory_utilization=args.gpu_memory_utilization or 0.9, dtype=args.dtype,
            block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvserve plan: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0


def _get_text(url: str, timeout: float = 10.0) -> str:
    """The body of ``GET url`` (stdlib only: the server installs no HTTP
    client); ``OSError`` for a refused connection or an error status."""
    from urllib.request import urlopen

    with urlopen(url, timeout=timeout) as response:  # noqa: S310 - a URL the user gave
        return response.read().decode("utf-8")


def _diagnose(args: argparse.Namespace) -> int:
    """Run ``kvserve diagnose``: two scrapes, the rules of ``kvserve.observability.diagnosis``."""
    import json
    from dataclasses import asdict

    from kvserve.observability.diagnosis import busy_summary, diagnose, features_from_scrapes
    from kvserve.observability.metrics import parse_metrics_text

    url = args.url.rstrip("/")
    if not url.endswith("/metrics"):
        url += "/metrics"
    print(f"Scraping {url} now and again in {args.interval:g} s...", file=sys.stderr,
          flush=True)
    try:
        before = parse_metrics_text(_get_text(url))
        time.sleep(args.interval)
        after = parse_metrics_text(_get_text(url))
    except OSError as exc:  # urllib's URLError and HTTPError are OSErrors
        print(f"kvserve diagnose: error: cannot scrape {url}: {exc}", file=sys.stderr)
        return 2
    features = features_from_scrapes(before, after)
    verdicts = diagnose(features)
    if args.json:
        print(json.dumps({"bottleneck": verdicts[0].kind if verdicts else None,
                          "verdicts": [v.to_dict() for v in verdicts],
                          "features": asdict(features)}, indent=2, default=str))
        return 0
    print(f"Window of {args.interval:g} s: {features.num_requests} requests finished, "
          f"{features.preemptions} preemptions.")
    if not verdicts:
        print(busy_summary(features, args.interval)
              or "No bottleneck: the server was idle in this window.")
    for verdict in verdicts:
        print()
        print(verdict.markdown())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvserve`` command; returns the exit status."""
    apply_thread_pool_env()  # before anything loads NumPy (build_parser does)
    words = sys.argv[1:] if argv is None else argv
    command = next((w for w in words if not w.startswith("-")), "")
    parser = build_parser(command)
    args = parser.parse_args(argv)
    from kvserve.observability.log import configure_logging

    configure_logging(getattr(args, "log_format", "json"), getattr(args, "log_level", "info"))
    if args.command == "fetch-model":
        from kvserve.model.default_model import ensure_default_model
        print(ensure_default_model())
    elif args.command in ("serve", "generate"):
        if args.command == "serve":
            _check_replica_flags(args)
        from kvserve.model.backend import BackendUnavailable
        try:
            config = engine_config_from_args(args)
        except BackendUnavailable as exc:  # one line, no traceback
            print(f"kvserve: error: {exc}", file=sys.stderr)
            return 2
        except ValueError as exc:  # inconsistent settings, e.g. a block size not a power of 2
            parser.error(str(exc))
        if args.command == "serve":
            _run(_serve(args, config))
        else:
            return _run(_generate(args, config))
    elif args.command == "plan":
        return _plan(args)
    elif args.command == "diagnose":
        return _diagnose(args)
    elif args.command in ("analyze", "bench"):
        try:
            return _run_tool(args)
        except ModuleNotFoundError as exc:  # the bench extra is not installed
            hint = " (or pass --no-plots)" if args.command == "analyze" else ""
            print(f"kvserve {args.command}: error: {exc.name} is missing; install the bench "
                  f"extra: pip install 'kvserve[bench]'{hint}", file=sys.stderr)
            return 2
    return 0


def _run_tool(args: argparse.Namespace) -> int:
    """``kvserve analyze`` or ``kvserve bench`` (their plotting and load
    generation come with the ``bench`` extra)."""
    if args.command == "analyze":
        from kvserve.observability.analysis import run as run_analysis
        return run_analysis(args)
    from kvserve.bench.replay import run_cli
    return run_cli(args)


if __name__ == "__main__":
    sys.exit(main())
