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
    # the default model's float32 Llama layers take the fused decode step (issue 49)
    (path,) = [e for e in logs if e["event"] == "decode_path"]
    assert path["path"] == core.decode_path.path == "fused"
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


# Model parallelism (issue 32): each device's share, worked by hand.
#
# TP_TINY: 3 layers, 6 query heads in 3 GQA groups of 2, head_dim 4, hidden 8,
# intermediate 10, vocab 32, untied LM head. -tp 2 -pp 2:
#   stages (vLLM's split): 3 // 2 = 1 each, the remainder to the stage before
#     the last: layers [0, 2) and [2, 3).
#   TP ranks: KV heads [0, 1) and [1, 3) (3 // 2 = 1), query heads 2 and 4;
#     MLP columns 10 / 2 = 5 each.
#   per layer, rank with Q query heads, K KV heads, C columns:
#     q: Q*4*8, k and v: K*4*8 each, o: 8*Q*4, gate/up/down: C*8 each,
#     2 norms of 8 (replicated).
TP_TINY = dict(TINY, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3,
               intermediate_size=10, tie_word_embeddings=False, max_position_embeddings=64)


def _layer(q, k, c):
    return q * 4 * 8 + 2 * k * 4 * 8 + 8 * q * 4 + 3 * c * 8 + 2 * 8


RANK0, RANK1 = _layer(2, 1, 5), _layer(4, 2, 5)  # 328, 520
EMBED = LM_HEAD = 32 * 8
FINAL_NORM = 8


def _checkpoint(folder, config):
    from kvserve.model.loader import expected_tensor_shapes, load_model_config

    (folder / "config.json").write_text(json.dumps(config))
    shapes = expected_tensor_shapes(load_model_config(folder))
    save_file({name: np.zeros(shape, np.float32) for name, shape in shapes.items()},
              str(folder / "model.safetensors"))
    return folder


@pytest.fixture()
def tp_tiny(tmp_path):
    return _checkpoint(tmp_path, TP_TINY)


