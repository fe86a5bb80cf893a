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
- Model parallelism (``tensor_parallel_size`` T x ``pipeline_parallel_size``
  P devices, ``plan_capacity``'s arguments; vLLM's rules, the layouts of
  ``kvserve.core.parallel``): a device is one worker, one (stage, TP rank).
  Its weights: its stage's layer tensors, sharded by the heads and MLP
  columns it holds (norms replicated), plus the embedding on the first
  stage and the final norm + LM head on the last (with tied embeddings the
  last stage holds the embedding as its LM head, as vLLM's last rank does);
  the embedding and LM head are replicated on every TP rank (kvserve does
  not shard the vocabulary, as vLLM's ``VocabParallelEmbedding`` does). Its
  KV bytes per token: 2 x stage layers x its KV heads x head_dim x dtype
  bytes. Its KV memory: ``--kv-cache-memory`` per worker on the CPU, G GiB x
  U - its weights - its activations on a GPU. The KV tokens are the
  tightest device's (every device holds every token's K/V for its layers
  and heads: vLLM takes the minimum of the workers' blocks).
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
from kvserve.core.parallel import HeadShard, pp_layer_ranges, tp_column_split, tp_head_shards

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
    from the shapes in the safetensors headers of ``path``; for a folder
    served from its GGUF (no ``*.safetensors``), those the model requires."""
    from kvserve.model.loader import _optional_tensor_shapes, expected_tensor_shapes

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        return sum(math.prod(shape) for shape in expected_tensor_shapes(model).values())
    kept = expected_tensor_shapes(model).keys() | _optional_tensor_shapes(model).keys()
    return sum(math.prod(info["shape"]) for file in files
               for name, info in read_safetensors_header(file).items() if name in kept)


def checkpoint_tensor_shapes(path: Path, model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tensors ``count_parameters`` counts (those
    ``load_weights`` keeps), from the safetensors headers of ``path``.
    Raises ``FileNotFoundError`` when there is no ``*.safetensors`` file."""
    from kvserve.model.loader import _optional_tensor_shapes, expected_tensor_shapes

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}")
    kept = expected_tensor_shapes(model).keys() | _optional_tensor_shapes(model).keys()
    return {name: tuple(info["shape"]) for file in files
            for name, info in read_safetensors_header(file).items() if name in kept}


def device_parameters(shapes: dict[str, tuple[int, ...]], model: ModelConfig, layers: range,
                      shard: HeadShard, columns: range) -> int:
    """Parameters (elements) one model-parallel device holds.

    Args:
        shapes: the checkpoint's tensors (``checkpoint_tensor_shapes``; HF
            names and shapes, ``[out, in]`` for linear layers).
        model: the whole model's config.
        layers: its pipeline stage's decoder layers (``pp_layer_ranges``).
        shard: its tensor-parallel heads (``tp_head_shards``).
        columns: its slice of the MLP intermediate size (``tp_column_split``).

    Megatron-LM's split, as vLLM's Llama: q/k/v projections by output rows
    (the heads held), o_proj by input columns (the query heads held);
    gate/up by output rows and down by input columns (``columns``); norms,
    o_proj's bias and everything outside the layers replicated. The first
    stage holds the embedding, the last the final norm and the LM head (the
    embedding itself when they are tied: ``kvserve.model.llama``, like
    vLLM's last rank); kvserve does not shard the vocabulary.
    """
    first, last = layers.start == 0, layers.stop == model.num_hidden_layers
    tied = model.tie_word_embeddings
    total = 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) in layers:
                total += _layer_tensor_share(name, n, model, shard, columns)
        elif name == "model.embed_tokens.weight":
            total += n if first or (last and tied) else 0
        elif name == "model.norm.weight" or (name == "lm_head.weight" and not tied):
            total += n if last else 0
    return total


