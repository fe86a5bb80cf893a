"""The model families of ``tests/model/test_families.py`` on the CUDA backend
(Numba's simulator here) give the CPU backend's greedy tokens and logits.

The same tiny checkpoints (written by transformers, ``tests/model/data/
families``), their Hugging Face folders and their GGUFs (llama.cpp's
converter), through ``LlamaModel`` on ``CudaOps``: Llama 3's scaled RoPE table, Qwen2's biases, Qwen3's q/k norms
and head_dim, Mistral's sliding window (8 tokens, shorter than the 17-token
prompt) and Phi-3's split projections and LongRoPE table run on the CUDA
kernels. The simulator runs every CUDA thread as a Python thread, so one
prompt and a few tokens per family.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))

from test_families import DATA, FAMILIES, _reference  # noqa: E402

from kvserve.cpu.ops import CpuOps  # noqa: E402
from kvserve.cuda.ops import CudaOps  # noqa: E402
from kvserve.model.llama import AttentionMetadata, LlamaModel  # noqa: E402
from kvserve.model.loader import load_checkpoint_weights, load_model_config  # noqa: E402

#: CUDA against CPU raw logits, relative to the row's largest magnitude
#: (float32 sums in another order: as test_cuda_gemma's).
LOGIT_REL = 1e-4
BLOCK = 16
STEPS = 3


def _logits(model: LlamaModel, prompt: list[int], steps: int) -> tuple[list[int], list]:
    """Greedy tokens after ``prompt`` and every step's logits (float32 numpy)."""
    ops, cfg = model.ops, model.config
    blocks = (len(prompt) + steps) // BLOCK + 1
    caches = [ops.allocate_kv_cache(blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
              for _ in range(cfg.num_hidden_layers)]
    table = ops.to_device(np.arange(blocks, dtype=np.int32)[None, :])
    ids, new, tokens, rows = list(prompt), list(prompt), [], []
    for _ in range(steps):
        start = len(ids) - len(new)
        positions = np.arange(start, len(ids), dtype=np.int64)
        attn = AttentionMetadata(
            slot_mapping=ops.to_device(positions.copy()), block_tables=table,
            seq_lens=ops.to_device(np.array([len(ids)], np.int32)),
            query_start_loc=ops.to_device(np.array([0, len(new)], np.int32)))
        out = model.forward(ops.to_device(np.array(new, np.int64)), ops.to_device(positions),
                            attn, caches, ops.to_device(np.array([len(new) - 1], np.int64)))
        logits = np.asarray(ops.to_numpy(out))[0]
        rows.append(logits)
        tokens.append(int(np.argmax(logits)))
        ids.append(tokens[-1])
        new = [tokens[-1]]
    return tokens, rows


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_cuda_equals_cpu(family, source, tmp_path):
    """From the Hugging Face folder and from llama.cpp's GGUF of it."""
    folder = DATA / family
    if source == "gguf":
        from kvserve.model.gguf_model import resolve_model
        folder = Path(resolve_model(str(folder / "model.gguf"), cache=tmp_path))
    config = load_model_config(folder)
    weights = load_checkpoint_weights(folder, config, "none")
    prompt = _reference(family)["runs"][1]["prompt"]  # 17 tokens: past Mistral's window
    cpu_tokens, cpu_rows = _logits(LlamaModel(config, weights, CpuOps(num_threads=2)), prompt,
                                   STEPS)
    cuda_tokens, cuda_rows = _logits(LlamaModel(config, weights, CudaOps()), prompt, STEPS)
    assert cuda_tokens == cpu_tokens
    for got, want in zip(cuda_rows, cpu_rows):
        assert np.abs(got - want).max() <= LOGIT_REL * np.abs(want).max()
