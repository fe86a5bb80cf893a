"""Capacity arithmetic: how many KV tokens and full-length requests fit.

``plan_kv_cache`` / ``KVCachePlan`` divide KV memory into blocks; the engine
(``kvserve.engine.build_engine_core``) sizes its cache with them at start-up
and ``kvserve plan`` prints the same numbers without loading any weights:
``plan_capacity`` reads ``config.json`` and the safetensors *headers* only.

Memory rules (bytes; GiB = 2**30 bytes):

- weights = parameters x dtype bytes, counting exactly the tensors
  ``kvserve.model.loader.load_weights`` keeps (so on the CPU backend, which
  loads float32, it equals the loaded arrays' total ``nbytes``).
- KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x dtype
  bytes (``ModelConfig.kv_bytes_per_token``, vLLM's rule).
- KV memory: on the CPU backend ``--kv-cache-memory``; on a GPU
  ``G GiB x U - weights - activation workspace`` (``activation_workspace_bytes``,
  an estimate until the CUDA engine measures its own).
- KV tokens = whole blocks only: (KV memory // (block_size x bytes per token))
  x block_size. Maximum concurrency = KV tokens / max_model_len.
- A model with sliding-window layers (``kvserve.core.kv_layout``): a block
  holds the K/V of ``group_size`` layers, so blocks = KV memory //
  (block_size x bytes per token x group_size / layers); a request of n
  tokens holds ``KVCacheLayout.max_blocks(n)`` blocks (its sliding groups
  only the window's); KV tokens = the longest request that fits alone, and
  maximum concurrency = blocks / the blocks of a ``max_model_len`` request
  (vLLM's ``get_max_concurrency_for_kv_cache_config`` rule).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kvserve.config import CacheConfig, ModelConfig
from kvserve.core.kv_layout import KVCacheLayout, model_kv_layout

#: Bytes per element of the dtypes ``kvserve plan --dtype`` accepts.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
#: Fixed part of the GPU activation estimate: CUDA context, cuBLAS workspace
#: and memory-pool slack (bytes).
GPU_RESERVED_BYTES = 512 * 1024**2
GIB = 1024**3


@dataclass(frozen=True)
class KVCachePlan:
    """How the KV cache memory divides into blocks.

    ``bytes_per_token`` = 2 x layers x kv_heads x head_dim x dtype bytes
    (``--kv-cache-dtype int8``: head_dim + 4 bytes per vector, scales
    included; ``kvserve.model.kv_quant``);
    ``num_blocks`` = memory // (block_size x bytes_per_token);
    ``max_concurrency`` = KV tokens / ``max_model_len`` (how many requests of
    full length fit at once, as vLLM reports it).
    """

    bytes_per_token: int
    num_blocks: int
    block_size: int
    max_model_len: int
    #: The KV-cache groups when some layers slide (None: one group), and the
    #: most tokens a step computes for one request (a sliding group's blocks
    #: cover the window and one step's tokens).
    layout: KVCacheLayout | None = None
    chunk_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens the KV cache holds: with sliding layers, the longest
        request that fits alone."""
        if self.layout is None:
            return self.num_blocks * self.block_size
        usable = self.num_blocks - 1  # block 0 is the null block
        low, high = 0, usable * self.block_size  # max_blocks(n) >= n / block_size
        while low < high:  # the largest n whose blocks fit
            mid = (low + high + 1) // 2
            if self._blocks(mid) <= usable:
                low = mid
            else:
                high = mid - 1
        return low

    def _blocks(self, num_tokens: int) -> int:
        return self.layout.max_blocks(num_tokens, self.block_size,
                                      min(num_tokens, self.chunk_tokens or num_tokens))

    @property
    def max_concurrency(self) -> float:
        """Full-length requests that fit at once."""
        if self.layout is None:
            return self.num_tokens / self.max_model_len
        return (self.num_blocks - 1) / self._blocks(self.max_model_len)


def plan_kv_cache(model: ModelConfig, cache: CacheConfig, max_model_len: int,
                  dtype_bytes: int = 4, draft: ModelConfig | None = None,
                  chunk_tokens: int = 0) -> KVCachePlan:
    """Divide ``cache.kv_cache_memory`` bytes into blocks. With a ``draft``
    model (speculative decoding) each token also holds the draft's K/V: its
    cache has the same blocks (``kvserve.model.drafter``). A model with
    sliding-window layers is planned by its KV-cache groups, with
    ``chunk_tokens`` the step budget (0: a whole request in one step).

    Raises ``ValueError`` when not even one block fits (two with sliding
    layers: block 0 is the null block), or for a draft model beside
    sliding layers.
    """
    kv_dtype = cache.kv_cache_dtype
    per_token = model.kv_bytes_per_token(dtype_bytes, kv_dtype)
    layout = model_kv_layout(model)
    if not layout.is_hybrid:
        layout = None
    elif draft is not None:
        raise ValueError("a draft model cannot run beside a model with sliding-window layers")
    if draft is not None:
        per_token += draft.kv_bytes_per_token(dtype_bytes, kv_dtype)
    block_bytes = cache.block_size * per_token
    if layout is not None:  # a block holds group_size of the layers
        block_bytes = block_bytes * layout.group_size // model.num_hidden_layers
    num_blocks = cache.kv_cache_memory // block_bytes
    if num_blocks < 1 + (layout is not None):
        raise ValueError(
            f"--kv-cache-memory {cache.kv_cache_memory} bytes holds no KV block "
            f"(one block of {cache.block_size} tokens needs {block_bytes} bytes)")
    return KVCachePlan(per_token, num_blocks, cache.block_size, max_model_len, layout,
                       chunk_tokens)


