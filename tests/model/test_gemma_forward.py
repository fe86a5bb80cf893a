"""Gemma 3 in the model code against an independent float64 reference.

A tiny random-weight Gemma 3 checkpoint (``tiny_gemma``: sliding and full
layers, window 8, block size 4) is loaded by the production loader and run
by ``LlamaModel`` on paged, chunked steps (prefill chunks longer than the
window, decode-only steps, mixed steps) over every CPU attention route.
Its logits are compared with :func:`gemma_reference`, a dense float64
forward pass written here from Hugging Face's ``modeling_gemma3.py``
(``Gemma3RMSNorm``'s ``1 + w``, ``Gemma3TextScaledWordEmbedding``'s
sqrt(hidden) scale, q/k norms before RoPE, the sliding mask ``p - j <
window``, RoPE base per layer type, ``query_pre_attn_scalar ** -0.5``,
sandwich norms, ``Gemma3MLP``'s tanh-GELU, tied head): it shares no code
with the model or the kernels.

Before each step the sliding layers' caches get NaN in every block wholly
before the window of each scheduled sequence's first new token, as when
the KV manager gives those blocks to another request: a kernel reading
them would spread NaN into the logits.

Tolerance: ``test_forward_reference.REL_TOL`` (float32 rounding only).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pytest
from test_forward_reference import REL_TOL, rel_err
from tiny_gemma import TinyGemmaSpec, load_tiny_gemma, write_tiny_gemma

from kvserve.config import SLIDING_ATTENTION
from kvserve.cpu import decode_path
from kvserve.cpu.ops import CpuOps
from kvserve.model.llama import AttentionMetadata, LlamaModel
from kvserve.model.loader import expected_tensor_shapes, load_model_config
from kvserve.model.ops import Ops

SPEC = TinyGemmaSpec()
#: The CPU attention routes: the default split (chunks of 16+ tokens on the
#: BLAS path), everything on the Numba kernel, everything of 2+ tokens on
#: BLAS, and the batch-invariant kernels.
BACKENDS: dict[str, Callable[[], Ops]] = {
    "cpu": CpuOps,
    "cpu-numba-attention": lambda: CpuOps(prefill_min_queries=10**9),
    "cpu-blas-attention": lambda: CpuOps(prefill_min_queries=2),
    "cpu-batch-invariant": lambda: CpuOps(batch_invariant=True),
}
BLOCK_SIZE = 4


# --------------------------------------------------------------------------- #
# The float64 reference (Hugging Face modeling_gemma3.py, written out)
# --------------------------------------------------------------------------- #


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Gemma3RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + w)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def _rope(x: np.ndarray, base: float) -> np.ndarray:
    """apply_rotary_pos_emb (rotate_half) of x [L, heads, hd] at positions 0..L-1."""
    L, _, hd = x.shape
    inv_freq = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    angles = np.arange(L, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos = np.cos(np.concatenate([angles, angles], -1))[:, None, :]
    sin = np.sin(np.concatenate([angles, angles], -1))[:, None, :]
    rotated = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * cos + rotated * sin


def _gelu_tanh(a: np.ndarray) -> np.ndarray:
    """ACT2FN["gelu_pytorch_tanh"]."""
    return 0.5 * a * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (a + 0.044715 * a**3)))


def gemma_reference(weights: dict[str, np.ndarray], spec: TinyGemmaSpec,
                    tokens: list[int]) -> np.ndarray:
    """float64[L, V] logits of every position of ``tokens`` (one sequence,
    dense attention): Gemma3ForCausalLM.forward without a cache."""
    w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    eps, hd = spec.rms_norm_eps, spec.head_dim
    nh, nkv = spec.num_attention_heads, spec.num_key_value_heads
    types = spec.layer_types or tuple(
        "full_attention" if (i + 1) % spec.sliding_window_pattern == 0 else SLIDING_ATTENTION
        for i in range(spec.num_hidden_layers))
    L = len(tokens)
    x = w["model.embed_tokens.weight"][tokens] * np.sqrt(spec.hidden_size)
    pos = np.arange(L)
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        sliding = types[i] == SLIDING_ATTENTION
        h = _rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(L, nh, hd)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(L, nkv, hd)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(L, nkv, hd)
        q = _rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
        k = _rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        base = spec.rope_local_base_freq if sliding else spec.rope_theta
        q, k = _rope(q, base), _rope(k, base)
        k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) * spec.query_pre_attn_scalar ** -0.5
        visible = pos[None, :] <= pos[:, None]
        if sliding:
            visible &= pos[:, None] - pos[None, :] < spec.sliding_window
        scores = np.where(visible, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(L, nh * hd)
        attn = attn @ w[p + "self_attn.o_proj.weight"].T
        x = x + _rms_norm(attn, w[p + "post_attention_layernorm.weight"], eps)
        h = _rms_norm(x, w[p + "pre_feedforward_layernorm.weight"], eps)
        mlp = (_gelu_tanh(h @ w[p + "mlp.gate_proj.weight"].T)
               * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        x = x + _rms_norm(mlp, w[p + "post_feedforward_layernorm.weight"], eps)
    x = _rms_norm(x, w["model.norm.weight"], eps)
    return x @ w["model.embed_tokens.weight"].T


# --------------------------------------------------------------------------- #
# Fixtures and the paged driver
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(ModelConfig, float32 weights) of the tiny Gemma checkpoint."""
    return load_tiny_gemma(tmp_path_factory.mktemp("gemma"), SPEC)


