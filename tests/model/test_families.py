"""Model families against transformers: greedy tokens of tiny random checkpoints.

``data/families/<family>/`` was written by ``tools/make_family_references.py``
(transformers 5.25, CPU torch, in a venv of its own): the checkpoint as
transformers saved it (config.json in transformers 5's form, bfloat16
safetensors), the same folder converted to ``model.gguf`` by llama.cpp's own
``convert_hf_to_gguf.py``, and ``reference.json``: three prompts and
transformers' 24 greedy tokens after each, with their top-2 logit margins.

Families: a plain Llama, Llama 3.x (its ``llama3`` RoPE: an ignored
``rope_scaling`` changes the tokens), Qwen2 (q/k/v biases, a RoPE base of
1,000,000 inside ``rope_parameters``), Qwen3 (q/k RMSNorm, a ``head_dim``
of its own), Mistral (a sliding window of 8 tokens, shorter than the
prompts) and Phi-3 (fused ``qkv_proj`` / ``gate_up_proj``, LongRoPE's short
factors below the original 64-token context).

kvserve runs each prompt through ``LlamaModel.forward`` on the CPU backend,
a prompt step then one decode step a token (the fused decode path where the
architecture has it), and must give transformers' tokens under the golden
tests' near-tie rule: a divergence is accepted only where our own top-2
logits differ by less than 1e-3, and the comparison stops there.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvserve.cpu.ops import CpuOps
from kvserve.model.llama import AttentionMetadata, LlamaModel
from kvserve.model.loader import (CONFIG_KEYS_READ, HARMLESS_CONFIG_KEYS, load_checkpoint_weights,
                                  load_model_config)

DATA = Path(__file__).parent / "data" / "families"
FAMILIES = sorted(p.name for p in DATA.iterdir() if (p / "reference.json").is_file())
LOGIT_TOL = 1e-3
BLOCK = 16


def _reference(family: str) -> dict:
    return json.loads((DATA / family / "reference.json").read_text())


def greedy(model: LlamaModel, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens after ``prompt`` (one prompt step, then a step a token)
    and our top-2 logit gap at each."""
    cfg = model.config
    blocks = (len(prompt) + steps) // BLOCK + 1
    caches = [model.ops.allocate_kv_cache(blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
              for _ in range(cfg.num_hidden_layers)]
    table = np.arange(blocks, dtype=np.int32)[None, :]
    ids, out, gaps = list(prompt), [], []
    new = list(prompt)
    for _ in range(steps):
        start = len(ids) - len(new)
        positions = np.arange(start, len(ids), dtype=np.int64)
        attn = AttentionMetadata(slot_mapping=positions.copy(), block_tables=table,
                                 seq_lens=np.array([len(ids)], np.int32),
                                 query_start_loc=np.array([0, len(new)], np.int32))
        logits = np.asarray(model.forward(np.array(new, np.int64), positions, attn, caches,
                                          np.array([len(new) - 1], np.int64)))[0]
        logits = logits.astype(np.float64)
        top = np.sort(logits)[-2:]
        token = int(np.argmax(logits))
        out.append(token)
        gaps.append(float(top[1] - top[0]))
        ids.append(token)
        new = [token]
    return out, gaps


def _check(family: str, model: LlamaModel) -> None:
    ref = _reference(family)
    for run in ref["runs"]:
        tokens, gaps = greedy(model, run["prompt"], ref["new_tokens"])
        for i, (want, have) in enumerate(zip(run["tokens"], tokens)):
            if want != have:
                assert gaps[i] < LOGIT_TOL, (
                    f"{family}: token {i} is {have}, transformers' {want} (our top-2 gap "
                    f"{gaps[i]:.3g}, theirs {run['margins'][i]:.3g})\n"
                    f"expected {run['tokens']}\ngot      {tokens}")
                break


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_folder_equals_transformers(family):
    folder = DATA / family
    config = load_model_config(folder)
    weights = load_checkpoint_weights(folder, config, "none")
    _check(family, LlamaModel(config, weights, CpuOps(num_threads=2)))


#: Families whose GGUF cannot hold what transformers computes: llama.cpp's
#: converter writes a Mistral as ``llama`` and drops its ``sliding_window``
#: (llama.cpp serves it with full attention, as kvserve then does); the tiny
#: checkpoint's window of 8 is shorter than its prompts.
GGUF_LOSES = {"mistral": "sliding_window"}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("quantization", ["none", "w4a8"])
def test_gguf_equals_transformers(family, quantization, tmp_path):
    """The folder converted by llama.cpp's ``convert_hf_to_gguf.py`` (bf16
    tensors, F32 norms; Llama's q/k rows permuted, Llama 3's ``rope_freqs``,
    Phi-3's fused tensors and LongRoPE factor tensors), served as
    ``--model model.gguf`` is: the same tokens as transformers. ``w4a8``
    serves the file's blocks (here bf16, read as float32: the same path)."""
    from kvserve.model.gguf_model import resolve_model
    folder = Path(resolve_model(str(DATA / family / "model.gguf"), cache=tmp_path))
    config = load_model_config(folder)
    if family in GGUF_LOSES:
        assert config.sliding_window is None and GGUF_LOSES[family] in json.loads(
            (DATA / family / "config.json").read_text())
        return
    weights = load_checkpoint_weights(folder, config, quantization)
    _check(family, LlamaModel(config, weights, CpuOps(num_threads=2), quantization))


@pytest.mark.parametrize("family", FAMILIES)
def test_config_keys_are_all_read_or_harmless(family):
    """Every key transformers wrote into the family's config.json is one
    kvserve reads (``CONFIG_KEYS_READ``) or knows to change nothing
    (``HARMLESS_CONFIG_KEYS``): a key that changes the outputs is never
    dropped unseen. A new transformers release adding one fails here."""
    cfg = json.loads((DATA / family / "config.json").read_text())
    read = CONFIG_KEYS_READ[cfg["model_type"]]
    assert sorted(k for k in cfg if k not in read and k not in HARMLESS_CONFIG_KEYS) == []


def test_an_ignored_rope_scaling_would_be_seen():
    """The llama3 family's tokens depend on its ``rope_scaling``: served with
    plain RoPE (what kvserve did before), they differ from transformers'."""
    import dataclasses
    folder = DATA / "llama3"
    config = load_model_config(folder)
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == "llama3"
    plain = dataclasses.replace(config, rope_scaling=None)
    model = LlamaModel(plain, load_checkpoint_weights(folder, plain, "none"),
                       CpuOps(num_threads=2))
    ref = _reference("llama3")
    assert any(greedy(model, run["prompt"], ref["new_tokens"])[0] != run["tokens"]
               for run in ref["runs"])


@pytest.mark.parametrize("change, key", [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "dynamic"),
    ({"rope_parameters": {"rope_type": "su", "rope_theta": 1e4}}, "'su'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta_fast": 3}}, "'beta_fast'"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
])
def test_math_changing_keys_refused_before_loading(change, key, tmp_path):
    """A config whose math kvserve does not compute is refused in one line
    naming the file and the key, by ``load_model_config`` (before any weight
    is read)."""
    cfg = json.loads((DATA / "llama" / "config.json").read_text())
    cfg.update(change)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=key) as err:
        load_model_config(tmp_path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(tmp_path / "config.json"))


