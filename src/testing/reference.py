"""Dense NumPy reference of the Llama forward pass (ground truth for tests).

Plain and obviously correct rather than fast: no paging, no batching, float64
throughout, formulas written the way Hugging Face ``modeling_llama.py`` writes
them (RMSNorm, ``rotate_half`` RoPE, GQA by repeating KV heads, SiLU-gated MLP).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvserve.model import kv_quant


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Causal attention of one sequence whose queries are a suffix of its keys.

    Args:
        q: [n_new, num_heads, head_dim], the queries of the last ``n_new``
            positions of the sequence.
        k, v: [L, num_kv_heads, head_dim], keys/values of all positions
            0..L-1 (L >= n_new).
        scale: multiplier of q.k (usually head_dim ** -0.5).

    Returns:
        float64[n_new, num_heads, head_dim].  Query i (position L - n_new + i)
        attends to positions 0..L - n_new + i.  Query head h uses KV head
        h // (num_heads // num_kv_heads) (GQA).

    Raises:
        ValueError: on inconsistent shapes.
    """
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    n_new, nh, hd = q.shape
    L, nkv, hd_k = k.shape
    if v.shape != k.shape or hd_k != hd or n_new > L or nkv == 0 or nh % nkv != 0:
        raise ValueError(f"reference_attention: bad shapes q={q.shape} k={k.shape} v={v.shape}")
    group = nh // nkv
    if n_new == 0:
        return np.zeros((0, nh, hd))
    k_rep = np.repeat(k, group, axis=1)  # [L, nh, hd]
    v_rep = np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k_rep) * scale  # [nh, n_new, L]
    q_pos = np.arange(L - n_new, L)[:, None]
    k_pos = np.arange(L)[None, :]
    scores = np.where(k_pos <= q_pos, scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v_rep)


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """HF apply_rotary_pos_emb on x: [L, n, hd] (float64 angles)."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    freqs = positions[:, None].astype(np.float64) * inv_freq[None, :]  # [L, hd/2]
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [L, 1, hd]
    return x * np.cos(emb) + _rotate_half(x) * np.sin(emb)


def reference_forward(weights: dict[str, np.ndarray], cfg: Any, token_ids: list[int],
                      kv_cache_dtype: str = "auto") -> np.ndarray:
    """Dense Llama forward of one sequence; logits of every position.

    With ``kv_cache_dtype`` ``int8`` each layer's rotated K and its V are
    rounded to float32 and passed through ``kvserve.model.kv_quant``'s
    reference quantization and back before attention (what a cache in that
    format gives the attention to read); the rest stays float64.

    Args:
        weights: HF tensor names -> arrays (any float dtype):
            ``model.embed_tokens.weight`` [V, H];
            per layer i, prefix ``model.layers.{i}.``: ``input_layernorm.weight``,
            ``self_attn.{q,k,v,o}_proj.weight`` ([out, in]), optional
            ``self_attn.{q,k,v}_proj.bias``, ``post_attention_layernorm.weight``,
            ``mlp.{gate,up,down}_proj.weight``; ``model.norm.weight``;
            ``lm_head.weight`` [V, H] (absent or ignored when
            ``cfg.tie_word_embeddings``, then the embedding is used).
        cfg: object with ``num_hidden_layers, num_attention_heads,
            num_key_value_heads, head_dim`` (None -> hidden_size //
            num_attention_heads), ``hidden_size, rms_norm_eps, rope_theta,
            tie_word_embeddings, vocab_size``.
        token_ids: the sequence, positions 0..L-1.

    Returns:
        float32[L, vocab_size] logits (computed in float64).

    Raises:
        ValueError: empty sequence or token id out of range.
        KeyError: a required weight is missing.
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError("reference_forward: token_ids must be a non-empty 1-D sequence")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError("reference_forward: token id out of range")

    def w(name: str) -> np.ndarray:
        return np.asarray(weights[name], dtype=np.float64)

    nh = cfg.num_attention_heads
    nkv = cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
    eps = cfg.rms_norm_eps
    L = ids.size
    positions = np.arange(L)

    h = w("model.embed_tokens.weight")[ids]  # [L, H]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        x = _rms_norm(h, w(p + "input_layernorm.weight"), eps)

        def proj(name: str) -> np.ndarray:
            y = x @ w(p + f"self_attn.{name}.weight").T
            if p + f"self_attn.{name}.bias" in weights:
                y = y + w(p + f"self_attn.{name}.bias")
            return y

        q = proj("q_proj").reshape(L, nh, hd)
        k = proj("k_proj").reshape(L, nkv, hd)
        v = proj("v_proj").reshape(L, nkv, hd)
        q = _rope(q, positions, cfg.rope_theta)
        k = _rope(k, positions, cfg.rope_theta)
        if kv_cache_dtype == "int8":
            k = kv_quant.dequantize(kv_quant.quantize(k.astype(np.float32))).astype(np.float64)
            v = kv_quant.dequantize(kv_quant.quantize(v.astype(np.float32))).astype(np.float64)
        attn = reference_attention(q, k, v, hd ** -0.5).reshape(L, nh * hd)
        h = h + attn @ w(p + "self_attn.o_proj.weight").T

        x = _rms_norm(h, w(p + "post_attention_layernorm.weight"), eps)
        gate = x @ w(p + "mlp.gate_proj.weight").T
        up = x @ w(p + "mlp.up_proj.weight").T
        act = gate / (1.0 + np.exp(-gate)) * up
        h = h + act @ w(p + "mlp.down_proj.weight").T

    h = _rms_norm(h, w("model.norm.weight"), eps)
    if cfg.tie_word_embeddings or "lm_head.weight" not in weights:
        head = w("model.embed_tokens.weight")
    else:
        head = w("lm_head.weight")
    return (h @ head.T).astype(np.float32)
