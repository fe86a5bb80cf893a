"""Engine configuration: frozen dataclasses, and the one place that parses sizes.

Every other module receives these objects; none reads the CLI or the
environment itself (``kvserve.cli`` builds them from ``argparse``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.kv_format import check_kv_cache_dtype, kv_bytes_per_token

if TYPE_CHECKING:
    from kvserve.testing.faults import FaultInjection

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs", "raw_logits")
#: Weight schemes (``EngineConfig.quantization``, ``kvserve.model.quantization``).
QUANTIZATIONS = ("none", "int8", "w8a8", "q4", "w4a8")
#: ``--tool-call-parser`` values besides ``auto`` (vLLM's names; ``kvserve.api.tool_calls``).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "phi4_mini_json")
#: ``--reasoning-parser`` values (vLLM's names; ``kvserve.api.reasoning``).
REASONING_PARSERS = ("deepseek_r1", "qwen3")
#: ``ModelConfig.layer_types`` values (Hugging Face's names).
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
#: ``ModelConfig.hidden_activation`` values: SwiGLU (Llama) and GeGLU with
#: PyTorch's tanh-approximated GELU (Gemma 3).
HIDDEN_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def parse_size(text: str | int) -> int:
    """Parse a memory size such as ``"1GiB"``, ``"512MiB"``, ``"2G"`` or ``1024``.

    Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones
    (K, M, G, T, with or without a trailing B) powers of 1000, as in vLLM's
    ``--kv-cache-memory``. Returns bytes (int). Raises ``ValueError`` on
    anything else.
    """
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 512MiB, 1GiB, 2G")
    number, unit = match.groups()
    unit = (unit or "").lower().rstrip("b")
    return int(float(number) * _UNITS[unit])


@dataclass(frozen=True)
class RopeSpec:
    """One attention type's rotary embedding.

    Attributes:
        theta: the base (``rope_theta``), > 0.
        rope_type: one of ``kvserve.model.rope.ROPE_TYPES``.
        factor: ``linear`` / ``llama3`` / ``yarn`` scale, ``longrope``'s
            ``max_position_embeddings / original_max_position_embeddings``.
        original_max_position: the pre-training context (``llama3``,
            ``yarn``, ``longrope``), tokens.
        low_freq_factor, high_freq_factor: ``llama3``'s band edges.
        beta_fast, beta_slow, truncate: ``yarn``'s correction range.
        attention_factor: cos and sin are multiplied by it (``yarn``,
            ``longrope``; 1.0 otherwise).
        short_factor, long_factor: ``longrope``'s per-frequency divisors,
            ``head_dim / 2`` each.
        freq_factors: ``default`` with a GGUF ``rope_freqs`` tensor: each
            frequency divided by its factor; empty: none.
        rotary_fraction: ``partial_rotary_factor`` (Phi-4-mini: 0.75): the
            first ``int(head_dim * rotary_fraction)`` dimensions of a head
            rotate (pairs ``(j, j + rotary_dim / 2)``, transformers'
            ``rotate_half`` on them), the others pass; see
            ``kvserve.model.rope.partial_rotary_perm`` for how the kernels compute it.
    """

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    freq_factors: tuple[float, ...] = ()
    rotary_fraction: float = 1.0

    @property
    def is_default(self) -> bool:
        """Plain RoPE of base ``theta`` over whole heads: no scaling, factors
        or attention factor."""
        return (self.rope_type == "default" and not self.freq_factors
                and self.rotary_fraction == 1.0)

    def rotary_dim(self, head_dim: int) -> int:
        """Dimensions of a head that rotate (transformers' ``int(head_dim *
        partial_rotary_factor)``). Raises ValueError unless even and positive."""
        rot = int(head_dim * self.rotary_fraction)
        if rot <= 0 or rot % 2 or rot > head_dim:
            raise ValueError(f"RoPE over {rot} of {head_dim} head dimensions: needs an even "
                             "number, at least 2")
        return rot


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family checkpoint, read from its ``config.json``.

    Field names follow Hugging Face ``LlamaConfig``; ``eos_token_ids`` is a
    tuple because some checkpoints list several.

    Gemma 3 (``Gemma3TextConfig``) adds the fields after ``eos_token_ids``;
    their defaults are the Llama architecture's, so a Llama config sets none:

    - ``layer_types``: ``"full_attention"`` or ``"sliding_attention"`` per
      layer; empty (the default) means every layer full.
    - ``sliding_window``: tokens a sliding layer sees: the key at position j
      is visible to the query at position p iff ``0 <= p - j < sliding_window``.
    - ``rope_local_base_freq``: RoPE base of the sliding layers (None:
      ``rope_theta``); ``rope_theta`` is the full layers' base.
    - ``query_pre_attn_scalar``: attention scale ``query_pre_attn_scalar ** -0.5``
      (None: ``head_dim ** -0.5``); see :attr:`attention_scale`.
    - ``hidden_activation``: ``"silu"`` (SwiGLU) or ``"gelu_pytorch_tanh"`` (GeGLU).
    - ``norm_offset``: every RMSNorm multiplies by ``norm_offset + w``
      (Gemma's ``1 + w``: 1.0; Llama: 0.0).
    - ``embedding_multiplier``: the embedding rows are multiplied by it, in
      float32 (Gemma: ``sqrt(hidden_size)``; Llama: 1.0).
    - ``qk_norm``: RMSNorm of each query and key head (over ``head_dim``)
      before RoPE; ``sandwich_norms``: RMSNorm of the attention output and
      of the MLP output before their residual adds, and a separate norm
      before the MLP (Gemma's four norms per layer).
    - ``rope_scaling``: the full layers' scaled RoPE (``kvserve.model.rope``:
      ``llama3``, ``linear``, ``yarn``, ``longrope``, or a GGUF's
      ``rope_freqs``); None: plain RoPE of base ``rope_theta``. See :attr:`rope`.

    Raises ValueError for ``layer_types`` of another length than
    ``num_hidden_layers`` or with another value, a sliding layer without a
    positive ``sliding_window``, or an unknown ``hidden_activation``.
    """

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local_base_freq: float | None = None
    query_pre_attn_scalar: float | None = None
    hidden_activation: str = "silu"
    norm_offset: float = 0.0
    embedding_multiplier: float = 1.0
    qk_norm: bool = False
    sandwich_norms: bool = False
    rope_scaling: RopeSpec | None = None

    def __post_init__(self) -> None:
        types = tuple(self.layer_types) or (FULL_ATTENTION,) * self.num_hidden_layers
        object.__setattr__(self, "layer_types", types)
        if len(types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(types)} entries for "
                             f"{self.num_hidden_layers} layers")
        unknown = sorted(set(types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if unknown:
            raise ValueError(f"layer_types: unknown {unknown}; known: "
                             f"{FULL_ATTENTION!r}, {SLIDING_ATTENTION!r}")
        if SLIDING_ATTENTION in types and not (self.sliding_window or 0) > 0:
            raise ValueError("sliding_attention layers need sliding_window > 0, got "
                             f"{self.sliding_window}")
        if self.hidden_activation not in HIDDEN_ACTIVATIONS:
            raise ValueError(f"hidden_activation must be one of {HIDDEN_ACTIVATIONS}, got "
                             f"{self.hidden_activation!r}")

    @property
    def attention_scale(self) -> float:
        """Multiplier of q.k: ``query_pre_attn_scalar ** -0.5`` when set
        (Gemma 3), else ``head_dim ** -0.5``."""
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        return self.head_dim ** -0.5

    @property
    def rope(self) -> RopeSpec:
        """The full layers' RoPE: ``rope_scaling``, or plain RoPE of base ``rope_theta``."""
        return self.rope_scaling if self.rope_scaling is not None else RopeSpec(self.rope_theta)

    def layer_window(self, layer: int) -> int:
        """Tokens layer ``layer`` attends to: ``sliding_window`` on a sliding
        layer, 0 (the whole causal context) on a full one."""
        if self.layer_types[layer] == SLIDING_ATTENTION:
            return int(self.sliding_window)
        return 0

    def kv_bytes_per_token(self, dtype_bytes: int = 4, kv_cache_dtype: str = "auto") -> int:
        """Bytes of K and V for one token over all layers, scales included:
        2 x layers x kv_heads x head_dim x dtype bytes (vLLM's sizing rule),
        or with ``kv_cache_dtype`` int8, head_dim + 4 bytes per vector
        (``kvserve.model.kv_quant``)."""
        return kv_bytes_per_token(self.num_hidden_layers, self.num_key_value_heads,
                                  self.head_dim, kv_cache_dtype, dtype_bytes)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache settings.

    ``kv_cache_memory`` is the byte budget for KV blocks on the CPU backend;
    ``num_blocks`` is filled in by the engine after it has measured memory.
    ``kv_offloading_size``: GiB of host shared memory for the KV offload tier
    (vLLM's ``--kv-offloading-size``; 0 = no tier); the engine creates it.
    ``kv_offloading_shm_path``: attach to a tier another process created
    (the data-parallel client sets it for its replicas) instead.
    ``kv_cache_dtype``: ``auto`` (the model dtype) or ``int8`` (vLLM's
    ``--kv-cache-dtype``; the format is ``kvserve.model.kv_quant``).
    ``kv_offloading_backend``: ``native`` (the shared-memory tier alone) or
    ``disk`` (a disk tier under it, in the folder ``kv_offloading_path``,
    at most ``kv_offloading_disk_size`` GiB, kept across restarts).
    """

    block_size: int = 16
    kv_cache_memory: int = 1024**3
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_blocks: int | None = None
    kv_offloading_size: float = 0.0
    kv_offloading_shm_path: str | None = None
    kv_cache_dtype: str = "auto"
    kv_offloading_backend: str = "native"
    kv_offloading_path: str | None = None
    kv_offloading_disk_size: float = 4.0

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if not self.kv_offloading_size >= 0.0:
            raise ValueError(f"kv_offloading_size must be >= 0 GiB, got {self.kv_offloading_size}")
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ValueError("--kv-offloading-size needs prefix caching (the tier keeps blocks "
                             "by their prefix hashes); drop --no-enable-prefix-caching")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.kv_offloading_backend not in ("native", "disk"):
            raise ValueError("--kv-offloading-backend must be native or disk, got "
                             f"{self.kv_offloading_backend!r}")
        if self.kv_offloading_backend == "disk":
            if not self.kv_offloading_path:
                raise ValueError("--kv-offloading-backend disk needs --kv-offloading-path DIR "
                                 "(the folder that keeps KV blocks across restarts)")
            if not self.kv_offloading_size:
                raise ValueError("--kv-offloading-backend disk sits under the shared-memory "
                                 "tier: give --kv-offloading-size GIB too")
            if not self.kv_offloading_disk_size > 0.0:
                raise ValueError("--kv-offloading-disk-size must be > 0 GiB, got "
                                 f"{self.kv_offloading_disk_size}")
        elif self.kv_offloading_path:
            raise ValueError("--kv-offloading-path is the disk tier's folder: add "
                             "--kv-offloading-backend disk")


#: Default step token budget per backend. CPU: 128, from
#: ``tools/bench_long_prefill.py`` on the 2-core machine (8 decoding streams
#: while a 5,000-token prompt prefills): budgets 2048 / 1024 / 512 / 256 gave
#: the streams an ITL p99 of 7.0 / 3.8 / 2.0 / 0.98 s and the long prompt a
#: TTFT of 15.4 / 14.2 / 14.5 / 13.4 s (2026-11-30); with async scheduling
#: (2026-12-01) 256 / 192 / 128 gave 1.13 / 1.26 / 0.70 s and 16.1 / 15.5 /
#: 16.9 s. At 32 closed-loop clients 128 against 256 cost 4% (greedy) and 8%
#: (sampled) of the output throughput and cut ITL p99 by 30%
#: (``tools/bench_vs_llamacpp.py --skip-llamacpp --concurrency 32``).
#: CUDA: vLLM's usual 2048.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 128, "cuda": 2048}


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config`` in vLLM's JSON shape (``kvserve.core.spec_decode``).

    ``method``: ``ngram`` (prompt lookup: drafts copied from earlier in the
    request) or ``draft_model`` (a smaller checkpoint of the same tokenizer,
    ``model``, proposes the drafts; ``kvserve.model.drafter``).
    ``num_speculative_tokens``: draft tokens per step, k >= 1.
    ``prompt_lookup_max`` / ``prompt_lookup_min`` (``ngram``): the longest
    and shortest suffix (tokens) searched for. ``quantization``
    (``draft_model``, vLLM's key): the draft's weights, as the engine's
    ``quantization``; ``none`` by default. ``disable_by_batch_size`` (vLLM's
    key): no request speculates while at least this many are running or
    waiting (None: no limit), since a full batch already reads the weights
    once for many tokens and a draft model's passes then cost more than they
    save.
    Raises ``ValueError`` naming the bad field.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    quantization: str = "none"
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative method must be 'ngram' or 'draft_model', "
                             f"got {self.method!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("method 'draft_model' needs 'model': the draft checkpoint's folder")
        if self.method == "ngram" and (self.model is not None or self.quantization != "none"):
            raise ValueError("'model' and 'quantization' are for method 'draft_model'; "
                             "'ngram' needs neither")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16], got "
                             f"{self.num_speculative_tokens}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be >= 1, got "
                             f"{self.disable_by_batch_size}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @property
    def uses_draft_model(self) -> bool:
        """True when a draft model (in the worker) proposes the drafts."""
        return self.method == "draft_model"

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse ``--speculative-config``; ``ValueError`` names a bad or unknown key."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown keys {unknown}; known: {sorted(known)}")
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                    "disable_by_batch_size"):
            if key not in data or (key == "disable_by_batch_size" and data[key] is None):
                continue
            if not isinstance(data[key], int) or isinstance(data[key], bool):
                raise ValueError(f"{key} must be an integer")
        for key in ("method", "model", "quantization"):
            if data.get(key) is not None and not isinstance(data[key], str):
                raise ValueError(f"{key} must be a string")
        if data.get("quantization", "") is None:  # null: the default
            del data["quantization"]
        if data.get("method", "") is None:
            raise ValueError("method must be a string")
        return cls(**data)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits and policy.

    ``max_num_batched_tokens`` is the per-step token budget (prefill chunks
    plus decodes), ``max_num_seqs`` the most sequences in one step, and
    ``max_model_len`` the longest prompt + output a request may reach.
    ``max_step_seconds`` (``--max-step-ms``), when set, lowers each step's
    budget so that a step takes about that long (``core.step_budget``).
    ``async_scheduling`` (``--async-scheduling``, vLLM's flag) schedules step
    N+1 while step N computes: two steps in flight instead of one.
    ``long_prefill_token_threshold`` (vLLM's flag): while other requests
    wait, one prompt's prefill chunk takes at most this many tokens of a
    step, so a long prompt cannot hold every later arrival back until it is
    prefilled; 0 (the default here, as in vLLM) is no cap. ``kvserve
    serve`` sets half of ``max_num_batched_tokens`` unless told otherwise.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 8192
    policy: str = "fcfs"
    priority_aging_seconds: float | None = None
    max_waiting_requests: int | None = None
    max_waiting_tokens: int | None = None
    max_step_seconds: float | None = None
    async_scheduling: bool = True
    long_prefill_token_threshold: int = 0
    speculative: SpeculativeConfig | None = None
    #: Pipeline stages the steps run through (``ParallelConfig``); above 1
    #: a step leaves out the requests whose next token is still in flight,
    #: and takes at most 1/P of the decoding requests, so that P steps of
    #: disjoint requests fill the stages (vLLM's micro-batches).
    pipeline_parallel_size: int = 1

    @property
    def max_steps_in_flight(self) -> int:
        """Steps scheduled and not yet returned: 2 with async scheduling, else 1."""
        return 2 if self.async_scheduling else 1

    def __post_init__(self) -> None:
        if self.max_step_seconds is not None and not self.max_step_seconds > 0:
            raise ValueError(f"max_step_seconds must be > 0, got {self.max_step_seconds}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be fcfs or priority, got {self.policy!r}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.pipeline_parallel_size < 1:
            raise ValueError("pipeline_parallel_size must be >= 1")


@dataclass(frozen=True)
class ParallelConfig:
    """Model parallelism (vLLM's ``ParallelConfig`` names).

    ``pipeline_parallel_size`` (``-pp``): the decoder layers split into
    that many contiguous stages (``kvserve.core.parallel.pp_layer_ranges``;
    ``pp_layer_partition`` gives the layers per stage, else vLLM's even
    split), each a Ray actor process with its layers' weights and KV cache
    (``kvserve.distributed.pipeline``). ``tensor_parallel_size`` (``-tp``):
    each stage's layers sharded by head over that many worker processes.
    ``ray_address``: the Ray cluster (None: a local one, as
    ``--data-parallel-size``). 1 and 1: the model runs whole in the engine's
    process, as always.
    """

    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    pp_layer_partition: tuple[int, ...] | None = None
    ray_address: str | None = None

    @property
    def world_size(self) -> int:
        """Worker processes of one engine: pp x tp."""
        return self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def enabled(self) -> bool:
        """True when the model runs in worker processes (pp or tp above 1)."""
        return self.world_size > 1

    def __post_init__(self) -> None:
        if self.pipeline_parallel_size < 1 or self.tensor_parallel_size < 1:
            raise ValueError("pipeline_parallel_size and tensor_parallel_size must be >= 1")


#: generation_config.json key -> SamplingParams field (vLLM's ``available_params``).
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                          "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                          "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class GenerationDefaults:
    """Default sampling fields, applied where a request omits the field.

    Each field is a ``SamplingParams`` field (``max_tokens`` from the file's
    ``max_new_tokens``), or None when the file does not set it. ``source``:
    the file they came from (None: no file). ``cap_max_tokens``: the
    ``max_tokens`` default also bounds requests that set their own (a
    folder given to ``--generation-config``, as in vLLM).
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    source: str | None = None
    cap_max_tokens: bool = False

    def values(self) -> dict[str, float | int]:
        """The fields that are set, by ``SamplingParams`` name."""
        return {name: getattr(self, name) for name in GENERATION_CONFIG_KEYS.values()
                if getattr(self, name) is not None}

    def apply(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """``SamplingParams`` keyword arguments with the defaults filled in.

        A field absent from ``kwargs`` or None there (``max_tokens: None``:
        the request omitted it) takes the default; any other value the
        request sent wins (``temperature: 0`` stays greedy). With
        ``cap_max_tokens``, ``max_tokens`` is at most the default.
        """
        out = dict(kwargs)
        for name, value in self.values().items():
            if out.get(name) is None:
                out[name] = value
        if self.cap_max_tokens and self.max_tokens is not None:
            requested = out.get("max_tokens")
            out["max_tokens"] = self.max_tokens if requested is None \
                else min(requested, self.max_tokens)
        return out


@dataclass(frozen=True)
class ServerConfig:
    """HTTP server settings (``kvserve serve``).

    Connection limits (``kvserve.api.connections``): ``timeout_keep_alive``
    seconds an idle connection is kept (uvicorn's and vLLM's default, 5);
    ``timeout_request_head`` / ``timeout_request_body`` seconds from a
    request head's first byte to its end, and from the head to the body's
    end (408 after); ``max_connections`` open connections (more get 503);
    ``max_header_bytes`` of request header lines (more get 431; nginx and
    h11 default to 8 and 16 KiB).
    ``generation_defaults``: the sampling fields a request that omits them
    gets (``kvserve.model.generation_config``: the checkpoint's
    ``generation_config.json`` under ``--generation-config``); None: none.
    ``metric_names`` (``--metric-names``: ``kvserve``, ``vllm``, ``both``):
    the prefix of ``/metrics``' series (``kvserve.observability.metrics.
    with_metric_names``).
    ``tool_call_parser`` (``--tool-call-parser``, ``kvserve.api.tool_calls``):
    the format chat answers' tool calls are parsed in (``auto``: the chat
    template's). ``reasoning_parser`` (``--reasoning-parser``, ``kvserve.api.reasoning``):
    chat answers' ``<think>`` thought goes into ``reasoning_content``; None:
    left in the content.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_request_bytes: int = 1024 * 1024
    log_prompts: bool = False
    timeout_keep_alive: float = 5.0
    timeout_request_head: float = 10.0
    timeout_request_body: float = 30.0
    max_connections: int = 2048
    max_header_bytes: int = 16 * 1024
    generation_defaults: GenerationDefaults | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str = "auto"
    metric_names: str = "kvserve"


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Bounds on compiling a request's output constraint
    (``kvserve.constraints.compiler``).

    ``max_bytes`` (``--structured-outputs-max-bytes``): the largest schema,
    regex, grammar or list of choices accepted, in UTF-8 bytes (64 KiB: a
    JSON object of ~2,000 optional properties, which compiles in ~0.6 s on
    one core of the 2-core development machine; OpenAI's strict mode allows
    100 properties). ``timeout`` (``--structured-outputs-timeout``): seconds
    a constraint may take to compile before its request gets a 400.
    ``max_pending``: constraints that may wait for the compiler at once
    (one compiles at a time; a schema already compiled does not wait); more
    get 429. 256: a burst of distinct small schemas (milliseconds each) is
    served, a flood of the largest (about a second each) is bounded.
    """

    max_bytes: int = 64 * 1024
    timeout: float = 5.0
    max_pending: int = 256

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or not self.timeout > 0 or self.max_pending < 1:
            raise ValueError("structured outputs: max_bytes, timeout and max_pending must be > 0")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs: model path, backend, cache and scheduler.

    ``logprobs_mode`` follows vLLM's ``--logprobs-mode``: ``processed_logprobs``
    (log-softmax after penalties and temperature, the OpenAI reference's
    definition; the default), ``raw_logprobs`` (log-softmax of the raw
    logits) or ``raw_logits`` (the logits themselves, to compare against
    reference outputs). ``num_threads``: CPU threads of both BLAS and Numba
    (None: the CPUs this process may use; see ``kvserve.cpu.threads``).
    ``backend``: ``auto`` (CUDA when the start-up probe passes:
    ``kvserve.cuda.probe``), ``cpu`` or ``cuda``;
    ``dtype`` (vLLM's ``--dtype``): of weights, activations and KV cache,
    ``auto`` = float32 on the CPU, float16 on a GPU. ``quantization``:
    ``none``, ``int8`` (weight-only), ``w8a8``, ``q4`` (the GGUF's own
    blocks) or ``w4a8`` (``q4`` with Q8 activations in CPU decode steps;
    ``kvserve.model.quantization``).
    """

    model: str
    backend: str = "cpu"
    dtype: str = "auto"
    quantization: str = "none"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_logprobs: int = 20
    logprobs_mode: str = "processed_logprobs"
    seed: int = 0
    num_threads: int | None = None
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    #: CUDA: run decode steps eagerly instead of replaying CUDA graphs
    #: captured per batch size (vLLM's ``--enforce-eager``).
    enforce_eager: bool = False
    #: Seconds without a completed step, while requests run or wait, after
    #: which ``/health`` answers 503 (``kvserve.core.stall``; vLLM's
    #: ``VLLM_ENGINE_ITERATION_TIMEOUT_S`` has the same default).
    stall_timeout: float = 60.0
    #: A sequence's logits and tokens do not depend on what else is in its
    #: batch (``--batch-invariant``; vLLM's ``VLLM_BATCH_INVARIANT=1``): the
    #: CPU backend's per-row kernels for every product and attention
    #: (``CpuOps(batch_invariant=True)``). CPU, ``none`` or ``q4`` only.
    batch_invariant: bool = False
    #: Where the default sampling fields of requests that omit them come
    #: from (vLLM's ``--generation-config``): ``auto`` (the model folder's
    #: ``generation_config.json``, if any), ``vllm`` (none: temperature 1,
    #: top_p 1) or a folder holding that file, whose ``max_new_tokens`` then
    #: also caps every request (``kvserve.model.generation_config``).
    generation_config: str = "auto"
    #: ``--chat-template``: a Jinja chat template (its text) used instead of
    #: the checkpoint's; None keeps the checkpoint's (a model with none
    #: answers chat requests with a 400).
    chat_template: str | None = None
    #: Test-only faults (``kvserve.testing.faults.FaultInjection``); None injects none.
    fault_injection: FaultInjection | None = None
    #: Pipeline and tensor parallelism (``ParallelConfig``).
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if not self.stall_timeout > 0:
            raise ValueError(f"stall_timeout must be > 0, got {self.stall_timeout}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.backend not in ("auto", "cpu", "cuda"):
            raise ValueError(f"backend must be auto, cpu or cuda, got {self.backend!r}")
        if self.dtype not in ("auto", "float32", "float16"):
            raise ValueError(f"dtype must be auto, float32 or float16, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got "
                             f"{self.quantization!r}")
        if self.batch_invariant and (self.backend == "cuda"
                                     or self.quantization not in ("none", "q4")):
            raise ValueError("--batch-invariant runs the CPU backend's per-row kernels: it needs "
                             "--backend cpu (or auto) and --quantization none or q4, got "
                             f"{self.backend} and {self.quantization}")
        if self.quantization == "w4a8" and self.backend == "cuda":
            raise ValueError("--quantization w4a8 is a CPU scheme (Q8 activations in the CPU "
                             "decode kernels); on cuda use q4")
        if self.backend == "cpu" and self.dtype == "float16":
            raise ValueError("the cpu backend runs float32; --dtype float16 needs --backend cuda")
        if not isinstance(self.generation_config, str) or not self.generation_config.strip():
            raise ValueError("generation_config must be auto, vllm or a folder holding "
                             f"generation_config.json, got {self.generation_config!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}")
        spec = self.scheduler.speculative
        if spec is not None and spec.uses_draft_model and self.cache.kv_offloading_size:
            raise ValueError("a draft model keeps its own KV cache, which the offload tier "
                             "does not carry: use --kv-offloading-size or a draft model, "
                             "not both")
