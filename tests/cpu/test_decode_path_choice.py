"""Which path a model's decode steps take is decided once, when the model is
built, and said (issue 49, item 2): ``Ops.decode_path`` from the model and
the backend's settings (``KVSERVE_CPU_FUSED_DECODE`` read when ``CpuOps``
is made, not at each step), kept in ``LlamaModel.decode_path``, and the
model calls the fused step only when it says ``fused``; a served engine
logs ``decode_path`` and exposes ``kvserve:decode_path_info{path}``."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))

from tiny_gemma import TinyGemmaSpec, load_tiny_gemma  # noqa: E402
from tiny_llama import SPECS, load_tiny  # noqa: E402

from kvserve.cpu import decode_path  # noqa: E402
from kvserve.cpu.ops import CpuOps  # noqa: E402
from kvserve.cuda.ops import CudaOps  # noqa: E402
from kvserve.model.llama import LlamaModel  # noqa: E402


def test_a_llama_model_is_fused_unless_the_backend_says_0(tmp_path, monkeypatch):
    config, weights = load_tiny(tmp_path, SPECS[0])
    model = LlamaModel(config, weights, CpuOps())
    assert model.decode_path.path == "fused"
    assert "at most 12 sequences of at most 16 new tokens" in model.decode_path.reason
    off = LlamaModel(config, weights, CpuOps(fused_decode="0"))
    assert (off.decode_path.path, off.decode_path.reason) == ("ops",
                                                              "KVSERVE_CPU_FUSED_DECODE=0")
    monkeypatch.setenv(decode_path.ENV, "0")  # read once, when CpuOps is made
    assert CpuOps().fused_decode == "0"
    monkeypatch.setenv(decode_path.ENV, "yes")
    with pytest.raises(ValueError, match="KVSERVE_CPU_FUSED_DECODE='yes': expected one of 1, 0"):
        CpuOps()


def test_gemma_and_tensor_parallelism_take_the_op_path(tmp_path):
    config, weights = load_tiny_gemma(tmp_path, TinyGemmaSpec(seed=0))
    gemma = LlamaModel(config, weights, CpuOps())
    assert gemma.decode_path.path == "ops"
    assert gemma.decode_path.reason.startswith("the architecture")
    config, weights = load_tiny(tmp_path / "llama", SPECS[0])
    split = LlamaModel(config, weights, CpuOps(), all_reduce=lambda a: None)
    assert split.decode_path.path == "ops" and "tensor parallelism" in split.decode_path.reason
    assert LlamaModel(config, weights, CudaOps()).decode_path.path == "ops"


def test_the_fused_step_is_called_only_on_the_fused_path(tmp_path, monkeypatch):
    """A forward of one decode token: the fused call happens with ``fused``,
    never with ``ops`` (no per-step probing of the backend)."""
    from kvserve.model.llama import AttentionMetadata

    config, weights = load_tiny(tmp_path, SPECS[0])
    calls = []
    for mode in ("1", "0"):
        ops = CpuOps(fused_decode=mode)
        kernel = ops.decode_layers
        monkeypatch.setattr(ops, "decode_layers", lambda *a, **k: calls.append(mode) or
                            kernel(*a, **k))
        model = LlamaModel(config, weights, ops)
        cache = [ops.allocate_kv_cache(2, 4, config.num_key_value_heads, config.head_dim)
                 for _ in range(config.num_hidden_layers)]
        attn = AttentionMetadata(slot_mapping=np.array([0], np.int64),
                                 block_tables=np.array([[0]], np.int32),
                                 seq_lens=np.array([1], np.int32),
                                 query_start_loc=np.array([0, 1], np.int32))
        model.forward(np.array([3], np.int64), np.array([0], np.int64), attn, cache,
                      np.array([0], np.int64))
    assert calls == ["1"]
