"""A GGUF served in place (``kvserve.model.gguf_weights``) on a tiny llama written here.

The file holds K-quant blocks (random super-blocks: Q4_K, Q5_K and Q6_K, as a
Q4_K_M release mixes them), an exact-Q8_0 Q5_0 tensor and F32 norms, with
llama.cpp's Q/K row permutation. The loader must
- serve the K-quants as panels mapped from one file in the folder, packed
  once (a second load maps it and packs nothing), with no float copy;
- give, with ``none``, float weights equal to gguf-py's dequantization of the
  same blocks (rows un-permuted), whose forward equals the float64 reference;
- give, with the blocks, a forward within the Q8_K activations' error of that
  reference.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from test_forward_reference import REL_TOL, reference, rel_err
from test_quantization import forward_all
from tiny_llama import SPECS, write_tiny_checkpoint

from kvserve.cpu.ops import CpuOps
from kvserve.model.default_model import permute_qk, unpermute_qk
from kvserve.model.ggml_blocks import BlockQuantizedWeight, KQuantWeight, StackedWeight
from kvserve.model.gguf_weights import PANEL_FILE
from kvserve.model.llama import LlamaModel
from kvserve.model.loader import load_checkpoint_weights, load_model_config

#: GGUF type per tensor: a Q4_K_M-like mix.
TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
         "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q5_0", "token_embd": "Q6_K",
         "output": "Q6_K"}
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def spec_of(base):
    """A tiny spec whose every K is a multiple of 256."""
    return dataclasses.replace(base, hidden_size=256, intermediate_size=512, vocab_size=320)


def random_kquant(kind: str, n: int, k: int, rng) -> np.ndarray:
    raw = rng.integers(0, 256, (n, k // 256, BLOCK_BYTES[kind]), dtype=np.uint8)

    def f16(scale):
        return (rng.uniform(0.5, 1.0, raw.shape[:2]) * scale).astype(np.float16).view(
            np.uint8).reshape(*raw.shape[:2], 2)

    if kind == "Q6_K":
        raw[:, :, 208:210] = f16(2e-4)
    else:
        raw[:, :, 0:2] = f16(1e-4)
        raw[:, :, 2:4] = f16(1e-4)
    return raw.reshape(n, -1)


def write_gguf(folder, spec, weights) -> dict[str, np.ndarray]:
    """The GGUF beside the checkpoint's config; returns the float64 values
    the blocks hold, HF layout (the reference's weights)."""
    config = load_model_config(folder)
    rng = np.random.default_rng(spec.seed)
    writer = gguf.GGUFWriter(str(folder / "model.gguf"), "llama")
    values = dict(weights)
    names = {"model.embed_tokens.weight": "token_embd", "lm_head.weight": "output"}
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, w in weights.items():
        if name in names:
            short, gname = names[name], names[name] + ".weight"
        elif name == "model.norm.weight":
            short, gname = None, "output_norm.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module, kind = rest.rsplit(".", 1)
            short = parts[module]
            gname = f"blk.{layer}.{short}.{kind}"
        qtype_name = TYPES.get(short) if name.endswith(".weight") and w.ndim == 2 else None
        if qtype_name is None:
            writer.add_tensor(gname, w.astype(np.float32))
            continue
        qtype = gguf.GGMLQuantizationType[qtype_name]
        heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(
            short)
        if qtype_name == "Q5_0":
            raw = gguf_quantize(permute_qk(w, heads) if heads else w, qtype)
        else:
            raw = random_kquant(qtype_name, *w.shape, rng)
        writer.add_tensor(gname, raw, raw_dtype=qtype)
        stored = gguf_dequantize(raw, qtype).reshape(w.shape).astype(np.float64)
        values[name] = unpermute_qk(stored, heads) if heads else stored
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for f in folder.glob("*.safetensors"):
        f.unlink()  # served from the GGUF alone, as --model x.gguf
    return values


@pytest.mark.parametrize("base", SPECS, ids=[s.name for s in SPECS])
def test_kquant_gguf_served_in_place(base, tmp_path):
    spec = spec_of(base)
    write_tiny_checkpoint(tmp_path, spec)
    config = load_model_config(tmp_path)
    from kvserve.model.loader import load_weights
    values = write_gguf(tmp_path, spec, load_weights(tmp_path, config))
    ops = CpuOps(num_threads=1)
    tokens = np.random.default_rng(spec.seed).integers(0, config.vocab_size, 24).tolist()
    expected = reference({k: v.astype(np.float32) for k, v in values.items()}, config, tokens)

    floats = load_checkpoint_weights(tmp_path, config, "none")
    for name, value in values.items():
        np.testing.assert_array_equal(floats[name], value.astype(np.float32), err_msg=name)
    assert rel_err(forward_all(LlamaModel(config, floats, ops), ops, tokens),
                   expected) <= REL_TOL

    blocks = load_checkpoint_weights(tmp_path, config, "w4a8")
    assert (tmp_path / PANEL_FILE).is_file()
    stamp = (tmp_path / PANEL_FILE).stat().st_mtime_ns
    q = blocks["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, KQuantWeight) and isinstance(q.codes.base, np.memmap)
    assert isinstance(blocks["model.layers.0.mlp.down_proj.weight"], BlockQuantizedWeight)
    model = LlamaModel(config, blocks, ops, quantization="w4a8")
    layer = model.layers[0]
    # q and k (Q4_K, end to end in the file) fused without a copy; v (Q6_K) apart
    assert isinstance(layer.qkv, StackedWeight) and len(layer.qkv.parts) == 2
    assert layer.qkv.parts[0].shape[0] == config.hidden_size + config.num_key_value_heads * 64
    assert isinstance(layer.gate_up, KQuantWeight)
    got = forward_all(model, ops, tokens)
    assert REL_TOL < rel_err(got, expected) <= 0.05

    again = load_checkpoint_weights(tmp_path, config, "w4a8")  # maps, packs nothing
    assert (tmp_path / PANEL_FILE).stat().st_mtime_ns == stamp
    np.testing.assert_array_equal(forward_all(LlamaModel(config, again, ops, "w4a8"), ops,
                                              tokens), got)
