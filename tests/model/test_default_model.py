"""Default-model fetch/convert, GGUF conversion and checkpoint loading tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvserve.model import default_model as dm
from kvserve.model.default_model import (ConversionError, convert_gguf, ensure_default_model,
                                         hf_tensor_name, permute_qk, unpermute_qk)
from kvserve.model.loader import load_model_config, load_weights
from kvserve.model.tokenizer import Tokenizer

# ---------------------------------------------------------------- tiny GGUF helpers

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 8, 2, 1, 4, 16
ALPHABET = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ", "Ċ"]
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *ALPHABET, "ab"]
VOCAB = len(TOKENS)


def hf_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random HF-layout weights of a one-layer tiny llama (untied)."""
    shapes = {
        "token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
        "output.weight": (VOCAB, HIDDEN),
        "blk.0.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN), "blk.0.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN), "blk.0.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
        "blk.0.ffn_gate.weight": (FFN, HIDDEN), "blk.0.ffn_up.weight": (FFN, HIDDEN),
        "blk.0.ffn_down.weight": (HIDDEN, FFN),
        "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.ffn_norm.weight": (HIDDEN,),
    }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def write_gguf(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Write a tiny llama GGUF holding ``tensors`` (numpy shapes, stored as F32)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(100000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3, 3] + [1] * (VOCAB - 3))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------- permutation


@pytest.mark.parametrize("n_head,head_dim,cols", [(9, 64, 576), (3, 64, 576), (2, 4, 8), (4, 8, 1)])
def test_unpermute_is_inverse_of_llama_cpp_permute(n_head: int, head_dim: int, cols: int) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n_head * head_dim, cols)).astype(np.float32)
    # llama.cpp convert_hf_to_gguf.py: reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2)
    reference = w.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(permute_qk(w, n_head), reference)
    np.testing.assert_array_equal(unpermute_qk(reference, n_head), w)
    np.testing.assert_array_equal(permute_qk(unpermute_qk(w, n_head), n_head), w)


def test_permute_interleaves_rotate_half_pairs() -> None:
    w = np.arange(8, dtype=np.float32)[:, None]  # one head, head_dim 8
    assert permute_qk(w, 1)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_tensor_name_mapping() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.0.bogus.weight") is None


# ---------------------------------------------------------------- tiny conversion


def test_convert_tiny_gguf(tmp_path: Path) -> None:
    hf = hf_tensors(np.random.default_rng(1))
    stored = dict(hf)
    stored["blk.0.attn_q.weight"] = permute_qk(hf["blk.0.attn_q.weight"], HEADS)
    stored["blk.0.attn_k.weight"] = permute_qk(hf["blk.0.attn_k.weight"], KV_HEADS)
    write_gguf(tmp_path / "tiny.gguf", stored)
    out = tmp_path / "ckpt"
    convert_gguf(tmp_path / "tiny.gguf", out)

    config = load_model_config(out)
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim) == (1, HIDDEN, HEAD_DIM)
    assert config.tie_word_embeddings is False
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1
    weights = load_weights(out, config)
    for gguf_name, arr in hf.items():
        np.testing.assert_array_equal(weights[hf_tensor_name(gguf_name)], arr, err_msg=gguf_name)
    tok = Tokenizer(out)
    assert tok.encode("ab<|im_end|>") == [VOCAB - 1, 2]
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x"
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is False


def test_convert_names_unknown_tensor(tmp_path: Path) -> None:
    tensors = hf_tensors(np.random.default_rng(2))
    tensors["blk.0.bogus.weight"] = np.zeros((4, HIDDEN), np.float32)
    write_gguf(tmp_path / "bad.gguf", tensors)
    with pytest.raises(ConversionError, match=r"bad\.gguf.*blk\.0\.bogus\.weight"):
        convert_gguf(tmp_path / "bad.gguf", tmp_path / "out")


def test_convert_names_mis_shaped_tensor(tmp_path: Path) -> None:
    tensors = hf_tensors(np.random.default_rng(3))
    tensors["blk.0.ffn_up.weight"] = np.zeros((FFN + 1, HIDDEN), np.float32)
    write_gguf(tmp_path / "shape.gguf", tensors)
    with pytest.raises(ConversionError, match=r"shape\.gguf.*blk\.0\.ffn_up\.weight"):
        convert_gguf(tmp_path / "shape.gguf", tmp_path / "out")


