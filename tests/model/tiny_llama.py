"""A tiny random-weight Llama checkpoint, generated deterministically at test time.

Every clone can check the production forward pass against the float64
reference (``kvserve.testing.reference``) with it: no download, no shared folder.
The checkpoint is written in the Hugging Face layout (``config.json`` +
``model.safetensors``) and read back through the real loader, so the loader's
name and shape handling is on the tested path too.

Scales are chosen so that numerical faults show: hidden states have a mean
square of about 0.01, so an RMSNorm epsilon of 1e-3 moves the normalised
values by several percent (a misplaced epsilon cannot hide in float32 noise),
and the logits spread over several units (few near-ties for greedy decoding).
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
class TinySpec:
    """Architecture of one tiny checkpoint (the ``config.json`` it gets).

    ``num_key_value_heads`` sets the GQA ratio (4 heads: 4 -> ratio 1, 2 -> ratio 2);
    ``bias`` writes q/k/v biases (``model_type`` qwen2, as real checkpoints with
    biases are); ``tied`` ties the LM head to the embedding.
    """

    name: str
    num_key_value_heads: int = 2
    tied: bool = True
    bias: bool = False
    num_hidden_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    intermediate_size: int = 128
    vocab_size: int = 512
    max_position_embeddings: int = 96
    rms_norm_eps: float = 1e-3
    rope_theta: float = 500.0
    seed: int = 0

    @property
    def head_dim(self) -> int:
        """hidden_size // num_attention_heads (16 with the defaults)."""
        return self.hidden_size // self.num_attention_heads

    def config_json(self) -> dict:
        """The Hugging Face ``config.json`` of this spec."""
        return {
            "architectures": ["Qwen2ForCausalLM" if self.bias else "LlamaForCausalLM"],
            "model_type": "qwen2" if self.bias else "llama",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tied, "bos_token_id": 0, "eos_token_id": 1,
        }


#: The specs the forward tests run: GQA ratios 2 and 1, tied and untied heads,
#: with and without q/k/v bias.
SPECS = (
    TinySpec("gqa2-tied", num_key_value_heads=2, tied=True, bias=False, seed=1),
    TinySpec("gqa1-untied-bias", num_key_value_heads=4, tied=False, bias=True, seed=2),
)


def tiny_weights(spec: TinySpec) -> dict[str, np.ndarray]:
    """Deterministic float32 weights for ``spec``, Hugging Face names and shapes."""
    rng = np.random.default_rng(spec.seed)
    H, I, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q, kv = spec.num_attention_heads * hd, spec.num_key_value_heads * hd

    def normal(*shape: int, std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def linear(out_features: int, in_features: int) -> np.ndarray:
        return normal(out_features, in_features, std=in_features ** -0.5)

    w = {"model.embed_tokens.weight": normal(spec.vocab_size, H, std=0.1),
         "model.norm.weight": 1 + normal(H, std=0.1)}
    if not spec.tied:
        w["lm_head.weight"] = normal(spec.vocab_size, H, std=0.5)
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + normal(H, std=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + normal(H, std=0.1)
        # Larger q/k make attention peaked, so position errors (RoPE) show.
        w[p + "self_attn.q_proj.weight"] = 3 * linear(q, H)
        w[p + "self_attn.k_proj.weight"] = 3 * linear(kv, H)
        w[p + "self_attn.v_proj.weight"] = 0.1 * linear(kv, H)
        w[p + "self_attn.o_proj.weight"] = linear(H, q)
        if spec.bias:
            for name, size in (("q", q), ("k", kv), ("v", kv)):
                w[p + f"self_attn.{name}_proj.bias"] = normal(size, std=0.1)
        w[p + "mlp.gate_proj.weight"] = linear(I, H)
        w[p + "mlp.up_proj.weight"] = linear(I, H)
        w[p + "mlp.down_proj.weight"] = 0.1 * linear(H, I)
    return w


def write_tiny_checkpoint(folder: Path, spec: TinySpec) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of ``spec`` into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(spec.config_json(), indent=1))
    save_file(tiny_weights(spec), str(folder / "model.safetensors"))
    return folder


def write_byte_tokenizer(folder: Path) -> Path:
    """A byte-level tokenizer for the tiny checkpoint in ``folder``: ids 0 and
    1 are ``<s>``/``</s>`` (the config's BOS/EOS), ids 2..257 the 256 bytes
    (no merges), so any text encodes within the 512-token vocabulary and an
    engine can serve the tiny model end to end."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1}
    vocab.update({ch: i + 2 for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def load_tiny(folder: Path, spec: TinySpec) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Write the checkpoint, then read it back through the production loader."""
    write_tiny_checkpoint(folder, spec)
    config = load_model_config(folder)
    return config, load_weights(folder, config)
