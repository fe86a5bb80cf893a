"""Llama-family forward pass over a flat varlen batch (prefill chunks and decodes mixed).

The batch is one flat run of T tokens from S sequences. Each layer first
writes the new tokens' K/V into the paged KV cache through ``slot_mapping``,
then runs paged attention, which reads every sequence's context (cached and
new) through its block table. So a prefill chunk, a decode token, or a
request reusing prefix-cached blocks are all the same computation.

Written once against ``kvserve.model.ops.Ops``; the backend (CPU or CUDA)
supplies the kernels. Covers the ``llama``, ``mistral`` and ``qwen2``
``model_type``s: GQA, optional q/k/v bias, tied or untied LM head, RoPE theta;
and Gemma 3 (``gemma3_text``) through ``ModelConfig`` fields, each a small
piece of the same layer loop (Hugging Face ``modeling_gemma3.py``):

- the embedding rows times ``embedding_multiplier`` (sqrt(hidden), float32);
- every norm ``x * (1 + w)``: the offset is folded into the weights at load;
- ``qk_norm``: RMSNorm of each query and key head (weight [head_dim]) before RoPE;
- ``sandwich_norms``: the attention output and the MLP output are normed
  before their residual adds (``post_attention_layernorm``,
  ``post_feedforward_layernorm``) and the MLP input by its own norm
  (``pre_feedforward_layernorm``, where Llama uses ``post_attention_layernorm``);
- GeGLU (``gelu_tanh_and_mul``) instead of SwiGLU;
- per layer a :class:`LayerRecipe`: sliding layers attend to their last
  ``sliding_window`` positions with a RoPE base of ``rope_local_base_freq``,
  full layers to the whole context with ``rope_theta``;
- the attention scale ``query_pre_attn_scalar ** -0.5``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvserve.config import ModelConfig
from kvserve.core.kv_layout import model_kv_layout
from kvserve.model.ggml_blocks import (BlockQuantizedWeight, KQuantWeight, StackedWeight,
                                      concat_rows, dequantize, fuse_adjacent)
from kvserve.model.ops import DecodePath, Ops, QKNorm, StepGeometry, build_rope_cache
from kvserve.model.quantization import LinearWeight, quantize_weight
from kvserve.model.rope import rope_table

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
    ``gate_up`` [2 I, H], ``down`` [H, I], norms [H] (``q_norm``,
    ``k_norm``: [hd]), with any norm offset already added.

    ``post_norm`` is the norm of the MLP's input (Llama's
    ``post_attention_layernorm``, Gemma's ``pre_feedforward_layernorm``);
    Gemma alone has ``attn_out_norm`` (its ``post_attention_layernorm``, on
    the attention output), ``mlp_out_norm`` (``post_feedforward_layernorm``)
    and ``q_norm`` / ``k_norm``; they are None otherwise.
    """

    input_norm: Any
    qkv: Any
    qkv_bias: Any | None
    o_proj: Any
    post_norm: Any
    gate_up: Any
    down: Any
    q_norm: Any | None = None
    k_norm: Any | None = None
    attn_out_norm: Any | None = None
    mlp_out_norm: Any | None = None