def resolve_max_model_len(model: ModelConfig, requested: int | None) -> int:
    """The context length before the KV cache cap: the model's
    ``max_position_embeddings``, lowered to ``requested`` if given (tokens)."""
    return min(model.max_position_embeddings, requested or model.max_position_embeddings)


def cap_to_cache(plan: KVCachePlan) -> KVCachePlan:
    """``plan`` with ``max_model_len`` lowered to the KV tokens when the cache
    cannot hold one full-length request (the engine's rule: a request must
    fit alone)."""
    if plan.num_tokens >= plan.max_model_len:
        return plan
    return replace(plan, max_model_len=plan.num_tokens)


def read_safetensors_header(file: Path) -> dict[str, dict]:
    """The tensor table of one ``.safetensors`` file (name -> ``dtype``,
    ``shape``, ``data_offsets``), without ``__metadata__``; reads only the
    header. Raises ``ValueError`` for a file too short or not JSON-headed."""
    with open(file, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{file}: not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", prefix)
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{file}: not a safetensors file ({exc})") from None
    header.pop("__metadata__", None)
    return header


def count_parameters(path: Path, model: ModelConfig) -> int:
    """Parameters (elements) of the tensors ``load_weights`` keeps, summed
    from the shapes in the safetensors headers of ``path``. Raises
    ``FileNotFoundError`` when there is no ``*.safetensors`` file."""
    from kvserve.model.loader import _optional_tensor_shapes, expected_tensor_shapes

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}")
    kept = expected_tensor_shapes(model).keys() | _optional_tensor_shapes(model).keys()
    return sum(math.prod(info["shape"]) for file in files
               for name, info in read_safetensors_header(file).items() if name in kept)


def activation_workspace_bytes(model: ModelConfig, max_num_batched_tokens: int,
                               max_num_seqs: int, dtype_bytes: int) -> int:
    """Estimated GPU memory for one step's activations (bytes).

    Per batched token, at the model dtype: residual and normed hidden states
    (2 x hidden), fused q/k/v ((heads + 2 x kv_heads) x head_dim), attention
    output (heads x head_dim), fused gate/up and the activated product
    (3 x intermediate) -- layers run one at a time, so this is per layer.
    Plus float32 logits and probabilities (2 x 4 bytes x vocab) for each of
    ``max_num_seqs`` sampled rows, plus ``GPU_RESERVED_BYTES``.
    """
    hd = model.head_dim
    per_token = (2 * model.hidden_size + (model.num_attention_heads + 2 * model.num_key_value_heads)
                 * hd + model.num_attention_heads * hd + 3 * model.intermediate_size)
    logits = max_num_seqs * model.vocab_size * 4 * 2
    return max_num_batched_tokens * per_token * dtype_bytes + logits + GPU_RESERVED_BYTES


@dataclass(frozen=True)
class CapacityPlan:
    """Everything ``kvserve plan`` reports. Bytes unless named otherwise;
    ``gpu_memory_bytes`` / ``gpu_memory_utilization`` are None and
    ``activation_bytes`` 0 on the CPU backend."""

    model: str
    backend: str
    dtype: str
    num_parameters: int
    weights_bytes: int
    kv_bytes_per_token: int
    kv_cache_dtype: str
    gpu_memory_bytes: int | None
    gpu_memory_utilization: float | None
    activation_bytes: int
    kv_cache_memory: int
    block_size: int
    num_blocks: int
    kv_tokens: int
    max_model_len: int
    requested_max_model_len: int
    max_concurrency: float

    def to_dict(self) -> dict:
        """Plain JSON-serializable dict of the fields."""
        return asdict(self)