def _layer_tensor_share(name: str, n: int, model: ModelConfig, shard: HeadShard,
                        columns: range) -> int:
    """The elements of a layer tensor of ``n`` elements that ``shard`` holds."""
    tensor = name.split(".", 3)[3]  # e.g. self_attn.q_proj.weight
    if tensor.startswith(("self_attn.q_proj.", "self_attn.o_proj.weight")):
        return n * len(shard.q_heads) // model.num_attention_heads
    if tensor.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
        return n * len(shard.kv_heads) // model.num_key_value_heads
    if tensor.startswith(("mlp.gate_proj.", "mlp.up_proj.", "mlp.down_proj.")):
        return n * len(columns) // model.intermediate_size
    return n  # norms, o_proj's bias: replicated


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
class DevicePlan:
    """One model-parallel device (a worker): pipeline stage ``stage``,
    tensor-parallel rank ``tp_rank``. Bytes unless named otherwise.

    ``layer_start`` / ``layer_stop``: its decoder layers ``[start, stop)``;
    ``q_heads`` / ``kv_heads``: the heads it holds (a replicated KV head
    once); ``num_parameters`` / ``weights_bytes``: ``device_parameters``;
    ``kv_bytes_per_token`` = 2 x its layers x its KV heads x head_dim x
    dtype bytes (int8: head_dim + 4 bytes per vector); ``activation_bytes``:
    ``activation_workspace_bytes`` of its part (logits on the last stage
    only), 0 on the CPU; ``kv_cache_memory``, ``num_blocks``, ``kv_tokens``,
    ``max_concurrency``: what its own memory holds (the concurrency at the
    plan's ``max_model_len``, after the tightest device capped it).
    """

    stage: int
    tp_rank: int
    layer_start: int
    layer_stop: int
    q_heads: int
    kv_heads: int
    num_parameters: int
    weights_bytes: int
    kv_bytes_per_token: int
    activation_bytes: int
    kv_cache_memory: int
    num_blocks: int
    kv_tokens: int
    max_concurrency: float


@dataclass(frozen=True)
class CapacityPlan:
    """Everything ``kvserve plan`` reports. Bytes unless named otherwise;
    ``gpu_memory_bytes`` / ``gpu_memory_utilization`` are None and
    ``activation_bytes`` 0 on the CPU backend.

    With model parallelism (``devices`` non-empty, one per (stage, TP rank)
    in stage-major order): ``weights_bytes``, ``kv_bytes_per_token``,
    ``activation_bytes`` and ``kv_cache_memory`` are sums over the devices,
    ``gpu_memory_bytes`` is per device, and ``num_blocks``, ``kv_tokens``
    and ``max_concurrency`` are the tightest device's (the least of each).
    """

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
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    devices: tuple[DevicePlan, ...] = ()

    def to_dict(self) -> dict:
        """Plain JSON-serializable dict of the fields (without the three
        model-parallel ones on one device, as before they existed)."""
        fields = asdict(self)
        if not self.devices:
            for name in ("tensor_parallel_size", "pipeline_parallel_size", "devices"):
                del fields[name]
        else:
            fields["devices"] = list(fields["devices"])
        return fields