def test_parallel_plan_per_device_arithmetic(tp_tiny):
    assert (RANK0, RANK1) == (328, 520)
    assert RANK0 + RANK1 == 832 + 16  # the whole layer, and its norms a second time
    plan = plan_capacity(tp_tiny, kv_cache_memory=4096, block_size=4, max_model_len=16,
                         tensor_parallel_size=2, pipeline_parallel_size=2)
    d = plan.devices
    assert [(x.stage, x.tp_rank, x.layer_start, x.layer_stop, x.q_heads, x.kv_heads)
            for x in d] == [(0, 0, 0, 2, 2, 1), (0, 1, 0, 2, 4, 2),
                            (1, 0, 2, 3, 2, 1), (1, 1, 2, 3, 4, 2)]
    params = [EMBED + 2 * RANK0, EMBED + 2 * RANK1,
              RANK0 + FINAL_NORM + LM_HEAD, RANK1 + FINAL_NORM + LM_HEAD]
    assert params == [912, 1296, 592, 784]
    assert [x.num_parameters for x in d] == params
    assert [x.weights_bytes for x in d] == [4 * p for p in params]
    # 2 (K, V) x stage layers x KV heads held x head_dim 4 x 4 bytes
    per_token = [2 * 2 * 1 * 4 * 4, 2 * 2 * 2 * 4 * 4, 2 * 1 * 1 * 4 * 4, 2 * 1 * 2 * 4 * 4]
    assert [x.kv_bytes_per_token for x in d] == per_token == [64, 128, 32, 64]
    # 4096 bytes per worker in whole blocks of 4 tokens
    blocks = [4096 // (4 * b) for b in per_token]
    assert [x.num_blocks for x in d] == blocks == [16, 8, 32, 16]
    assert [x.kv_tokens for x in d] == [64, 32, 128, 64]
    assert [x.kv_cache_memory for x in d] == [4096] * 4
    assert (plan.num_blocks, plan.kv_tokens, plan.max_model_len) == (8, 32, 16)
    assert plan.max_concurrency == 32 / 16
    assert (plan.weights_bytes, plan.kv_bytes_per_token, plan.kv_cache_memory) == (
        4 * 3584, 288, 4 * 4096)
    assert plan.num_parameters == 3 * 832 + EMBED + FINAL_NORM + LM_HEAD


def test_parallel_plan_caps_the_model_length_at_the_tightest_device(tp_tiny):
    plan = plan_capacity(tp_tiny, kv_cache_memory=4096, block_size=4,
                         tensor_parallel_size=2, pipeline_parallel_size=2)
    assert (plan.kv_tokens, plan.max_model_len, plan.requested_max_model_len) == (32, 32, 64)
    assert plan.max_concurrency == 1.0
    assert [x.max_concurrency for x in plan.devices] == [2.0, 1.0, 4.0, 2.0]


def test_parallel_plan_with_a_partition_and_int8(tp_tiny):
    """--pp-layer-partition 1,2: stage 0 holds layer 0, stage 1 layers 1 and 2;
    int8 KV: head_dim + 4 = 8 bytes per K or V vector."""
    plan = plan_capacity(tp_tiny, kv_cache_memory=4096, block_size=4,
                         pipeline_parallel_size=2, pp_layer_partition=(1, 2),
                         kv_cache_dtype="int8")
    whole = 832
    assert [(x.layer_start, x.layer_stop) for x in plan.devices] == [(0, 1), (1, 3)]
    assert [x.num_parameters for x in plan.devices] == [EMBED + whole,
                                                        2 * whole + FINAL_NORM + LM_HEAD]
    assert [x.kv_bytes_per_token for x in plan.devices] == [2 * 1 * 3 * 8, 2 * 2 * 3 * 8]


def test_tied_embedding_is_held_by_the_last_stage_too(tiny_model):
    """TINY (tied, 2 layers of 592 parameters: q 64, k 32, v 32, o 64, MLP
    3 x 16 x 8, norms 16): -pp 2 puts the embedding on stage 0 and, as the
    LM head, on stage 1; -tp 2 on 2 heads / 1 KV head replicates the KV head."""
    path, _ = tiny_model
    layer = 64 + 32 + 32 + 64 + 3 * 16 * 8 + 16
    plan = plan_capacity(path, kv_cache_memory=10_000, block_size=4, pipeline_parallel_size=2)
    assert [x.num_parameters for x in plan.devices] == [EMBED + layer,
                                                        layer + FINAL_NORM + EMBED]
    plan = plan_capacity(path, kv_cache_memory=10_000, block_size=4, tensor_parallel_size=2)
    # each rank: 1 query head, the 1 KV head (replicated), 8 MLP columns
    half = 1 * 4 * 8 + 2 * 1 * 4 * 8 + 8 * 1 * 4 + 3 * 8 * 8 + 16
    assert [x.num_parameters for x in plan.devices] == [EMBED + 2 * half + FINAL_NORM] * 2
    assert [x.kv_bytes_per_token for x in plan.devices] == [2 * 2 * 1 * 4 * 4] * 2


def test_parallel_gpu_plan_subtracts_each_devices_weights_and_activations(tp_tiny):
    """2 GiB x 0.5 per device, bfloat16, 8 batched tokens, 2 sequences: a
    device's activations are those of its heads and MLP columns (per token:
    2 x hidden + (Q + 2K) x head_dim + Q x head_dim + 3 x C), and the float32
    logits and probabilities of 2 rows of the vocabulary on the last stage only."""
    plan = plan_capacity(tp_tiny, gpu_memory_gib=2, gpu_memory_utilization=0.5,
                         dtype="bfloat16", block_size=4, max_num_batched_tokens=8,
                         max_num_seqs=2, tensor_parallel_size=2, pipeline_parallel_size=2)
    act0 = 8 * (2 * 8 + (2 + 2) * 4 + 2 * 4 + 3 * 5) * 2 + GPU_RESERVED_BYTES  # Q=2, K=1
    act1 = 8 * (2 * 8 + (4 + 4) * 4 + 4 * 4 + 3 * 5) * 2 + GPU_RESERVED_BYTES  # Q=4, K=2
    logits = 2 * 32 * 4 * 2
    acts = [act0, act1, act0 + logits, act1 + logits]
    assert [x.activation_bytes for x in plan.devices] == acts
    params = [912, 1296, 592, 784]
    memory = [GIB - 2 * p - a for p, a in zip(params, acts)]
    assert [x.kv_cache_memory for x in plan.devices] == memory
    per_token = [2 * 2 * 1 * 4 * 2, 2 * 2 * 2 * 4 * 2, 2 * 1 * 1 * 4 * 2, 2 * 1 * 2 * 4 * 2]
    assert [x.num_blocks for x in plan.devices] == [m // (4 * b)
                                                    for m, b in zip(memory, per_token)]
    assert plan.num_blocks == memory[1] // (4 * per_token[1])
    assert (plan.kv_cache_memory, plan.activation_bytes) == (sum(memory), sum(acts))
    assert plan.gpu_memory_bytes == 2 * GIB


def test_parallel_plan_table_and_json(tp_tiny, capsys):
    flags = ["plan", "--model", str(tp_tiny), "--kv-cache-memory", "4096", "--block-size", "4",
             "--max-model-len", "16", "-tp", "2", "-pp", "2"]
    assert main(flags) == 0
    out = capsys.readouterr().out
    assert "devices                           4 (2 pipeline stages x 2 tensor-parallel ranks)" \
        in out
    assert out.splitlines()[-6:] == [
        "stage  tp rank  layers  q/KV heads  weights MiB  KV bytes/token  KV tokens",
        "    0        0     0-1         2/1         0.00              64         64",
        "    0        1     0-1         4/2         0.00             128         32",
        "    1        0     2-2         2/1         0.00              32        128",
        "    1        1     2-2         4/2         0.00              64         64",
        "KV tokens: 32 (the tightest device)"]
    assert main([*flags, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["tensor_parallel_size"], plan["pipeline_parallel_size"]) == (2, 2)
    assert [x["kv_tokens"] for x in plan["devices"]] == [64, 32, 128, 64]
    assert plan["devices"][1]["weights_bytes"] == 4 * 1296 and plan["kv_tokens"] == 32
    assert main(["plan", "--model", str(tp_tiny), "--json"]) == 0
    assert "devices" not in json.loads(capsys.readouterr().out)  # one device: as before


@pytest.mark.parametrize("flags, message", [
    (["-pp", "4"], "--pipeline-parallel-size 4 is more stages than the model's 3 layers"),
    (["-pp", "2", "--pp-layer-partition", "2,2"], "2,2 must be 2 positive layer counts"),
    (["-pp", "2", "--pp-layer-partition", "2;1"], "comma-separated layer counts"),
    (["-tp", "4"], "--tensor-parallel-size 4 with 3 KV heads"),  # 4 > 3, 4 % 3 != 0
    (["-tp", "2", "-pp", "2", "--kv-cache-memory", "100"], "stage 0, TP rank 0: "
                                                            "--kv-cache-memory 100 bytes"),
    (["-tp", "2", "--gpu-memory-gib", "0.5"], "stage 0, TP rank 0: 0.5 GiB"),
])
def test_parallel_plan_errors_are_one_line(tp_tiny, capsys, flags, message):
    assert main(["plan", "--model", str(tp_tiny), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.model
def test_parallel_plan_of_the_default_model(default_model_path):
    """SmolLM2-135M, -tp 2 -pp 2, float32, 1 GiB per worker. By hand: embedding
    49,152 x 576 = 28,311,552; a layer's rank 1 (6 query heads, KV heads 1-2,
    768 MLP columns): q and o 6 x 64 x 576 = 221,184 each, k and v 2 x 64 x 576
    = 73,728 each, gate/up/down 768 x 576 = 442,368 each, norms 2 x 576."""
    plan = plan_capacity(default_model_path, tensor_parallel_size=2, pipeline_parallel_size=2)
    rank1_layer = 2 * 221_184 + 2 * 73_728 + 3 * 442_368 + 2 * 576
    assert rank1_layer == 1_918_080
    device = plan.devices[1]
    assert (device.layer_start, device.layer_stop, device.q_heads, device.kv_heads) == (
        0, 15, 6, 2)
    assert device.weights_bytes == 4 * (28_311_552 + 15 * rank1_layer) == 228_331_008
    assert device.kv_bytes_per_token == 2 * 15 * 2 * 64 * 4 == 15_360
    assert plan.kv_tokens == (GIB // (16 * 15_360)) * 16 == 69_904
    assert plan.max_concurrency == 69_904 / 8192


def test_a_block_scheme_that_quantized_nothing_says_so():
    """``-q w4a8`` on a float checkpoint (an F16 GGUF: 4,096.3 MiB before and
    after, seen on a 1B synthetic file) keeps its weights float; the start-up
    says so in a warning instead of a line that saves 0.0 MiB. A scheme that
    saved bytes says nothing more."""
    from structlog.testing import capture_logs

    from kvserve.config import ModelConfig
    from kvserve.startup import _log_quantization

    model = ModelConfig(name="m", model_type="llama", vocab_size=32, hidden_size=64,
                        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                        rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=True,
                        attention_bias=False, bos_token_id=None, eos_token_ids=(0,))
    with capture_logs() as logs:
        _log_quantization("w4a8", model, 4096, 4096, 4)
        _log_quantization("w4a8", model, 4096, 1024, 4)
        _log_quantization("int8", model, 4096, 4096, 4)
    events = [e["event"] for e in logs]
    assert events == ["quantization_no_blocks", "quantization", "quantization", "quantization"]
    assert "-q w4a8 quantized nothing" in logs[0]["message"]