def plan_capacity(path: Path, *, max_model_len: int | None = None,
                  kv_cache_memory: int | None = None, gpu_memory_gib: float | None = None,
                  gpu_memory_utilization: float = 0.9, dtype: str | None = None,
                  block_size: int = 16, max_num_batched_tokens: int = 2048,
                  max_num_seqs: int = 64, kv_cache_dtype: str = "auto") -> CapacityPlan:
    """Plan the checkpoint at ``path`` without loading weights.

    CPU backend (no ``gpu_memory_gib``): float32, KV memory =
    ``kv_cache_memory`` (default 1 GiB, as ``serve``). GPU: dtype default
    float16, KV memory = ``gpu_memory_gib`` GiB x ``gpu_memory_utilization``
    - weights - ``activation_workspace_bytes``. ``max_model_len`` defaults to
    the model's ``max_position_embeddings`` and is capped as the engine caps
    it. ``kv_cache_dtype``: as ``serve --kv-cache-dtype`` (int8: head_dim + 4
    bytes per K or V vector). Raises ``ValueError`` for an unknown dtype, a non-float32 dtype on
    the CPU, or memory that holds no KV block; ``FileNotFoundError`` for a
    missing ``config.json`` or safetensors file.
    """
    from kvserve.model.loader import load_model_config

    model = load_model_config(Path(path))
    gpu = gpu_memory_gib is not None
    dtype = dtype or ("float16" if gpu else "float32")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    if not gpu and dtype != "float32":
        raise ValueError(f"the CPU backend runs float32, not {dtype}; "
                         "give --gpu-memory-gib to plan for a GPU")
    nbytes = DTYPE_BYTES[dtype]
    params = count_parameters(path, model)
    weights = params * nbytes
    activation = (activation_workspace_bytes(model, max_num_batched_tokens, max_num_seqs, nbytes)
                  if gpu else 0)
    memory = (_gpu_kv_memory(gpu_memory_gib, gpu_memory_utilization, weights, activation)
              if gpu else (GIB if kv_cache_memory is None else kv_cache_memory))
    requested = resolve_max_model_len(model, max_model_len)
    cache = CacheConfig(block_size=block_size, kv_cache_memory=memory,
                        kv_cache_dtype=kv_cache_dtype)
    kv = cap_to_cache(plan_kv_cache(model, cache, requested, nbytes,
                                    chunk_tokens=max_num_batched_tokens))
    return CapacityPlan(
        model=str(path), backend="cuda" if gpu else "cpu", dtype=dtype, num_parameters=params,
        weights_bytes=weights, kv_bytes_per_token=kv.bytes_per_token,
        kv_cache_dtype=kv_cache_dtype, gpu_memory_bytes=int(gpu_memory_gib * GIB) if gpu else None,
        gpu_memory_utilization=gpu_memory_utilization if gpu else None,
        activation_bytes=activation, kv_cache_memory=memory, block_size=block_size,
        num_blocks=kv.num_blocks, kv_tokens=kv.num_tokens, max_model_len=kv.max_model_len,
        requested_max_model_len=requested, max_concurrency=kv.max_concurrency)


def _gpu_kv_memory(gib: float, utilization: float, weights: int, activation: int) -> int:
    """GiB x utilization - weights - activations (bytes); ``ValueError`` if <= 0."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu memory utilization must be in (0, 1], got {utilization}")
    budget = int(gib * GIB * utilization)
    memory = budget - weights - activation
    if memory <= 0:
        raise ValueError(f"{gib} GiB x {utilization} = {budget:,} bytes leaves nothing for the "
                         f"KV cache after weights ({weights:,}) and activations ({activation:,})")
    return memory


def format_plan(plan: CapacityPlan) -> str:
    """A human-readable two-column table of ``plan``."""
    rows = [("model", plan.model), ("backend / dtype", f"{plan.backend} / {plan.dtype}"),
            ("parameters", f"{plan.num_parameters:,}"),
            ("weights", _bytes(plan.weights_bytes)),
            ("KV bytes per token", f"{plan.kv_bytes_per_token:,}" + (
                f" ({plan.kv_cache_dtype}, scales included)"
                if plan.kv_cache_dtype != "auto" else ""))]
    if plan.gpu_memory_bytes is not None:
        rows += [("GPU memory x utilization", f"{_bytes(plan.gpu_memory_bytes)} x "
                                              f"{plan.gpu_memory_utilization}"),
                 ("activation workspace (est.)", _bytes(plan.activation_bytes))]
    rows += [("KV cache memory", _bytes(plan.kv_cache_memory)),
             ("KV cache size", f"{plan.kv_tokens:,} tokens ({plan.num_blocks:,} blocks of "
                               f"{plan.block_size})"),
             ("max model len", f"{plan.max_model_len:,} tokens" + (
                 f" (capped from {plan.requested_max_model_len:,}: the cache holds less)"
                 if plan.max_model_len < plan.requested_max_model_len else "")),
             ("maximum concurrency", f"{plan.max_concurrency:.2f}x")]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _bytes(n: int) -> str:
    """``n`` bytes with a binary unit, e.g. ``1,073,741,824 (1.00 GiB)``."""
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n:,} ({n / size:.2f} {unit})"
    return f"{n:,} B"
