"""``--quantization q4`` end to end on a tiny model: a GGUF written with
``gguf-py`` (llama.cpp's Python package: Q/K rows permuted as its converter
does, Q4_1 / Q4_0 / Q8_0 blocks, F32 norms) is read by the loader, and the
forward pass on its blocks equals the float64 reference run on gguf-py's
dequantization of the same blocks."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from test_forward_reference import REL_TOL, reference, rel_err
from test_quantization import forward_all
from tiny_llama import SPECS, load_tiny, write_byte_tokenizer

from kvserve.cpu.ops import CpuOps
from kvserve.model.default_model import _BLOCK_NAMES, _GLOBAL_NAMES, permute_qk, unpermute_qk
from kvserve.model.ggml_blocks import BlockQuantizedWeight, dequantize
from kvserve.model.llama import LlamaModel
from kvserve.model.loader import find_gguf, load_checkpoint_weights

#: GGUF type per HF projection: both 4-bit kinds, and Q8_0 for the tables.
TYPES = {"q_proj": "Q4_1", "k_proj": "Q4_1", "v_proj": "Q4_1", "o_proj": "Q4_0",
         "gate_proj": "Q4_0", "up_proj": "Q4_0", "down_proj": "Q4_1",
         "embed_tokens": "Q8_0", "lm_head": "Q8_0"}


def gguf_name(hf_name: str) -> str:
    for g, h in _GLOBAL_NAMES.items():
        if h == hf_name:
            return g
    layer, part = hf_name.removeprefix("model.layers.").split(".", 1)
    module, kind = part.rsplit(".", 1)
    short = next(g for g, h in _BLOCK_NAMES.items() if h == module)
    return f"blk.{layer}.{short}.{kind}"


def write_gguf(path, config, weights) -> dict[str, np.ndarray]:
    """The GGUF of ``weights``; returns the HF-layout float values of its blocks."""
    writer = gguf.GGUFWriter(str(path), "llama")
    values = {}
    for name, w in weights.items():
        kind = TYPES.get(name.split(".")[-2]) if name.endswith(".weight") else None
        if kind is None:  # norms and biases stay F32: the float checkpoint's
            writer.add_tensor(gguf_name(name), np.asarray(w, np.float32))
            continue
        heads = {"q_proj": config.num_attention_heads,
                 "k_proj": config.num_key_value_heads}.get(name.split(".")[-2])
        stored = permute_qk(w, heads) if heads else w
        qtype = gguf.GGMLQuantizationType[kind]
        raw = gguf_quantize(stored, qtype)
        writer.add_tensor(gguf_name(name), raw, raw_dtype=qtype)
        deq = gguf_dequantize(raw, qtype).reshape(w.shape)
        values[name] = unpermute_qk(deq, heads) if heads else deq
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_q4_forward_equals_the_reference_on_the_gguf_values(spec, tmp_path):
    config, weights = load_tiny(tmp_path, spec)
    values = write_gguf(tmp_path / "model.gguf", config, weights)
    served = load_checkpoint_weights(tmp_path, config, "q4")
    blocks = {n: w for n, w in served.items() if isinstance(w, BlockQuantizedWeight)}
    assert set(blocks) == set(values)
    assert {b.ggml_type for b in blocks.values()} == {"Q4_0", "Q4_1", "Q8_0"}
    ops = CpuOps(num_threads=1)
    model = LlamaModel(config, served, ops, quantization="q4")
    assert isinstance(model.layers[0].qkv, BlockQuantizedWeight)
    assert isinstance(model.embed_tokens, BlockQuantizedWeight)
    assert model.weights_nbytes < LlamaModel(config, weights, ops).weights_nbytes / 4
    tokens = np.random.default_rng(spec.seed).integers(0, config.vocab_size, 24).tolist()
    got = forward_all(model, ops, tokens)
    expected = reference({**weights, **{k: v.astype(np.float32) for k, v in values.items()}},
                         config, tokens)
    assert rel_err(got, expected) <= REL_TOL


def test_find_gguf_needs_exactly_one_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds none"):
        find_gguf(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"")
    assert find_gguf(tmp_path) == tmp_path / "a.gguf"
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several .gguf"):
        find_gguf(tmp_path)


def test_a_q5_0_tensor_is_served_as_exact_q8_0(tmp_path):
    config, weights = load_tiny(tmp_path, SPECS[0])
    write_gguf(tmp_path / "model.gguf", config, weights)  # the other tensors
    writer = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "llama")
    w = weights["model.layers.0.mlp.down_proj.weight"]
    qtype = gguf.GGMLQuantizationType.Q5_0
    for name, value in weights.items():
        if name == "model.layers.0.mlp.down_proj.weight":
            writer.add_tensor(gguf_name(name), gguf_quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), np.asarray(value, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    weight = load_checkpoint_weights(tmp_path, config, "q4")[
        "model.layers.0.mlp.down_proj.weight"]
    assert weight.ggml_type == "Q5_0" and weight.kind == "q8"
    held = gguf_dequantize(gguf_quantize(w, qtype), qtype).reshape(w.shape)  # the file's values
    np.testing.assert_array_equal(dequantize(weight), held)


def test_serving_q4_without_a_gguf_is_one_clear_line(tmp_path):
    load_tiny(tmp_path, SPECS[0])
    write_byte_tokenizer(tmp_path)
    done = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", "--model", str(tmp_path),
                           "--quantization", "q4", "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done
    errors = [line for line in done.stderr.splitlines() if not line.startswith("{")]
    assert "Traceback" not in done.stderr and len(errors) == 1, done.stderr
    assert errors[0].startswith("kvserve: error: --quantization q4 serves the blocks"), errors