@pytest.fixture(params=sorted(BACKENDS))
def ops(request) -> Ops:
    return BACKENDS[request.param]()


def run_steps(model: LlamaModel, ops: Ops, seqs, steps, num_blocks: int, rng,
              poison: bool = True) -> list[np.ndarray]:
    """Run ``steps`` (lists of (seq, start, end) chunks) through ``model.forward``
    on shuffled physical blocks; every token's logits (teacher forcing).

    ``poison``: before each step, NaN into the sliding layers' blocks wholly
    before each scheduled sequence's window (module doc).
    """
    cfg = model.config
    caches = [ops.allocate_kv_cache(num_blocks, BLOCK_SIZE, cfg.num_key_value_heads,
                                    cfg.head_dim) for _ in range(cfg.num_hidden_layers)]
    sliding = [c for c, t in zip(caches, cfg.layer_types) if t == SLIDING_ATTENTION]
    per_seq = num_blocks // len(seqs)
    tables = rng.permutation(num_blocks).astype(np.int32)[:per_seq * len(seqs)]
    tables = tables.reshape(len(seqs), per_seq)
    logits = [np.full((len(s), cfg.vocab_size), np.nan, np.float32) for s in seqs]
    for step in steps:
        if poison:
            for s, a, _ in step:
                stale = max(0, a - cfg.sliding_window + 1) // BLOCK_SIZE
                for cache in sliding:
                    cache[tables[s, :stale]] = np.nan
        toks, pos, qsl = [], [], [0]
        for s, a, b in step:
            toks += seqs[s][a:b]
            pos.append(np.arange(a, b))
            qsl.append(qsl[-1] + b - a)
        positions = np.concatenate(pos)
        owner = np.repeat([s for s, _, _ in step], [b - a for _, a, b in step])
        slots = (tables[owner, positions // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE
                 + positions % BLOCK_SIZE)
        attn = AttentionMetadata(slot_mapping=slots, block_tables=tables[[s for s, _, _ in step]],
                                 seq_lens=np.array([b for _, _, b in step], np.int32),
                                 query_start_loc=np.array(qsl, np.int32))
        out = ops.to_numpy(model.forward(np.array(toks, np.int64), positions, attn, caches,
                                         np.arange(len(toks), dtype=np.int64)))
        for j, (s, a, b) in enumerate(step):
            logits[s][a:b] = out[qsl[j]:qsl[j + 1]]
    return logits


#: Three sequences (50, 13 and 30 tokens; window 8): prefill chunks of 20
#: and 19 tokens across the window, decode-only steps (the fused decode
#: path must decline), and a sequence prefilled one token a step.
SEQ_LENGTHS = (50, 13, 30)
STEPS = [
    [(0, 0, 20), (1, 0, 5), (2, 0, 1)],
    [(0, 20, 21), (1, 5, 6), (2, 1, 2)],
    [(0, 21, 40), (1, 6, 13), (2, 2, 3)],
    [(0, 40, 41), (2, 3, 4)],
    [(0, 41, 50), (2, 4, 30)],
]


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #


def test_gemma_forward_matches_reference(tiny, ops):
    config, weights = tiny
    model = LlamaModel(config, weights, ops)
    rng = np.random.default_rng(7)
    seqs = [rng.integers(0, config.vocab_size, n).tolist() for n in SEQ_LENGTHS]
    logits = run_steps(model, ops, seqs, STEPS, num_blocks=3 * 16, rng=rng)
    for s, toks in enumerate(seqs):
        assert not np.isnan(logits[s]).any(), s
        assert rel_err(logits[s], gemma_reference(weights, SPEC, toks)) < REL_TOL, s


def test_gemma_sliding_window_matters(tiny):
    """The reference's window and the model's agree where it matters: a
    model whose layers all attend to the full context differs from the
    reference by far more than the tolerance (so the test above sees windows)."""
    config, weights = tiny
    ops = CpuOps()
    model = LlamaModel(config, weights, ops)
    model.recipes = [type(r)(model.rope_cache if r.window else r.rope_cache, 0)
                     for r in model.recipes]
    rng = np.random.default_rng(8)
    seqs = [rng.integers(0, config.vocab_size, 40).tolist()]
    logits = run_steps(model, ops, seqs, [[(0, 0, 40)]], num_blocks=16, rng=rng, poison=False)
    assert rel_err(logits[0], gemma_reference(weights, SPEC, seqs[0])) > 100 * REL_TOL


def test_gemma_decode_step_declines_the_fused_path(tiny):
    """``CpuOps.decode_layers`` returns None for Gemma (the op path runs)."""
    config, weights = tiny
    ops = CpuOps()
    model = LlamaModel(config, weights, ops)
    caches = [ops.allocate_kv_cache(4, BLOCK_SIZE, 1, config.head_dim)
              for _ in range(config.num_hidden_layers)]
    attn = AttentionMetadata(np.array([0], np.int64), np.array([[0]], np.int32),
                             np.array([1], np.int32), np.array([0, 1], np.int32))
    hidden = np.zeros((1, config.hidden_size), np.float32)
    assert ops.decode_layers(hidden, model, np.zeros(1, np.int64), attn, caches) is None
    assert not decode_path.fused_architecture(config)


def test_gemma_config_fields(tiny):
    config, _ = tiny
    assert config.model_type == "gemma3_text"
    assert config.layer_types == SPEC.layer_types
    assert [config.layer_window(i) for i in range(4)] == [8, 8, 0, 8]
    assert config.attention_scale == pytest.approx(24.0 ** -0.5)
    assert config.embedding_multiplier == pytest.approx(8.0)
    assert (config.norm_offset, config.qk_norm, config.sandwich_norms) == (1.0, True, True)
    assert config.hidden_activation == "gelu_pytorch_tanh"
    assert (config.rope_theta, config.rope_local_base_freq) == (10_000.0, 100.0)
    assert config.tie_word_embeddings and config.eos_token_ids == (1, 106)
    shapes = expected_tensor_shapes(config)
    assert shapes["model.layers.3.self_attn.k_norm.weight"] == (32,)
    assert shapes["model.layers.0.post_feedforward_layernorm.weight"] == (64,)


def test_gemma_layer_types_from_the_pattern(tmp_path):
    """No ``layer_types`` list: pattern 6 makes layers 5 and 11 full (Hugging
    Face's rule), the 270M's layout in small."""
    spec = TinyGemmaSpec(num_hidden_layers=12, layer_types=None)
    config = load_model_config(write_tiny_gemma(tmp_path / "g", spec))
    full = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]
    assert full == [5, 11] and len(config.layer_types) == 12


