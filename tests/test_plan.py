"""``kvserve plan``: capacity arithmetic from config.json and safetensors headers,
equal to what the engine computes at start-up."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvserve.cli import main
from kvserve.core.plan import (GIB, GPU_RESERVED_BYTES, activation_workspace_bytes, count_parameters,
                          plan_capacity, read_safetensors_header)

TINY = {"model_type": "llama", "vocab_size": 32, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 4, "max_position_embeddings": 64, "tie_word_embeddings": True,
        "eos_token_id": 2}


@pytest.fixture()
def tiny_model(tmp_path):
    """A 2-layer checkpoint; also carries a tensor the loader drops (inv_freq)."""
    from kvserve.model.loader import expected_tensor_shapes, load_model_config

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    shapes = expected_tensor_shapes(load_model_config(tmp_path))
    tensors = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros(2, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path, sum(math.prod(s) for s in shapes.values())


def header_parameters(path):
    """Parameters summed straight from the safetensors headers (no kvserve code)."""
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def test_cpu_plan_arithmetic(tiny_model):
    path, params = tiny_model
    assert count_parameters(path, _config(path)) == params
    plan = plan_capacity(path, kv_cache_memory=10_000, block_size=4)
    per_token = 2 * 2 * 1 * 4 * 4
    assert (plan.weights_bytes, plan.kv_bytes_per_token) == (4 * params, per_token)
    assert plan.num_blocks == 10_000 // (4 * per_token) and plan.kv_tokens == plan.num_blocks * 4
    assert plan.max_model_len == 64 and plan.max_concurrency == plan.kv_tokens / 64
    assert plan_capacity(path, kv_cache_memory=10_000, block_size=4,
                         max_model_len=16).max_concurrency == plan.kv_tokens / 16


def test_plan_caps_max_model_len_like_the_engine(tiny_model):
    path, _ = tiny_model
    plan = plan_capacity(path, kv_cache_memory=3 * 4 * 64, block_size=4)  # 3 blocks
    assert (plan.kv_tokens, plan.max_model_len, plan.requested_max_model_len) == (12, 12, 64)
    assert plan.max_concurrency == 1.0


def test_gpu_plan_subtracts_weights_and_activations(tiny_model):
    path, params = tiny_model
    plan = plan_capacity(path, gpu_memory_gib=2, gpu_memory_utilization=0.5, dtype="bfloat16",
                         block_size=16, max_num_batched_tokens=32, max_num_seqs=2)
    per_token_act = 2 * 8 + (2 + 2) * 4 + 2 * 4 + 3 * 16
    activation = 32 * per_token_act * 2 + 2 * 32 * 8 + GPU_RESERVED_BYTES
    assert plan.activation_bytes == activation == activation_workspace_bytes(
        _config(path), 32, 2, 2)
    assert plan.weights_bytes == 2 * params and plan.kv_bytes_per_token == 2 * 2 * 1 * 4 * 2
    assert plan.kv_cache_memory == GIB - 2 * params - activation
    assert plan.num_blocks == plan.kv_cache_memory // (16 * plan.kv_bytes_per_token)


def test_plan_errors(tiny_model, capsys):
    path, _ = tiny_model
    with pytest.raises(ValueError, match="float32"):
        plan_capacity(path, dtype="float16")
    with pytest.raises(ValueError, match="leaves nothing"):
        plan_capacity(path, gpu_memory_gib=0.1)
    with pytest.raises(ValueError, match="holds no KV block"):
        plan_capacity(path, kv_cache_memory=10)
    assert main(["plan", "--model", str(path), "--gpu-memory-utilization", "0.5"]) == 2
    assert "needs --gpu-memory-gib" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a safetensors"):
        (path / "bad.safetensors").write_bytes(b"\x01")
        read_safetensors_header(path / "bad.safetensors")


def test_plan_table_output(tiny_model, capsys):
    path, _ = tiny_model
    assert main(["plan", "--model", str(path), "--kv-cache-memory", "1KiB",
                 "--block-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "KV cache size        16 tokens (4 blocks of 4)" in out
    assert "maximum concurrency  1.00x" in out and "capped from 64" in out


def _config(path):
    from kvserve.model.loader import load_model_config

    return load_model_config(path)


@pytest.mark.model
def test_plan_json_for_the_default_model(default_model_path, capsys):
    assert main(["plan", "--model", str(default_model_path), "--kv-cache-memory", "1GiB",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    params = header_parameters(default_model_path)
    assert params == 134_515_008
    tokens = (GIB // (16 * 46080)) * 16
    assert plan["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4 == 46080
    assert plan["kv_tokens"] == tokens == 23_296
    assert plan["max_model_len"] == 8192 and plan["max_concurrency"] == tokens / 8192
    assert plan["num_parameters"] == params and plan["weights_bytes"] == 4 * params


@pytest.mark.model
@pytest.mark.parametrize("memory, max_len", [("1GiB", 4096), ("100MiB", None)])
def test_plan_equals_engine_sizing(default_model_path, memory, max_len):
    from structlog.testing import capture_logs

    from kvserve.cli import build_parser, engine_config_from_args
    from kvserve.engine import build_engine_core

    flags = ["--model", str(default_model_path), "--kv-cache-memory", memory]
    flags += ["--max-model-len", str(max_len)] if max_len else []
    plan = plan_capacity(default_model_path, **_plan_kwargs(memory, max_len))
    with capture_logs() as logs:
        core = build_engine_core(engine_config_from_args(build_parser().parse_args(
            ["generate", "x", *flags])))
    (loaded,) = [e for e in logs if e["event"] == "engine_loaded"]
    assert loaded["weights_bytes"] == plan.weights_bytes
    assert (core.plan.bytes_per_token, core.plan.num_blocks, core.plan.num_tokens) == (
        plan.kv_bytes_per_token, plan.num_blocks, plan.kv_tokens)
    assert core.max_model_len == plan.max_model_len == core.plan.max_model_len
    assert core.plan.max_concurrency == plan.max_concurrency


def _plan_kwargs(memory, max_len):
    from kvserve.config import parse_size

    return {"kv_cache_memory": parse_size(memory), "max_model_len": max_len}


def test_int8_kv_cache_counts_codes_and_scales(tiny_model, tmp_path_factory):
    """``--kv-cache-dtype int8``: head_dim codes + a 4-byte scale per K or V
    vector (2 layers x 1 KV head x 2 x (4 + 4) bytes), against 4 bytes per
    value for float32; the default model's figures by hand: 30 layers, 3 KV
    heads, head_dim 64 give 2 x 30 x 3 x 68 = 12,240 bytes per token against
    46,080 (0.266x: the issue's bound is 0.3x), so 1 GiB holds at least 3.3x
    the requests."""
    from kvserve.config import CacheConfig
    from kvserve.core.plan import plan_kv_cache
    from kvserve.model.loader import load_model_config

    path, _ = tiny_model
    plan = plan_capacity(path, kv_cache_memory=10_000, block_size=4, kv_cache_dtype="int8")
    assert plan.kv_bytes_per_token == 2 * 2 * 1 * (4 + 4)
    assert plan.num_blocks == 10_000 // (4 * plan.kv_bytes_per_token)
    folder = tmp_path_factory.mktemp("smol")
    (folder / "config.json").write_text(json.dumps(dict(
        TINY, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        max_position_embeddings=8192)))
    smol = load_model_config(folder)
    plans = {d: plan_kv_cache(smol, CacheConfig(kv_cache_memory=GIB, kv_cache_dtype=d), 8192)
             for d in ("auto", "int8")}
    assert plans["auto"].bytes_per_token == 46_080 and plans["int8"].bytes_per_token == 12_240
    assert plans["int8"].bytes_per_token <= 0.3 * plans["auto"].bytes_per_token
    assert plans["int8"].max_concurrency >= 3.3 * plans["auto"].max_concurrency


def test_kv_cache_dtype_fp8_and_disk_flags_are_refused_in_one_line(tiny_model, capsys):
    """fp8 (vLLM's value) is not built; the disk tier needs its folder and the
    memory tier above it; a folder without the disk backend is a mistake."""
    from kvserve.config import CacheConfig

    with pytest.raises(ValueError, match="fp8 is not built: use --kv-cache-dtype int8"):
        CacheConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="must be one of auto, int8, fp8"):
        CacheConfig(kv_cache_dtype="float16")
    with pytest.raises(ValueError, match="needs --kv-offloading-path"):
        CacheConfig(kv_offloading_backend="disk", kv_offloading_size=1.0)
    with pytest.raises(ValueError, match="give --kv-offloading-size"):
        CacheConfig(kv_offloading_backend="disk", kv_offloading_path="/tmp/x")
    with pytest.raises(ValueError, match="add --kv-offloading-backend disk"):
        CacheConfig(kv_offloading_path="/tmp/x")
    assert main(["plan", "--model", str(tiny_model[0]), "--kv-cache-dtype", "fp8"]) == 2
    assert "fp8 is not built" in capsys.readouterr().err
