"""The ops interface that the model code (``kvserve.model.llama``) is written against.

Each backend (``kvserve.cpu.ops.CpuOps``, the CUDA backend) implements
:class:`Ops`.  Arrays are backend arrays (NumPy on the CPU, CuPy on CUDA);
the shapes below use T = tokens in the flat varlen batch (prefill chunks and
decode tokens of S sequences mixed), H = hidden size, nh / nkv = query / KV
heads, hd = head dim.

Paged KV cache and attention metadata (DESIGN.md section 3, vLLM's layout):

* ``kv_cache``: one buffer per layer,
  ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (axis 1: 0 = K, 1 = V).
* ``slot_mapping``: int64[T]; token t's K/V goes to block
  ``slot // block_size``, offset ``slot % block_size``; negative = don't write.
* ``query_start_loc``: int32[S+1]; sequence s owns the flat tokens
  ``query_start_loc[s]:query_start_loc[s+1]`` (its new tokens this step).
* ``seq_lens``: int32[S]; context length of s after this step (cached + new),
  so new token i of s is at position ``seq_lens[s] - n_new_s + i``.
* ``block_tables``: int32[S, max_blocks]; physical block ids in logical order
  (entries beyond the used ones are ignored).
* ``window`` (attention of a sliding-window layer, Gemma 3): 0 = full causal
  attention; ``window`` > 0: the query at position p sees the keys at positions
  j with ``p - window < j <= p``. Blocks wholly before the window of a
  sequence's first new token may hold another request's K/V (the KV manager
  frees them): a kernel never reads them (a NaN there must not reach the
  output), and their block-table entries are not checked.

Errors: inconsistent shapes, dtypes that cannot be used in place, and indices
out of range (token ids, slots, block ids, positions) raise ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class StepGeometry:
    """What a step's indices are checked against: ``vocab_size`` rows of the
    embedding, ``max_position`` rows of the RoPE table, ``num_blocks`` KV
    blocks of ``block_size`` tokens."""

    vocab_size: int
    max_position: int
    num_blocks: int
    block_size: int


@dataclass(frozen=True)
class DecodePath:
    """The path a model's decode and verification steps take on a backend,
    chosen once when the model is built (``Ops.decode_path``) and named in
    the start-up log (``decode_path``) and the ``decode_path_info`` metric.

    ``path``: ``"fused"`` (every layer of a step of short queries in one
    compiled call, ``Ops.decode_layers``; a step it does not take, such as
    a long prompt chunk, still runs op by op) or ``"ops"`` (op by op);
    ``reason``: why, in words."""

    path: str
    reason: str

    @property
    def fused(self) -> bool:
        return self.path == "fused"


@runtime_checkable
class Ops(Protocol):
    """Backend operations used by the model forward pass."""

    name: str
    """Backend name: ``"cpu"`` or ``"cuda"``."""

    #: The array module of this backend's arrays (``numpy``, ``cupy``).
    xp: Any

    def decode_path(self, model: Any) -> DecodePath:
        """The path ``model`` 's (a ``LlamaModel``) decode steps take here,
        decided from the model and the backend's settings alone."""
        ...

    def decode_layers(self, hidden: Any, model: Any, positions: Any, attn: Any,
                      kv_caches: list, x: Any = None) -> tuple[Any, Any] | None:
        """Every layer of a step of short queries in one call, where
        ``decode_path`` said ``fused``: ``(x, residual)`` before the final
        norm, as ``LlamaModel`` 's layers leave them, or None for a step it
        does not take (the model then runs it op by op). ``x``: a later
        pipeline stage's input (``hidden`` is then its residual stream)."""
        ...

    def embedding(self, token_ids: Any, table: Any) -> Any:
        """Row lookup: ``table[token_ids]``.

        token_ids: int64[T]; table: [V, H].  Returns [T, H] (table's dtype).
        Raises ValueError for an id outside [0, V).
        """
        ...

    def linear(self, x: Any, weight: Any, bias: Any | None = None) -> Any:
        """``x @ weight.T (+ bias)`` (PyTorch nn.Linear convention).

        x: [T, in]; weight: [out, in]; bias: [out] or None.  Returns a new
        [T, out] array.  Raises ValueError if the inner dimensions differ.
        """
        ...

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        """``x / sqrt(mean(x**2, -1) + eps) * weight`` (HF LlamaRMSNorm).

        x: [T, H]; weight: [H]; eps: float.  Returns a new [T, H] array.
        """
        ...

    def fused_add_rms_norm(self, x: Any, residual: Any, weight: Any, eps: float,
                           x_weight: Any | None = None) -> None:
        """In place: ``residual += x; x[:] = rms_norm(residual, weight, eps)``.

        vLLM's ``fused_add_rms_norm`` convention (one pass instead of three).
        x, residual: [T, H], distinct contiguous buffers; weight: [H].
        ``x_weight`` [H] given (Gemma 3's ``post_attention_layernorm`` and
        ``post_feedforward_layernorm``, applied to a block's output before
        its residual add): ``x`` is first ``rms_norm(x, x_weight, eps)``,
        rounded to x's dtype, then added.
        """
        ...

    def rotary_embedding(self, positions: Any, q: Any, k: Any, cos_sin_cache: Any,
                         head_dim: int) -> None:
        """In-place rotary position embedding of q and k, NeoX / HF style.

        positions: int64[T]; q: [T, nh*hd] or [T, nh, hd]; k: [T, nkv*hd] or
        [T, nkv, hd] (both contiguous, modified in place); cos_sin_cache:
        [max_position, hd] from ``build_rope_cache`` (cos in the first half of
        a row, sin in the second).  Pairs element i with i + hd/2 (HF
        ``rotate_half``): ``x1' = x1 cos - x2 sin``, ``x2' = x2 cos + x1 sin``.
        Raises ValueError for a position outside [0, max_position).
        """
        ...

    def write_kv(self, k: Any, v: Any, kv_cache: Any, slot_mapping: Any) -> None:
        """Scatter the new tokens' K/V into the paged cache.

        k, v: [T, nkv, hd]; kv_cache: [num_blocks, 2, block_size, nkv, hd];
        slot_mapping: int64[T], negative entries skipped.  Raises ValueError
        for a slot beyond ``num_blocks * block_size``.
        """
        ...

    def paged_attention(self, q: Any, kv_cache: Any, block_tables: Any, seq_lens: Any,
                        query_start_loc: Any, scale: float, plan: Any = None,
                        window: int = 0) -> Any:
        """Causal attention of every new token over its sequence's paged context
        (over its last ``window`` positions when ``window`` > 0; module doc).

        q: [T, nh, hd]; kv_cache as above (the new tokens' K/V already
        written); block_tables: int32[S, max_blocks]; seq_lens: int32[S];
        query_start_loc: int32[S+1]; scale: usually hd ** -0.5.  GQA: query
        head h reads KV head ``h // (nh // nkv)``.  ``plan``: what
        ``prepare_step`` returned for the step these arrays belong to (a
        backend may use its precomputed work; None: plan here).  Returns a
        new [T, nh, hd] array; rows of tokens owned by no sequence are zero.
        Raises ValueError on inconsistent metadata or block ids out of range.
        """
        ...

    def rope_kv_attention(self, qkv: Any, positions: Any, cos_sin_cache: Any, kv_cache: Any,
                          attn: Any, scale: float, num_heads: int, num_kv_heads: int,
                          head_dim: int, window: int = 0, qk_norm: QKNorm | None = None) -> Any:
        """The attention block after the fused QKV projection: (with
        ``qk_norm``, ``rms_norm`` of every query and key head,) ``rotary_embedding``
        of q and k, ``write_kv`` of k and v, then ``paged_attention`` with
        ``window`` (``compose_rope_kv_attention`` is the reference
        composition; a backend may fuse it).

        qkv: [T, (nh + 2 nkv) * hd] (query heads, key heads, value heads;
        not modified); positions: int64[T]; attn: the step's
        ``AttentionMetadata``.  Returns a new [T, nh, hd] array.  Raises
        ValueError as the ops do.
        """
        ...

    def prepare_step(self, batch: Any, geometry: StepGeometry) -> Any:
        """A step's inputs on the backend, from a host ``BatchInputs``.

        Returns an object with the batch's arrays as backend arrays
        (``input_ids``, ``positions``, ``slot_mapping``, ``block_tables``,
        ``seq_lens``, ``query_start_loc``, ``logits_indices``), to pass on as
        ``AttentionMetadata.plan``.  Raises ValueError for an index outside
        ``geometry`` (a backend that checks on the host).
        """
        ...

    def silu_and_mul(self, x: Any) -> Any:
        """``silu(x[:, :I]) * x[:, I:]`` with silu(a) = a * sigmoid(a).

        x: [T, 2*I] (gate then up, as the gate_up projection).  Returns [T, I].
        """
        ...

    def gelu_tanh_and_mul(self, x: Any) -> Any:
        """``gelu_tanh(x[:, :I]) * x[:, I:]`` (GeGLU, Gemma's MLP), with
        ``gelu_tanh(a) = 0.5 a (1 + tanh(sqrt(2 / pi) (a + 0.044715 a**3)))``
        (PyTorch's ``gelu(approximate="tanh")``, Hugging Face's
        ``gelu_pytorch_tanh``).

        x: [T, 2*I] (gate then up).  Returns a new [T, I].  Raises ValueError
        for an odd last dimension.
        """
        ...

    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_kv_heads: int,
                          head_dim: int, kv_cache_dtype: str = "auto") -> Any:
        """One layer's zeroed KV cache: ``auto``, [num_blocks, 2, block_size,
        nkv, hd] in the compute dtype; ``int8``, int8 [num_blocks, 2,
        block_size, nkv, hd + 4] (codes and a float32 scale per vector,
        ``kvserve.model.kv_quant``), which every op taking ``kv_cache``
        accepts as well, telling the two apart by dtype. Raises ValueError
        for a non-positive dimension or another ``kv_cache_dtype``."""
        ...

    def to_device(self, array: np.ndarray) -> Any:
        """Host NumPy array -> backend array (the backend's compute dtype for floats)."""
        ...

    def to_numpy(self, array: Any) -> np.ndarray:
        """Backend array -> host NumPy array."""
        ...