def test_unknown_keys_are_logged(tmp_path):
    """A key kvserve neither reads nor knows to be harmless is named in the
    ``config_keys_not_read`` warning (not refused: it may be bookkeeping)."""
    import structlog
    cfg = json.loads((DATA / "llama" / "config.json").read_text())
    cfg["attention_multiplier"] = 0.5
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with structlog.testing.capture_logs() as logs:
        load_model_config(tmp_path)
    assert [e["keys"] for e in logs if e["event"] == "config_keys_not_read"] == \
        [["attention_multiplier"]]


QUANTIZED = sorted(p.parent.name for p in DATA.glob("*/model-q4_k_m.gguf"))
#: Q8_K activations (llama.cpp's scheme) move these random models' logits by
#: 1.4-3.2% of their largest (measured, the three files' prompts, fixed
#: seeds): 5% allowed. Codes read with a wrong scale, or parts split at the
#: wrong rows, are far off.
LOGIT_REL_Q = 0.05
#: ... which is up to about 0.4 of these logits (|max| ~ 13): a greedy
#: divergence is accepted where the float run's top-2 margin is below 0.5.
ACTIVATION_MARGIN = 0.5


def _prompt_logits(model: LlamaModel, ids: list[int]) -> np.ndarray:
    """float64[len(ids), vocab]: every prompt position's logits, one step."""
    cfg = model.config
    blocks = len(ids) // BLOCK + 1
    caches = [model.ops.allocate_kv_cache(blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
              for _ in range(cfg.num_hidden_layers)]
    pos = np.arange(len(ids), dtype=np.int64)
    attn = AttentionMetadata(slot_mapping=pos.copy(),
                             block_tables=np.arange(blocks, dtype=np.int32)[None],
                             seq_lens=np.array([len(ids)], np.int32),
                             query_start_loc=np.array([0, len(ids)], np.int32))
    return np.asarray(model.forward(np.array(ids, np.int64), pos, attn, caches, pos),
                      np.float64)


@pytest.mark.parametrize("family", QUANTIZED)
def test_q4_k_m_blocks_equal_the_dequantized_file(family, tmp_path):
    """The family's Q4_K_M file (llama.cpp's ``llama-quantize``; Q4_K and
    Q6_K tensors, Phi-3's fused ``attn_qkv`` / ``ffn_up`` among them, split
    into q/k/v and gate/up panels by rows) served on its blocks, as
    ``--model file.gguf`` does by default on a CPU (K-quant panels, Q8_K
    activations; the fused decode step for Llama 3 and Phi-3), against the
    same file dequantized by the ``gguf`` package and run in float32 (the
    path proven against transformers above): every prompt position's
    logits within ``LOGIT_REL_Q`` of their largest, and the same greedy
    tokens up to a near-tie of the float run."""
    from kvserve.model.ggml_blocks import KQuantWeight
    from kvserve.model.gguf_model import resolve_model

    folder = Path(resolve_model(str(DATA / family / "model-q4_k_m.gguf"), cache=tmp_path))
    config = load_model_config(folder)
    exact = LlamaModel(config, load_checkpoint_weights(folder, config, "none"),
                       CpuOps(num_threads=2))
    blocks = LlamaModel(config, load_checkpoint_weights(folder, config, "w4a8"),
                        CpuOps(num_threads=2), "w4a8")
    assert isinstance(blocks.layers[0].down, KQuantWeight)
    for run in _reference(family)["runs"]:
        want = _prompt_logits(exact, run["prompt"])
        got = _prompt_logits(blocks, run["prompt"])
        assert (np.abs(got - want).max(1) <= LOGIT_REL_Q * np.abs(want).max(1)).all()
        tokens, margins = greedy(exact, run["prompt"], 12)
        for i, (w, g) in enumerate(zip(tokens, greedy(blocks, run["prompt"], 12)[0])):
            if w != g:
                assert margins[i] < ACTIVATION_MARGIN, (family, i, margins[i])
                break


def test_a_gguf_is_served_under_its_files_stem(tmp_path):
    """Issue 48, item 5: ``--model path/qwen3-tiny.Q4_K_M.gguf`` answers to
    ``qwen3-tiny.Q4_K_M`` (llama.cpp's server names it so), not to its
    cache folder's ``<stem>-<key>``; a folder keeps its own name."""
    import shutil

    from kvserve.model.gguf_model import resolve_model, served_name

    gguf = tmp_path / "qwen3-tiny.Q4_K_M.gguf"
    shutil.copy(DATA / "qwen3" / "model-q4_k_m.gguf", gguf)
    folder = Path(resolve_model(str(gguf), cache=tmp_path / "cache"))
    assert folder.name != "qwen3-tiny.Q4_K_M" and served_name(folder) == "qwen3-tiny.Q4_K_M"
    assert served_name(DATA / "qwen2") == "qwen2"


def test_a_partial_rotary_served_whole_would_be_seen(monkeypatch):
    """Phi-4-mini's RoPE turns three quarters of each head: with the q/k rows
    left in their own order (no ``qk_row_orders``), the kernels rotate the
    wrong pairs and the tokens differ from transformers'."""
    from kvserve.model import loader

    folder = DATA / "phi4mini"
    config = load_model_config(folder)
    assert config.rope.rotary_fraction == 0.75
    monkeypatch.setattr(loader, "qk_row_orders", lambda config: None)
    model = LlamaModel(config, load_checkpoint_weights(folder, config, "none"),
                       CpuOps(num_threads=2))
    ref = _reference("phi4mini")
    assert any(greedy(model, run["prompt"], ref["new_tokens"])[0] != run["tokens"]
               for run in ref["runs"])