def test_gemma3_multimodal_config_reads_its_text_config(tmp_path):
    text = SPEC.config_json()
    del text["bos_token_id"], text["eos_token_id"]
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gemma3", "text_config": text, "bos_token_id": 2, "eos_token_id": 1}))
    config = load_model_config(tmp_path)
    assert config.model_type == "gemma3" and config.hidden_size == 64
    assert config.bos_token_id == 2 and config.eos_token_ids == (1,)
    assert config.layer_types == SPEC.layer_types


@pytest.mark.parametrize("key, value", [("final_logit_softcapping", 30.0),
                                        ("attn_logit_softcapping", 50.0),
                                        ("rope_scaling", {"rope_type": "dynamic", "factor": 8.0}),
                                        ("hidden_activation", "gelu"),
                                        ("layer_types", ["full_attention"] * 3)])
def test_gemma_config_refuses_what_the_model_does_not_compute(tmp_path, key, value):
    cfg = SPEC.config_json()
    cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=key if key != "hidden_activation" else "activation"):
        load_model_config(tmp_path)


def test_gemma_linear_rope_scaling_scales_the_full_layers_only(tmp_path):
    """Gemma 3 4B and larger scale their full layers' RoPE linearly
    (``rope_scaling: {"rope_type": "linear", "factor": 8.0}`` in transformers
    4's form): the full layers' table is the scaled one, the sliding
    layers' the plain one of ``rope_local_base_freq``."""
    from kvserve.model.ops import build_rope_cache
    from kvserve.model.rope import RopeSpec, rope_table

    from kvserve.model.loader import load_weights

    write_tiny_gemma(tmp_path, SPEC)
    cfg = SPEC.config_json()
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = load_model_config(tmp_path)
    assert config.rope_scaling == RopeSpec(config.rope_theta, "linear", factor=8.0)
    model = LlamaModel(config, load_weights(tmp_path, config), CpuOps(num_threads=1))
    hd, n = config.head_dim, config.max_position_embeddings
    full = config.layer_types.index("full_attention")
    sliding = config.layer_types.index("sliding_attention")
    np.testing.assert_array_equal(model.recipes[full].rope_cache,
                                  rope_table(config.rope_scaling, hd, n))
    np.testing.assert_array_equal(model.recipes[sliding].rope_cache,
                                  build_rope_cache(hd, n, config.rope_local_base_freq))