class QKNorm(NamedTuple):
    """RMSNorm weights of every query head and every key head, applied before
    RoPE (Qwen3's and Gemma 3's ``q_norm`` / ``k_norm``): [hd] each, of the
    activations' dtype; ``eps`` the model's ``rms_norm_eps``."""

    q_weight: Any
    k_weight: Any
    eps: float


def compose_rope_kv_attention(ops: Ops, qkv: Any, positions: Any, cos_sin_cache: Any,
                              kv_cache: Any, attn: Any, scale: float, num_heads: int,
                              num_kv_heads: int, head_dim: int, window: int = 0,
                              qk_norm: QKNorm | None = None) -> Any:
    """``Ops.rope_kv_attention`` as its ops: q and k copied out of ``qkv``
    (normed head by head with ``qk_norm``) and rotated, k and v (a view of
    ``qkv``) written, then paged attention (``window`` passed on only when >
    0, so that full attention calls ``paged_attention`` exactly as before
    windows existed). Shapes and errors as ``Ops.rope_kv_attention``."""
    t = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].copy()
    k = qkv[:, q_size:q_size + kv_size].copy()
    if qk_norm is not None:  # rows of head_dim, one per head
        q = ops.rms_norm(q.reshape(t * num_heads, head_dim), qk_norm.q_weight,
                         qk_norm.eps).reshape(t, q_size)
        k = ops.rms_norm(k.reshape(t * num_kv_heads, head_dim), qk_norm.k_weight,
                         qk_norm.eps).reshape(t, kv_size)
    v = qkv[:, q_size + kv_size:].reshape(t, num_kv_heads, head_dim)
    ops.rotary_embedding(positions, q, k, cos_sin_cache, head_dim)
    ops.write_kv(k.reshape(t, num_kv_heads, head_dim), v, kv_cache, attn.slot_mapping)
    windowed = {"window": int(window)} if window else {}
    return ops.paged_attention(q.reshape(t, num_heads, head_dim), kv_cache, attn.block_tables,
                               attn.seq_lens, attn.query_start_loc, scale,
                               plan=getattr(attn, "plan", None), **windowed)


def build_rope_cache(head_dim: int, max_position: int, theta: float) -> np.ndarray:
    """Rotary cos/sin table for positions 0..max_position-1.

    Returns float32[max_position, head_dim]: row p is
    ``[cos(p * f_0), ..., cos(p * f_{hd/2-1}), sin(p * f_0), ..., sin(p * f_{hd/2-1})]``
    with ``f_i = theta ** (-2i / head_dim)`` (HF LlamaRotaryEmbedding's
    inv_freq, default rope type).  Angles are computed in float64 and the
    result cast to float32 (HF computes them in float32, so at large positions
    the two differ by about one float32 ulp of the angle).

    Raises ValueError for an odd or non-positive head_dim, a non-positive
    max_position or theta.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"build_rope_cache: head_dim must be positive and even, got {head_dim}")
    if max_position <= 0:
        raise ValueError(f"build_rope_cache: max_position must be positive, got {max_position}")
    if not theta > 0:
        raise ValueError(f"build_rope_cache: theta must be positive, got {theta}")
    inv_freq = 1.0 / (float(theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = np.arange(max_position, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)
