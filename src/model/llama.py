"""Llama-family forward pass over a flat varlen batch (prefill chunks and decodes mixed).

The batch is one flat run of T tokens from S sequences. Each layer first
writes the new tokens' K/V into the paged KV cache through ``slot_mapping``,
then runs paged attention, which reads every sequence's context (cached and
new) through its block table. So a prefill chunk, a decode token, or a
request reusing prefix-cached blocks are all the same computation.

Written once against ``kvserve.model.ops.Ops``; the backend (CPU or CUDA)
supplies the kernels. Covers the ``llama``, ``mistral`` and ``qwen2``
``model_type``s: GQA, optional q/k/v bias, tied or untied LM head, RoPE theta.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvserve.config import ModelConfig
from kvserve.model.ggml_blocks import BlockQuantizedWeight, concat_rows
from kvserve.model.ops import Ops, StepGeometry, build_rope_cache
from kvserve.model.quantization import LinearWeight, quantize_weight

if TYPE_CHECKING:
    from kvserve.model.input_batch import BatchInputs


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each token's K/V goes and what each sequence attends to.

    Arrays are backend arrays (NumPy on the CPU):

    - ``slot_mapping``: int64[T], ``block_id * block_size + offset`` per token.
    - ``block_tables``: int32[S, max_blocks], physical block ids per sequence.
    - ``seq_lens``: int32[S], context length of each sequence after this step.
    - ``query_start_loc``: int32[S + 1], sequence s owns tokens
      ``query_start_loc[s]:query_start_loc[s+1]``.
    - ``plan``: the backend's ``prepare_step`` result these arrays come
      from (its precomputed attention work), or None.
    """

    slot_mapping: Any
    block_tables: Any
    seq_lens: Any
    query_start_loc: Any
    plan: Any = None


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer, with q/k/v and gate/up fused into single matrices.

    Shapes: ``qkv`` [(nh + 2 nkv) * hd, H], ``o_proj`` [H, nh * hd],
    ``gate_up`` [2 I, H], ``down`` [H, I], norms [H].
    """

    input_norm: Any
    qkv: Any
    qkv_bias: Any | None
    o_proj: Any
    post_norm: Any
    gate_up: Any
    down: Any


class LlamaModel:
    """Weights on the backend plus ``forward``.

    Args:
        config: the checkpoint's architecture.
        weights: Hugging Face-named float arrays (``kvserve.model.loader``).
        ops: the backend's kernels.
        quantization: ``none``, ``int8`` or ``w8a8`` for the attention and MLP
            projections (``kvserve.model.quantization``; embeddings, norms
            and the LM head stay float), or ``q4``, with ``weights`` holding
            ``BlockQuantizedWeight`` s for the tensors the GGUF stores in blocks.

    Raises:
        KeyError: a tensor the architecture needs is missing.
        ValueError: an unknown quantization.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], ops: Ops,
                 quantization: str = "none") -> None:
        self.config = config
        self.ops = ops
        self.quantization = quantization
        self.embed_tokens = self._table(weights["model.embed_tokens.weight"])
        self.final_norm = ops.to_device(weights["model.norm.weight"])
        if config.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = self._table(weights["lm_head.weight"])
        self.layers = [self._load_layer(weights, i) for i in range(config.num_hidden_layers)]
        self.rope_cache = ops.to_device(build_rope_cache(
            config.head_dim, config.max_position_embeddings, config.rope_theta))
        self.scale = config.head_dim ** -0.5

    def _table(self, table: np.ndarray | BlockQuantizedWeight) -> LinearWeight:
        """An embedding / LM head table on the backend: dense, or (``q4``) GGUF blocks."""
        if isinstance(table, BlockQuantizedWeight):
            return quantize_weight(table, self.quantization, self.ops.to_device)
        return self.ops.to_device(table)

    def _load_layer(self, w: dict[str, np.ndarray], i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        attn = [w[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"]
        bias = None
        if f"{p}self_attn.q_proj.bias" in w:
            bias = self.ops.to_device(np.concatenate(
                [w[f"{p}self_attn.{n}_proj.bias"] for n in "qkv"]))
        gate_up = _fuse([w[f"{p}mlp.gate_proj.weight"], w[f"{p}mlp.up_proj.weight"]])
        to = self.ops.to_device

        def linear(weight: np.ndarray) -> LinearWeight:
            return quantize_weight(weight, self.quantization, to)

        return LayerWeights(
            input_norm=to(w[f"{p}input_layernorm.weight"]),
            qkv=linear(_fuse(attn)),
            qkv_bias=bias,
            o_proj=linear(w[f"{p}self_attn.o_proj.weight"]),
            post_norm=to(w[f"{p}post_attention_layernorm.weight"]),
            gate_up=linear(gate_up),
            down=linear(w[f"{p}mlp.down_proj.weight"]),
        )

    @property
    def weights_nbytes(self) -> int:
        """Bytes of every weight on the backend (a tied LM head counted once)."""
        arrays = [self.embed_tokens, self.final_norm]
        if self.lm_head is not self.embed_tokens:
            arrays.append(self.lm_head)
        for layer in self.layers:
            arrays += [a for a in vars(layer).values() if a is not None]
        return sum(int(a.nbytes) for a in arrays)


    def forward(self, input_ids: Any, positions: Any, attn: AttentionMetadata,
                kv_caches: list[Any], logits_indices: Any) -> Any:
        """Run all layers and return logits of the sampling positions:
        ``compute_logits(hidden_states(...))`` (same arguments as
        ``hidden_states``). Returns float32[R, vocab_size]."""
        return self.compute_logits(
            self.hidden_states(input_ids, positions, attn, kv_caches, logits_indices))

    def compute_logits(self, hidden: Any) -> Any:
        """LM head: [R, H] final hidden states -> float32[R, vocab_size] logits.

        Separate from the layers (vLLM's ``compute_logits``) so that a caller
        needing many rows (prompt logprobs) can bound the [rows, vocab] block
        by calling it on slices.
        """
        return self.ops.linear(hidden, self.lm_head)

    def batch_hidden_states(self, batch: BatchInputs, kv_caches: list[Any]) -> Any:
        """``hidden_states`` of a host-built flat batch (``InputBatch.build``):
        its arrays checked and moved to the backend by ``Ops.prepare_step``
        (one copy on a GPU); [R, H] for its ``logits_indices``."""
        cache = kv_caches[0]
        step = self.ops.prepare_step(batch, StepGeometry(
            vocab_size=self.config.vocab_size, max_position=int(self.rope_cache.shape[0]),
            num_blocks=int(cache.shape[0]), block_size=int(cache.shape[2])))
        attn = AttentionMetadata(slot_mapping=step.slot_mapping, block_tables=step.block_tables,
                                 seq_lens=step.seq_lens, query_start_loc=step.query_start_loc,
                                 plan=step)
        return self.hidden_states(step.input_ids, step.positions, attn, kv_caches,
                                  step.logits_indices)

    def hidden_states(self, input_ids: Any, positions: Any, attn: AttentionMetadata,
                      kv_caches: list[Any], logits_indices: Any) -> Any:
        """Run all layers; the final-normed hidden states of the sampling positions.

        Args:
            input_ids: int64[T] token ids of the flat batch.
            positions: int64[T] absolute position of each token in its sequence.
            attn: paging metadata for the batch.
            kv_caches: one buffer per layer, float[num_blocks, 2, block_size, nkv, hd].
            logits_indices: int64[R], the rows of the batch whose next token is
                sampled (the last token of each sequence that finishes its prompt
                or decodes). The LM head runs on these rows only.

        Returns:
            [R, H] hidden states after the final norm (the LM head's input).
        """
        ops, cfg = self.ops, self.config
        hidden = ops.embedding(input_ids, self.embed_tokens)
        # A backend may run a decode-only step's layers in one compiled call
        # (CpuOps.decode_layers); None where it does not apply.
        fused = getattr(ops, "decode_layers", None)
        done = fused(hidden, self, positions, attn, kv_caches) if fused is not None else None
        x, residual = done if done is not None else self._layers(hidden, positions, attn,
                                                                 kv_caches)
        # Only the sampled rows need the final norm and the LM head.
        x, residual = x[logits_indices], residual[logits_indices]
        ops.fused_add_rms_norm(x, residual, self.final_norm, cfg.rms_norm_eps)
        return x

    def _layers(self, hidden: Any, positions: Any, attn: AttentionMetadata,
                kv_caches: list[Any]) -> tuple[Any, Any]:
        """Every layer, op by op: ``(x, residual)`` before the final norm."""
        ops, cfg = self.ops, self.config
        residual = hidden
        x = ops.rms_norm(hidden, self.layers[0].input_norm, cfg.rms_norm_eps)
        for i, layer in enumerate(self.layers):
            if i > 0:
                ops.fused_add_rms_norm(x, residual, layer.input_norm, cfg.rms_norm_eps)
            x = self._attention(layer, x, positions, attn, kv_caches[i])
            ops.fused_add_rms_norm(x, residual, layer.post_norm, cfg.rms_norm_eps)
            x = ops.linear(ops.silu_and_mul(ops.linear(x, layer.gate_up)), layer.down)
        return x, residual

    def _attention(self, layer: LayerWeights, x: Any, positions: Any,
                   attn: AttentionMetadata, kv_cache: Any) -> Any:
        cfg, ops = self.config, self.ops
        hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        qkv = ops.linear(x, layer.qkv, layer.qkv_bias)
        out = ops.rope_kv_attention(qkv, positions, self.rope_cache, kv_cache, attn, self.scale,
                                    nh, nkv, hd)
        return ops.linear(out.reshape(x.shape[0], nh * hd), layer.o_proj)


def _fuse(weights: list) -> np.ndarray | BlockQuantizedWeight:
    """Stack [out_i, in] weights along out: dense arrays or GGUF blocks of one kind."""
    if all(isinstance(w, BlockQuantizedWeight) for w in weights):
        return concat_rows(weights)
    if any(isinstance(w, BlockQuantizedWeight) for w in weights):
        raise ValueError("cannot fuse GGUF-block and float weights into one projection; "
                         "the GGUF stores them in different types")
    return np.concatenate(weights)
