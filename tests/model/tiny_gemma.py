"""A tiny random-weight Gemma 3 checkpoint, generated deterministically at test time.

The Gemma counterpart of ``tiny_llama``: a Hugging Face-layout folder
(``config.json`` with ``model_type`` ``gemma3_text`` + ``model.safetensors``)
read back through the production loader, small enough for the float64
reference of ``test_gemma_forward.py`` and the CUDA simulator.

What the scales are chosen to expose:

- ``sliding_window`` 8 against prompts of 40+ tokens, with block size 4:
  most keys of a sliding layer lie before the window, and a window that
  is no multiple of the block size would show an off-by-one;
- ``query_pre_attn_scalar`` 24 differs from ``head_dim`` 32, so the wrong
  attention scale shows; q/k norm weights near 1 (stored ``w`` near 0.9,
  since the model multiplies by ``1 + w``) make attention peaked;
- the norm weights are stored in Hugging Face's convention ``w`` (around
  0), so a missing ``1 + w`` offset collapses the hidden states;
- RoPE bases 10,000 (full layers) and 100 (sliding layers) differ enough
  that swapping the two tables changes the logits;
- an embedding std of 0.3 times sqrt(64) gives hidden states of about
  2.4 and logits over several units.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from kvserve.config import ModelConfig
from kvserve.model.loader import load_model_config, load_weights


@dataclass(frozen=True)
class TinyGemmaSpec:
    """Architecture of one tiny Gemma 3 checkpoint (its ``config.json``).

    ``layer_types`` None writes ``sliding_window_pattern`` instead (the
    loader derives the list: layer i full iff (i + 1) % pattern == 0).
    """

    name: str = "gemma-tiny"
    num_hidden_layers: int = 4
    layer_types: tuple[str, ...] | None = ("sliding_attention", "sliding_attention",
                                           "full_attention", "sliding_attention")
    sliding_window_pattern: int = 6
    hidden_size: int = 64
    intermediate_size: int = 128
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 32
    vocab_size: int = 300
    sliding_window: int = 8
    query_pre_attn_scalar: float = 24.0
    rope_theta: float = 10_000.0
    rope_local_base_freq: float = 100.0
    max_position_embeddings: int = 96
    rms_norm_eps: float = 1e-6
    seed: int = 0

    def config_json(self) -> dict:
        """The Hugging Face ``config.json`` (``Gemma3TextConfig`` keys)."""
        cfg = {
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_local_base_freq": self.rope_local_base_freq,
            "sliding_window": self.sliding_window,
            "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": [1, 106],
            "pad_token_id": 0, "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "rope_scaling": None,
        }
        if self.layer_types is None:
            cfg["sliding_window_pattern"] = self.sliding_window_pattern
        else:
            cfg["layer_types"] = list(self.layer_types)
        return cfg


def tiny_gemma_weights(spec: TinyGemmaSpec) -> dict[str, np.ndarray]:
    """Deterministic float32 weights of ``spec``: Hugging Face names and
    shapes, norm weights in Hugging Face's ``w`` convention (the model
    multiplies by ``1 + w``)."""
    rng = np.random.default_rng(spec.seed)
    H, I, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q, kv = spec.num_attention_heads * hd, spec.num_key_value_heads * hd

    def normal(*shape: int, std: float, mean: float = 0.0) -> np.ndarray:
        return (mean + rng.standard_normal(shape) * std).astype(np.float32)

    def linear(out_features: int, in_features: int) -> np.ndarray:
        return normal(out_features, in_features, std=in_features ** -0.5)

    w = {"model.embed_tokens.weight": normal(spec.vocab_size, H, std=0.3),
         "model.norm.weight": normal(H, std=0.1)}
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            w[p + norm + ".weight"] = normal(H, std=0.1)
        w[p + "self_attn.q_norm.weight"] = normal(hd, std=0.1, mean=0.9)
        w[p + "self_attn.k_norm.weight"] = normal(hd, std=0.1, mean=0.9)
        w[p + "self_attn.q_proj.weight"] = linear(q, H)
        w[p + "self_attn.k_proj.weight"] = linear(kv, H)
        w[p + "self_attn.v_proj.weight"] = linear(kv, H)
        w[p + "self_attn.o_proj.weight"] = linear(H, q)
        w[p + "mlp.gate_proj.weight"] = 2 * linear(I, H)
        w[p + "mlp.up_proj.weight"] = linear(I, H)
        w[p + "mlp.down_proj.weight"] = linear(H, I)
    return w


def write_tiny_gemma(folder: Path, spec: TinyGemmaSpec) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of ``spec`` into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(spec.config_json(), indent=1))
    save_file(tiny_gemma_weights(spec), str(folder / "model.safetensors"))
    return folder


def load_tiny_gemma(folder: Path, spec: TinyGemmaSpec) -> tuple[ModelConfig,
                                                                 dict[str, np.ndarray]]:
    """Write the checkpoint, then read it back through the production loader."""
    write_tiny_gemma(folder, spec)
    config = load_model_config(folder)
    return config, load_weights(folder, config)
