"""tools/gpu_step_model.py, the model of a GPU decode step (issue 46): its
bytes are the model's own. A step moves every weight once and, per token,
activations and K/V; so the bytes of a step, extrapolated to zero tokens
(``2 bytes(1) - bytes(2)``), are the float16 bytes of every parameter,
counted here from the default model's safetensors headers, which the tool
never reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tools_support import load_tool

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def model_tool():
    return load_tool("gpu_step_model")


def _parameters(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "np") as f:
            for name in f.keys():
                count = 1
                for dim in f.get_slice(name).get_shape():
                    count *= dim
                total += count
    return total


def test_a_step_reads_every_weight_once(model_tool, default_model_path):
    from kvserve.model.loader import load_model_config

    cfg = load_model_config(default_model_path)
    assert cfg.tie_word_embeddings  # the LM head is the embedding table: read once
    one, two = (model_tool.model_table(cfg, b, 512, 2e-6)["totals"]["bytes"] for b in (1, 2))
    assert 2 * one - two == 2 * _parameters(default_model_path)


def test_launches_and_times(model_tool, default_model_path, tmp_path):
    """244 launches for SmolLM2's 30 layers (3 + 4 per layer Numba, 4 per layer
    cuBLAS, the LM head and argmax); each launch takes at least the floor;
    the H200's bandwidth makes no launch slower; a context past one
    partition adds the split-K reduction."""
    from kvserve.model.loader import load_model_config

    cfg = load_model_config(default_model_path)
    table = model_tool.model_table(cfg, 1, 512, 2e-6)
    assert table["totals"]["launches"] == 3 + 4 * 30 - 1 + 4 * 30 + 2
    for row in table["rows"]:
        assert row["H100_us"] >= row["launches"] * 2.0 - 1e-9
        assert row["H200_us"] <= row["H100_us"]
    longer = model_tool.model_table(cfg, 1, 513, 2e-6)
    assert longer["totals"]["launches"] == table["totals"]["launches"] + 30
    out = tmp_path / "model.json"
    assert model_tool.main(["--model", str(default_model_path), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["totals"]["launches"] == 244