def test_convert_reports_missing_tensor(tmp_path: Path) -> None:
    tensors = hf_tensors(np.random.default_rng(4))
    del tensors["blk.0.ffn_down.weight"]
    write_gguf(tmp_path / "missing.gguf", tensors)
    with pytest.raises(ConversionError, match="mlp.down_proj"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")


# ---------------------------------------------------------------- ensure_default_model (offline)


def test_ensure_default_model_atomic_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_fetch(work: Path) -> Path:
        calls.append(work)
        write_gguf(work / "tiny.gguf", hf_tensors(np.random.default_rng(5)))
        return work / "tiny.gguf"

    monkeypatch.setattr(dm, "_fetch_gguf", fake_fetch)
    monkeypatch.setattr(dm, "convert_gguf", _failing_convert)
    with pytest.raises(RuntimeError, match="interrupted"):
        ensure_default_model(tmp_path)
    assert not (tmp_path / dm.DEFAULT_MODEL_NAME).exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []

    monkeypatch.setattr(dm, "convert_gguf", convert_gguf)
    path = ensure_default_model(tmp_path)
    assert path == tmp_path / dm.DEFAULT_MODEL_NAME
    assert ensure_default_model(tmp_path) == path
    assert len(calls) == 2  # the second successful call reused the cache
    # The GGUF stays beside the checkpoint, for --quantization q4.
    # So do the generation defaults (kvserve.model.generation_config).
    assert sorted(p.name for p in path.iterdir()) == sorted(
        dm._CHECKPOINT_FILES + ("tiny.gguf", "generation_config.json"))


def _failing_convert(gguf_path: Path, out_dir: Path) -> None:
    out_dir.mkdir(parents=True)
    (out_dir / "model.safetensors").write_bytes(b"half")
    raise RuntimeError("interrupted")


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    assert dm.cache_dir() == tmp_path
    monkeypatch.delenv("KVSERVE_CACHE")
    assert dm.cache_dir() == Path.home() / ".cache" / "kvserve"


# ---------------------------------------------------------------- loader


def _write_config(folder: Path, **overrides) -> None:
    config = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN,
              "intermediate_size": FFN, "num_hidden_layers": 1, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "eos_token_id": 2, **overrides}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))


def _hf_named(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {hf_tensor_name(k): v for k, v in hf_tensors(rng).items()}


def test_load_config_defaults_and_families(tmp_path: Path) -> None:
    _write_config(tmp_path / "a", num_key_value_heads=None, eos_token_id=[2, 0])
    cfg = load_model_config(tmp_path / "a")
    assert cfg.num_key_value_heads == HEADS and cfg.head_dim == HIDDEN // HEADS
    assert cfg.rope_theta == 10000.0 and cfg.tie_word_embeddings is False
    assert cfg.eos_token_ids == (2, 0) and cfg.attention_bias is False and cfg.name == "a"
    _write_config(tmp_path / "q", model_type="qwen2", sliding_window=4096)
    assert load_model_config(tmp_path / "q").attention_bias is True
    _write_config(tmp_path / "m", model_type="mistral", attention_bias=False)
    assert load_model_config(tmp_path / "m").model_type == "mistral"
    _write_config(tmp_path / "g", model_type="gemma")
    with pytest.raises(ValueError, match="gemma"):
        load_model_config(tmp_path / "g")


def test_load_weights_bf16_and_f16(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    _write_config(tmp_path)
    weights = _hf_named(np.random.default_rng(6))
    bf16 = {k: (v.view(np.uint32) >> 16).astype(np.uint16) for k, v in weights.items()}
    names = sorted(weights)
    save_file({k: weights[k].astype(np.float16) for k in names[:3]}, str(tmp_path / "a.safetensors"))
    _write_bf16_safetensors(tmp_path / "b.safetensors", {k: bf16[k] for k in names[3:]})
    loaded = load_weights(tmp_path, load_model_config(tmp_path))
    assert set(loaded) == set(weights)
    for k in names[3:]:  # bf16 is the float32's top half: truncation, exact to compare
        expect = (bf16[k].astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_array_equal(loaded[k], expect)
        assert loaded[k].dtype == np.float32
    for k in names[:3]:
        np.testing.assert_array_equal(loaded[k], weights[k].astype(np.float16).astype(np.float32))


def _write_bf16_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Write uint16 arrays as BF16 safetensors by hand (numpy has no bfloat16)."""
    header, offset, blobs = {}, 0, []
    for name, arr in tensors.items():
        data = np.ascontiguousarray(arr, dtype="<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def test_load_weights_errors_name_tensor(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    _write_config(tmp_path)
    weights = _hf_named(np.random.default_rng(7))
    bad = dict(weights)
    bad["model.layers.0.mlp.up_proj.weight"] = np.zeros((3, 3), np.float32)
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.safetensors.*model\.layers\.0\.mlp\.up_proj\.weight"):
        load_weights(tmp_path, load_model_config(tmp_path))
    del bad["model.layers.0.mlp.up_proj.weight"]
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        load_weights(tmp_path, load_model_config(tmp_path))


# ---------------------------------------------------------------- the real default model


@pytest.mark.model
def test_default_model_config(default_model_path: Path) -> None:
    cfg = load_model_config(default_model_path)
    assert cfg.model_type == "llama"
    assert cfg.num_hidden_layers == 30
    assert cfg.hidden_size == 576
    assert cfg.intermediate_size == 1536
    assert cfg.num_attention_heads == 9
    assert cfg.num_key_value_heads == 3
    assert cfg.head_dim == 64
    assert cfg.rope_theta == 100000.0
    assert cfg.tie_word_embeddings is True
    assert cfg.vocab_size == 49152
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    assert cfg.max_position_embeddings == 8192
    assert cfg.rms_norm_eps == pytest.approx(1e-5)


@pytest.mark.model
def test_default_model_weights(default_model_path: Path) -> None:
    cfg = load_model_config(default_model_path)
    weights = load_weights(default_model_path, cfg)
    assert "lm_head.weight" not in weights
    assert len(weights) == 2 + 9 * 30
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert all(w.dtype == np.float32 and np.isfinite(w).all() for w in weights.values())
    template = json.loads((default_model_path / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in template["chat_template"]