@dataclass(frozen=True)
class LayerRecipe:
    """How one layer attends: its RoPE table (a backend array
    [max_position, hd] from ``build_rope_cache``, shared by the layers of one
    base) and its window (0: the whole causal context; else the sliding
    window in tokens, ``Ops.paged_attention``)."""

    rope_cache: Any
    window: int


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
        layer_range: the decoder layers this model holds (a pipeline stage,
            ``kvserve.core.parallel.pp_layer_ranges``); None: all. The first
            stage holds the embedding, the last the final norm and the LM
            head (and the embedding too when they are tied, as vLLM's last
            rank does); ``weights`` needs only those tensors.
        all_reduce: a tensor-parallel shard's sum over its workers, called
            in place on the attention output projection's [T, H] result and
            the MLP down projection's (Megatron-LM's two all-reduces a
            layer); None without tensor parallelism. ``config`` is then the
            shard's (its heads and intermediate size).

    Attributes beyond the weights: ``rope_cache`` (the full layers' RoPE
    table), ``recipes`` (one :class:`LayerRecipe` per layer), ``scale``
    (``config.attention_scale``), ``kv_layout`` (the KV-cache groups of
    ``kvserve.core.kv_layout``, whose ``layer_group[i]`` picks layer i's
    metadata when ``hidden_states`` gets one ``AttentionMetadata`` per group).

    Raises:
        KeyError: a tensor the architecture needs is missing.
        ValueError: an unknown quantization.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], ops: Ops,
                 quantization: str = "none", layer_range: range | None = None,
                 all_reduce: Callable[[Any], None] | None = None) -> None:
        self.config = config
        self.ops = ops
        self.quantization = quantization
        self.layer_range = layer_range or range(config.num_hidden_layers)
        self.is_first = self.layer_range.start == 0
        self.is_last = self.layer_range.stop == config.num_hidden_layers
        self.all_reduce = all_reduce
        self.embed_tokens = self.final_norm = self.lm_head = None
        if self.is_first or (self.is_last and config.tie_word_embeddings):
            self.embed_tokens = self._table(weights["model.embed_tokens.weight"])
        if self.is_last:
            self.final_norm = self._norm(weights["model.norm.weight"])
            self.lm_head = (self.embed_tokens if config.tie_word_embeddings
                            else self._table(weights["lm_head.weight"]))
        self.layers = [self._load_layer(weights, i) for i in self.layer_range]
        self.rope_cache = ops.to_device(rope_table(
            config.rope, config.head_dim, config.max_position_embeddings))
        self.recipes = self._recipes()
        self.scale = config.attention_scale
        # the Ops method of each ModelConfig.hidden_activation
        self.activation = {"silu": ops.silu_and_mul,
                           "gelu_pytorch_tanh": ops.gelu_tanh_and_mul}[config.hidden_activation]
        self.kv_layout = model_kv_layout(config)
        self.choose_decode_path()

    def choose_decode_path(self) -> DecodePath:
        """Ask the backend once which path this model's decode steps take
        (``Ops.decode_path``) and keep it in ``decode_path``; called when the
        model is built, and again by whoever changes the backend's decode
        setting (``CpuOps.fused_decode``: tests, tools/profile_decode_step.py)."""
        self.decode_path = self.ops.decode_path(self)
        return self.decode_path

    def _recipes(self) -> list[LayerRecipe]:
        """Each layer's RoPE table and window: sliding layers get the table of
        ``rope_local_base_freq`` (built once, if any layer slides), full
        layers ``rope_cache``."""
        cfg = self.config
        windows = [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)]
        local = self.rope_cache
        base = cfg.rope_local_base_freq
        if any(windows) and base is not None and (base != cfg.rope_theta
                                                   or cfg.rope_scaling is not None):
            local = self.ops.to_device(build_rope_cache(
                cfg.head_dim, cfg.max_position_embeddings, base))
        return [LayerRecipe(local if w else self.rope_cache, w) for w in windows]

    def _norm(self, weight: np.ndarray) -> Any:
        """A norm weight on the backend with ``config.norm_offset`` added in
        float32 (Gemma's ``1.0 + weight.float()``); unchanged without offset."""
        if self.config.norm_offset:
            weight = np.asarray(weight, np.float32) + np.float32(self.config.norm_offset)
        return self.ops.to_device(weight)

    def _table(self, table: np.ndarray | BlockQuantizedWeight) -> LinearWeight:
        """An embedding / LM head table on the backend: dense, or GGUF blocks
        (``BlockQuantizedWeight``, ``KQuantWeight``)."""
        if isinstance(table, (BlockQuantizedWeight, KQuantWeight)):
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

        norm = self._norm
        cfg = self.config
        qk = ({"q_norm": norm(w[f"{p}self_attn.q_norm.weight"]),
               "k_norm": norm(w[f"{p}self_attn.k_norm.weight"])} if cfg.qk_norm else {})
        if cfg.sandwich_norms:
            norms = {"post_norm": norm(w[f"{p}pre_feedforward_layernorm.weight"]),
                     "attn_out_norm": norm(w[f"{p}post_attention_layernorm.weight"]),
                     "mlp_out_norm": norm(w[f"{p}post_feedforward_layernorm.weight"])}
        else:
            norms = {"post_norm": norm(w[f"{p}post_attention_layernorm.weight"])}
        return LayerWeights(
            input_norm=norm(w[f"{p}input_layernorm.weight"]),
            qkv=linear(_fuse(attn)),
            qkv_bias=bias,
            o_proj=linear(w[f"{p}self_attn.o_proj.weight"]),
            gate_up=linear(gate_up),
            down=linear(w[f"{p}mlp.down_proj.weight"]),
            **norms, **qk,
        )

    @property
    def weights_nbytes(self) -> int:
        """Bytes of every weight on the backend (a tied LM head counted once)."""
        arrays = [self.embed_tokens, self.final_norm]
        if self.lm_head is not self.embed_tokens:
            arrays.append(self.lm_head)
        for layer in self.layers:
            arrays += list(vars(layer).values())
        return sum(int(a.nbytes) for a in arrays if a is not None)


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

    def batch_hidden_states(self, batch: BatchInputs, kv_caches: list[Any],
                            intermediate: tuple[Any, Any] | None = None) -> Any:
        """``hidden_states`` of a host-built flat batch (``InputBatch.build``):
        its arrays checked and moved to the backend by ``Ops.prepare_step``
        (one copy on a GPU); [R, H] for its ``logits_indices``. A batch with
        several KV-cache groups (``batch.group_tables``) gets one
        ``AttentionMetadata`` per group: its slot mapping and block tables
        (the backend's step carries them as ``group_tables`` too)."""
        cache = kv_caches[0]
        step = self.ops.prepare_step(batch, StepGeometry(
            vocab_size=self.config.vocab_size, max_position=int(self.rope_cache.shape[0]),
            num_blocks=int(cache.shape[0]), block_size=int(cache.shape[2])))
        tables = [(step.slot_mapping, step.block_tables), *step.group_tables]
        attn = [AttentionMetadata(slot_mapping=slots, block_tables=table, seq_lens=step.seq_lens,
                                  query_start_loc=step.query_start_loc, plan=step)
                for slots, table in tables]
        return self.hidden_states(step.input_ids, step.positions,
                                  attn[0] if len(attn) == 1 else attn, kv_caches,
                                  step.logits_indices, intermediate)

    def hidden_states(self, input_ids: Any, positions: Any, attn: AttentionMetadata,
                      kv_caches: list[Any], logits_indices: Any,
                      intermediate: tuple[Any, Any] | None = None) -> Any:
        """Run the model's layers; the final-normed hidden states of the
        sampling positions, or, on a pipeline stage before the last, the
        stage's ``(x, residual)`` for the next one.

        Args:
            input_ids: int64[T] token ids of the flat batch.
            positions: int64[T] absolute position of each token in its sequence.
            attn: paging metadata for the batch.
            kv_caches: one buffer per layer held, float[num_blocks, 2, block_size, nkv, hd].
            logits_indices: int64[R], the rows of the batch whose next token is
                sampled (the last token of each sequence that finishes its prompt
                or decodes). The LM head runs on these rows only.
            intermediate: on a pipeline stage after the first, the previous
                stage's ``(x, residual)`` float[T, H] (vLLM's
                ``IntermediateTensors``); None on the first.

        Returns:
            [R, H] hidden states after the final norm (the LM head's input),
            or ``(x, residual)`` [T, H] on a stage before the last.
        """
        ops, cfg = self.ops, self.config
        if intermediate is None:
            hidden = ops.embedding(input_ids, self.embed_tokens)
            if cfg.embedding_multiplier != 1.0:
                # Gemma: rows times sqrt(hidden) in the activations' dtype (HF's
                # ``embeds * embed_scale.to(weight.dtype)``).
                hidden = hidden * hidden.dtype.type(cfg.embedding_multiplier)
            x = None
        else:
            x, hidden = intermediate
        # A backend may run a step of short queries (decode, verification) in
        # one compiled call (decode_path: chosen when the model was built);
        # None for a step it does not take.
        done = None
        if self.decode_path.fused:
            done = ops.decode_layers(hidden, self, positions, attn, kv_caches, x=x)
        x, residual = done if done is not None else self._layers(hidden, positions, attn,
                                                                 kv_caches, x)
        if not self.is_last:
            return x, residual
        # Only the sampled rows need the final norm and the LM head.
        x, residual = x[logits_indices], residual[logits_indices]
        ops.fused_add_rms_norm(x, residual, self.final_norm, cfg.rms_norm_eps)
        return x

    def _layers(self, hidden: Any, positions: Any, attn: AttentionMetadata,
                kv_caches: list[Any], x: Any = None) -> tuple[Any, Any]:
        """The model's layers, op by op: ``(x, residual)`` after the last.

        ``residual`` holds the residual stream (``hidden``, updated in
        place); ``x`` what the next ``fused_add_rms_norm`` adds to it: the
        attention output, then the MLP output (each normed first where the
        layer has sandwich norms). ``x`` given (a later pipeline stage): the
        previous layer's MLP output, added to ``hidden`` first.
        """
        ops, cfg = self.ops, self.config
        residual = hidden
        first = self.layer_range.start
        if x is None:
            x = ops.rms_norm(hidden, self.layers[0].input_norm, cfg.rms_norm_eps)
        else:
            ops.fused_add_rms_norm(x, residual, self.layers[0].input_norm, cfg.rms_norm_eps)
        eps = cfg.rms_norm_eps
        for i, layer in enumerate(self.layers):
            if i > 0:  # the last MLP output, normed first where it has a norm of its own
                ops.fused_add_rms_norm(x, residual, layer.input_norm, eps,
                                       x_weight=self.layers[i - 1].mlp_out_norm)
            x = self._attention(first + i, layer, x, positions,
                                self._layer_attn(attn, first + i), kv_caches[i])
            ops.fused_add_rms_norm(x, residual, layer.post_norm, eps,
                                   x_weight=layer.attn_out_norm)
            x = ops.linear(self.activation(ops.linear(x, layer.gate_up)), layer.down)
            if self.all_reduce is not None:
                self.all_reduce(x)
        if self.layers[-1].mlp_out_norm is not None:  # what the next add takes
            x = ops.rms_norm(x, self.layers[-1].mlp_out_norm, eps)
        return x, residual

    def _layer_attn(self, attn: Any, i: int) -> AttentionMetadata:
        """Layer ``i`` 's attention metadata: ``attn`` itself when one serves
        every layer, else (a sequence, one per KV-cache group) the entry of
        the layer's group, ``kv_layout.layer_group[i]``. Raises ValueError
        for a sequence while the model has no ``kv_layout``."""
        if not isinstance(attn, (list, tuple)):
            return attn
        if self.kv_layout is None:
            raise ValueError("attention metadata per KV-cache group needs the model's kv_layout")
        return attn[self.kv_layout.layer_group[i]]

    def _attention(self, i: int, layer: LayerWeights, x: Any, positions: Any,
                   attn: AttentionMetadata, kv_cache: Any) -> Any:
        """Layer ``i`` 's attention block (``i``: the model's layer index):
        QKV product, (q/k norms,) RoPE with the layer's table, K/V write,
        paged attention within the layer's window, output product (summed
        over the tensor-parallel workers). [T, H] -> new [T, H]."""
        cfg, ops = self.config, self.ops
        hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        qkv = ops.linear(x, layer.qkv, layer.qkv_bias)
        recipe = self.recipes[i]
        # Only sliding layers pass a window, only q/k-normed ones a norm: the
        # others call the op as before either existed.
        extra = {"window": recipe.window} if recipe.window else {}
        if layer.q_norm is not None:
            extra["qk_norm"] = QKNorm(layer.q_norm, layer.k_norm, cfg.rms_norm_eps)
        out = ops.rope_kv_attention(qkv, positions, recipe.rope_cache, kv_cache, attn,
                                    self.scale, nh, nkv, hd, **extra)
        out = ops.linear(out.reshape(x.shape[0], nh * hd), layer.o_proj)
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out