def plan_capacity(path: Path, *, max_model_len: int | None = None,
                  kv_cache_memory: int | None = None, gpu_memory_gib: float | None = None,
                  gpu_memory_utilization: float = 0.9, dtype: str | None = None,
                  block_size: int = 16, max_num_batched_tokens: int = 2048,
                  max_num_seqs: int = 64, kv_cache_dtype: str = "auto",
                  tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                  pp_layer_partition: tuple[int, ...] | None = None) -> CapacityPlan:
    """Plan the checkpoint at ``path`` without loading weights.

    CPU backend (no ``gpu_memory_gib``): float32, KV memory =
    ``kv_cache_memory`` (default 1 GiB, as ``serve``). GPU: dtype default
    float16, KV memory = ``gpu_memory_gib`` GiB x ``gpu_memory_utilization``
    - weights - ``activation_workspace_bytes``. ``max_model_len`` defaults to
    the model's ``max_position_embeddings`` and is capped as the engine caps
    it. ``kv_cache_dtype``: as ``serve --kv-cache-dtype`` (int8: head_dim + 4
    bytes per K or V vector). ``tensor_parallel_size`` T,
    ``pipeline_parallel_size`` P, ``pp_layer_partition`` (layers per stage;
    None: vLLM's split): with T x P > 1 the plan of each device
    (``plan_devices``), ``kv_cache_memory`` / ``gpu_memory_gib`` then being
    per device. Raises ``ValueError`` for an unknown dtype, a non-float32
    dtype on the CPU, memory that holds no KV block, or a layout
    ``kvserve.core.parallel`` refuses; ``FileNotFoundError`` for a missing
    ``config.json`` or safetensors file.
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
    stages = pp_layer_ranges(model.num_hidden_layers, pipeline_parallel_size, pp_layer_partition)
    shards = tp_head_shards(model.num_attention_heads, model.num_key_value_heads,
                            tensor_parallel_size)
    if len(stages) * len(shards) > 1:
        return _plan_parallel(path, model, stages, shards, max_model_len=max_model_len,
                              kv_cache_memory=kv_cache_memory, gpu_memory_gib=gpu_memory_gib,
                              gpu_memory_utilization=gpu_memory_utilization, dtype=dtype,
                              block_size=block_size,
                              max_num_batched_tokens=max_num_batched_tokens,
                              max_num_seqs=max_num_seqs, kv_cache_dtype=kv_cache_dtype)
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


def plan_devices(shapes: dict[str, tuple[int, ...]], model: ModelConfig, stages: list[range],
                 shards: list[HeadShard], *, dtype_bytes: int, block_size: int,
                 max_model_len: int, kv_cache_dtype: str = "auto",
                 kv_cache_memory: int | None = None, gpu_memory_gib: float | None = None,
                 gpu_memory_utilization: float = 0.9, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 64) -> list[DevicePlan]:
    """Each device's weights and KV cache, stage-major (stage 0's TP ranks first).

    Args:
        shapes: the checkpoint's tensors (``checkpoint_tensor_shapes``).
        model: the whole model's config.
        stages: ``pp_layer_ranges``; shards: ``tp_head_shards``.
        dtype_bytes: bytes per weight and KV element (int8 KV: see
            ``kv_cache_dtype``).
        block_size: tokens per KV block; max_model_len: the requested
            length (for ``max_concurrency``, before any cap).
        kv_cache_memory: CPU: bytes of KV cache per worker (default 1 GiB;
            vLLM's ``VLLM_CPU_KVCACHE_SPACE`` is per worker too).
        gpu_memory_gib, gpu_memory_utilization: GPU: each device's memory;
            its KV memory is G GiB x U - its weights - its activations.
        max_num_batched_tokens, max_num_seqs: the activation estimate's
            (and the sliding-window blocks') step budget.

    Raises:
        ValueError: a device whose memory holds no KV block, or nothing
            after its weights and activations (the message names it).
    """
    gpu = gpu_memory_gib is not None
    columns = tp_column_split(model.intermediate_size, len(shards))
    devices = []
    for stage, layers in enumerate(stages):
        last = stage == len(stages) - 1
        for shard in shards:
            part = device_model_config(model, layers, shard, columns[shard.rank])
            params = device_parameters(shapes, model, layers, shard, columns[shard.rank])
            weights = params * dtype_bytes
            where = f"stage {stage}, TP rank {shard.rank}"
            try:
                activation = (activation_workspace_bytes(
                    part, max_num_batched_tokens, max_num_seqs if last else 0, dtype_bytes)
                    if gpu else 0)
                memory = (_gpu_kv_memory(gpu_memory_gib, gpu_memory_utilization, weights,
                                         activation)
                          if gpu else (GIB if kv_cache_memory is None else kv_cache_memory))
                kv = plan_kv_cache(part, CacheConfig(block_size=block_size, kv_cache_memory=memory,
                                                     kv_cache_dtype=kv_cache_dtype),
                                   max_model_len, dtype_bytes, chunk_tokens=max_num_batched_tokens)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            devices.append(DevicePlan(
                stage=stage, tp_rank=shard.rank, layer_start=layers.start,
                layer_stop=layers.stop, q_heads=len(shard.q_heads),
                kv_heads=len(shard.kv_heads), num_parameters=params, weights_bytes=weights,
                kv_bytes_per_token=kv.bytes_per_token, activation_bytes=activation,
                kv_cache_memory=memory, num_blocks=kv.num_blocks, kv_tokens=kv.num_tokens,
                max_concurrency=kv.max_concurrency))
    return devices


def _plan_parallel(path: Path, model: ModelConfig, stages: list[range],
                   shards: list[HeadShard], *, max_model_len: int | None,
                   kv_cache_memory: int | None, gpu_memory_gib: float | None,
                   gpu_memory_utilization: float, dtype: str, block_size: int,
                   max_num_batched_tokens: int, max_num_seqs: int,
                   kv_cache_dtype: str) -> CapacityPlan:
    """``plan_capacity`` over several devices: sums, and the least KV tokens,
    blocks and concurrency of any device (at the model length they cap)."""
    gpu = gpu_memory_gib is not None
    if gpu and not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu memory utilization must be in (0, 1], got {gpu_memory_utilization}")
    requested = resolve_max_model_len(model, max_model_len)
    shapes = checkpoint_tensor_shapes(path, model)

    def devices_at(length: int) -> list[DevicePlan]:
        return plan_devices(
            shapes, model, stages, shards, dtype_bytes=DTYPE_BYTES[dtype],
            block_size=block_size, max_model_len=length, kv_cache_dtype=kv_cache_dtype,
            kv_cache_memory=kv_cache_memory, gpu_memory_gib=gpu_memory_gib,
            gpu_memory_utilization=gpu_memory_utilization,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)

    devices = devices_at(requested)
    tightest = min(d.kv_tokens for d in devices)
    capped = min(requested, tightest)  # the engine's rule: a request must fit alone
    if capped < requested:
        devices = devices_at(capped)
    return CapacityPlan(
        model=str(path), backend="cuda" if gpu else "cpu", dtype=dtype,
        num_parameters=count_parameters(path, model),
        weights_bytes=sum(d.weights_bytes for d in devices),
        kv_bytes_per_token=sum(d.kv_bytes_per_token for d in devices),
        kv_cache_dtype=kv_cache_dtype, gpu_memory_bytes=int(gpu_memory_gib * GIB) if gpu else None,
        gpu_memory_utilization=gpu_memory_utilization if gpu else None,
        activation_bytes=sum(d.activation_bytes for d in devices),
        kv_cache_memory=sum(d.kv_cache_memory for d in devices), block_size=block_size,
        num_blocks=min(d.num_blocks for d in devices), kv_tokens=tightest,
        max_model_len=capped, requested_max_model_len=requested,
        max_concurrency=min(d.max_concurrency for d in devices),
        tensor_parallel_size=len(shards), pipeline_parallel_size=len(stages),
        devices=tuple(devices))


def device_model_config(model: ModelConfig, layers: range, shard: HeadShard,
                        columns: range) -> ModelConfig:
    """The config of one device's part of ``model``: its stage's layers (and
    their ``layer_types``), its query and KV heads, its MLP columns; what its
    KV cache and activations are sized by."""
    return replace(model, num_hidden_layers=len(layers),
                   layer_types=model.layer_types[layers.start:layers.stop],
                   num_attention_heads=len(shard.q_heads),
                   num_key_value_heads=len(shard.kv_heads), intermediate_size=len(columns))


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
    """A human-readable two-column table of ``plan``; with model
    parallelism, the sums, then one row per device and the tightest
    device's KV tokens."""
    if plan.devices:
        return _format_parallel_plan(plan)
    return _aligned(_summary_rows(plan))


def _summary_rows(plan: CapacityPlan) -> list[tuple[str, str]]:
    """The plan's summary lines, ``(name, value)``; over several devices the
    byte figures are sums, the memory per device, the blocks the tightest
    device's."""
    many = bool(plan.devices)
    t, p = plan.tensor_parallel_size, plan.pipeline_parallel_size
    every, each = (" (all devices)", " (each)") if many else ("", "")
    rows = [("model", plan.model), ("backend / dtype", f"{plan.backend} / {plan.dtype}"),
            ("parameters", f"{plan.num_parameters:,}")]
    if many:
        rows.append(("devices", f"{t * p} ({p} pipeline stage{'s' * (p > 1)} x {t} "
                                f"tensor-parallel rank{'s' * (t > 1)})"))
    rows += [(f"weights{every}", _bytes(plan.weights_bytes)),
             (f"KV bytes per token{every}", f"{plan.kv_bytes_per_token:,}" + (
                 f" ({plan.kv_cache_dtype}, scales included)"
                 if plan.kv_cache_dtype != "auto" else ""))]
    if plan.gpu_memory_bytes is not None:
        rows += [(f"GPU memory x utilization{each}", f"{_bytes(plan.gpu_memory_bytes)} x "
                                                     f"{plan.gpu_memory_utilization}"),
                 ("activation workspace (all, est.)" if many else "activation workspace (est.)",
                  _bytes(plan.activation_bytes))]
    rows += [(f"KV cache memory{every}", _bytes(plan.kv_cache_memory)),
             ("KV cache size", f"{plan.kv_tokens:,} tokens ({plan.num_blocks:,} blocks of "
                               f"{plan.block_size}" + (" on the tightest device)" if many
                                                       else ")")),
             ("max model len", f"{plan.max_model_len:,} tokens" + (
                 f" (capped from {plan.requested_max_model_len:,}: the cache holds less)"
                 if plan.max_model_len < plan.requested_max_model_len else "")),
             ("maximum concurrency", f"{plan.max_concurrency:.2f}x")]
    return rows


def _aligned(rows: list[tuple[str, str]]) -> str:
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _format_parallel_plan(plan: CapacityPlan) -> str:
    """``format_plan`` of a plan over several devices."""
    lines = [_aligned(_summary_rows(plan))]
    table = [("stage", "tp rank", "layers", "q/KV heads", "weights MiB", "KV bytes/token",
              "KV tokens")]
    table += [(str(d.stage), str(d.tp_rank), f"{d.layer_start}-{d.layer_stop - 1}",
               f"{d.q_heads}/{d.kv_heads}", f"{d.weights_bytes / 1024**2:,.2f}",
               f"{d.kv_bytes_per_token:,}", f"{d.kv_tokens:,}") for d in plan.devices]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines += [""] + ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in table]
    lines.append(f"KV tokens: {plan.kv_tokens:,} (the tightest device)")
    return "\n".join(lines)


def _bytes(n: int) -> str:
    """``n`` bytes with a binary unit, e.g. ``1,073,741,824 (1.00 GiB)``."""
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n:,} ({n / size:.2f} {unit})"
    return f"{n:,} B"