def _fuse_kquant(weights: list) -> KQuantWeight | StackedWeight:
    """Runs of K-quant parts whose panels lie end to end (``fuse_adjacent``)
    as one weight each; a ``StackedWeight`` of the runs and other parts when
    more than one remains."""
    parts: list = []
    for w in weights:
        if parts and isinstance(w, KQuantWeight) and isinstance(parts[-1], KQuantWeight):
            joined = fuse_adjacent([parts[-1], w])
            if joined is not None:
                parts[-1] = joined
                continue
        parts.append(w)
    return parts[0] if len(parts) == 1 else StackedWeight(tuple(parts))


def _fuse(weights: list) -> np.ndarray | BlockQuantizedWeight:
    """Stack [out_i, in] weights along out: GGUF blocks when all are blocks of
    one kind; else float32, blocks dequantized (exact: ``d * q + m`` in
    float32, the values the float checkpoint holds), as for a K-quant mix
    whose ``attn_v`` alone is Q8_0 (Gemma 3 270M). With a K-quant part, a
    ``StackedWeight`` of the parts as they are (nothing dequantized or
    copied)."""
    if any(isinstance(w, KQuantWeight) for w in weights):
        return _fuse_kquant(weights)
    blocks = [w for w in weights if isinstance(w, BlockQuantizedWeight)]
    if len(blocks) == len(weights) and len({(w.kind, w.shape[1]) for w in blocks}) == 1:
        return concat_rows(weights)
    return np.concatenate([dequantize(w) if isinstance(w, BlockQuantizedWeight) else w
                           for w in weights])
