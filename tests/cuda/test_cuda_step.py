"""Issue 26, items 3 and 4, under Numba's CUDA simulator: a step's inputs
are checked on the host and uploaded in one copy; a decode step makes one
host-to-device and one device-to-host copy (its sampled token ids) and at
most 4 Numba launches per layer, counted by ``CudaOps.counters``; the fused
decode kernel (RoPE + KV write + GQA-group attention) equals the three ops
it replaces on the CPU backend."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))  # the tiny checkpoint

from test_forward_reference import make_runner  # noqa: E402
from tiny_llama import SPECS, load_tiny  # noqa: E402

from kvserve.core.request import Request  # noqa: E402
from kvserve.core.sampling_params import SamplingParams  # noqa: E402
from kvserve.cpu.ops import CpuOps  # noqa: E402
from kvserve.cuda import kernels  # noqa: E402
from kvserve.cuda.ops import CudaOps  # noqa: E402
from kvserve.model.input_batch import BatchInputs  # noqa: E402
from kvserve.model.llama import AttentionMetadata  # noqa: E402
from kvserve.model.ops import QKNorm, StepGeometry, build_rope_cache  # noqa: E402

#: Numba launches of a decode step outside the layers: the embedding, the
#: first layer's input norm, the final norm.
LAUNCHES_OUTSIDE_LAYERS = 3
#: The goal: add + norm, RoPE + KV write + attention, add + norm, SiLU-and-mul.
MAX_LAUNCHES_PER_LAYER = 4

#: The default model's attention layout (SmolLM2-135M: 9 query heads, 3 KV
#: heads of 64), on a tiny random checkpoint of 2 layers.
DEFAULT_HEADS = dataclasses.replace(SPECS[0], name="smollm2-heads", num_hidden_layers=2,
                                    hidden_size=72, num_attention_heads=9,
                                    num_key_value_heads=3, intermediate_size=96)


def _decode_step_counters(tmp_path, spec, prompts):
    """Prefill ``prompts`` on the simulated CUDA backend, then count what one
    decode step of all of them does: (launches, h2d, d2h)."""
    config, weights = load_tiny(tmp_path, spec)
    ops = CudaOps()
    runner, scheduler = make_runner(config, weights, ops, num_blocks=16, block_size=4,
                                    budget=64)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(temperature=0.0,
                                                                       max_tokens=4)))
    prefill = scheduler.schedule()
    scheduler.update_from_output(prefill, runner.execute(prefill).sampled)
    decode = scheduler.schedule()
    assert all(chunk.num_tokens == 1 for chunk in decode.scheduled)  # a decode step
    ops.reset_counters()
    output = runner.execute(decode)
    assert sorted(output.sampled) == sorted(f"r{i}" for i in range(len(prompts)))
    return config, ops.counters


def test_a_decode_step_is_one_copy_each_way_and_four_launches_a_layer(tmp_path):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 512, n).tolist() for n in (3, 6)]
    config, counters = _decode_step_counters(tmp_path, DEFAULT_HEADS, prompts)
    assert (counters.h2d, counters.d2h) == (1, 1)  # the step's inputs; the sampled ids
    per_layer = (counters.launches - LAUNCHES_OUTSIDE_LAYERS) / config.num_hidden_layers
    assert per_layer <= MAX_LAUNCHES_PER_LAYER, counters


def test_a_bad_index_is_refused_on_the_host_before_any_copy() -> None:
    ops = CudaOps()
    batch = BatchInputs(
        input_ids=np.array([5, 700], np.int64), positions=np.array([0, 1], np.int64),
        slot_mapping=np.array([0, 1], np.int64), block_tables=np.array([[0]], np.int32),
        seq_lens=np.array([2], np.int32), query_start_loc=np.array([0, 2], np.int32),
        logits_indices=np.array([1], np.int64), sample_ids=("a",))
    with pytest.raises(ValueError, match="input_ids out of range"):
        ops.prepare_step(batch, StepGeometry(vocab_size=512, max_position=64, num_blocks=4,
                                             block_size=4))
    bad_block = dataclasses.replace(batch, input_ids=np.array([5, 6], np.int64),
                                    block_tables=np.array([[9]], np.int32))
    with pytest.raises(ValueError, match="block id out of range"):
        ops.prepare_step(bad_block, StepGeometry(512, 64, 4, 4))
    assert (ops.counters.h2d, ops.counters.launches) == (0, 0)


def _fused_case(seed: int, num_heads: int, num_kv_heads: int, head_dim: int,
                contexts: list[int], block_size: int = 4):
    """A decode step of ``len(contexts)`` sequences whose earlier tokens are
    in a random cache: (qkv, batch, cache, rope table, geometry)."""
    rng = np.random.default_rng(seed)
    T = len(contexts)
    blocks_per_seq = -(-max(contexts) // block_size)
    num_blocks = T * blocks_per_seq + 1
    cache = rng.standard_normal((num_blocks, 2, block_size, num_kv_heads, head_dim),
                                dtype=np.float32)
    tables = rng.permutation(num_blocks)[:T * blocks_per_seq].reshape(T, blocks_per_seq)
    positions = np.array(contexts, np.int64) - 1
    slots = tables[np.arange(T), positions // block_size] * block_size + positions % block_size
    batch = BatchInputs(
        input_ids=np.zeros(T, np.int64), positions=positions, slot_mapping=slots.astype(np.int64),
        block_tables=tables.astype(np.int32), seq_lens=np.array(contexts, np.int32),
        query_start_loc=np.arange(T + 1, dtype=np.int32),
        logits_indices=np.arange(T, dtype=np.int64), sample_ids=tuple(map(str, range(T))))
    qkv = rng.standard_normal((T, (num_heads + 2 * num_kv_heads) * head_dim), dtype=np.float32)
    rope = build_rope_cache(head_dim, 64, 1000.0)
    return qkv, batch, cache, rope, StepGeometry(16, 64, num_blocks, block_size)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, contexts, partition", [
    (9, 3, 8, [3, 9], 512),        # the default model's GQA ratio, one partition
    (4, 4, 4, [1, 6, 13], 512),    # no GQA; a first token alone in its context
    (8, 1, 4, [11, 5], 4),         # 8 query heads on one KV head, split-K partitions of 4
    (4, 2, 6, [12], 4),            # the new token at a partition's first position
], ids=["gqa3", "mha", "gqa8-split", "partition-edge"])
@pytest.mark.parametrize("normed", [False, True], ids=["", "qk-norm"])
def test_fused_decode_equals_rope_write_and_attention_on_the_cpu(num_heads, num_kv_heads,
                                                                 head_dim, contexts, partition,
                                                                 normed):
    """With ``normed``, Qwen3's and Gemma 3's q/k norms too (issue 46, item 5):
    every query and key head RMS-normed before RoPE, inside the fused kernel."""
    qkv, batch, cache, rope, geometry = _fused_case(3, num_heads, num_kv_heads, head_dim,
                                                    contexts)
    norm = None
    if normed:
        rng = np.random.default_rng(5)
        norm = QKNorm(rng.uniform(0.5, 1.5, head_dim).astype(np.float32),
                      rng.uniform(0.5, 1.5, head_dim).astype(np.float32), 1e-6)
    cpu_cache = cache.copy()
    cpu_attn = AttentionMetadata(batch.slot_mapping, batch.block_tables, batch.seq_lens,
                                 batch.query_start_loc)
    expected = CpuOps().rope_kv_attention(qkv.copy(), batch.positions, rope, cpu_cache, cpu_attn,
                                          head_dim ** -0.5, num_heads, num_kv_heads, head_dim,
                                          qk_norm=norm)

    ops = CudaOps(partition_size=partition)
    step = ops.prepare_step(batch, geometry)
    gpu_cache = ops.to_device(cache)
    attn = AttentionMetadata(step.slot_mapping, step.block_tables, step.seq_lens,
                             step.query_start_loc, plan=step)
    ops.reset_counters()
    gpu_norm = norm and QKNorm(ops.to_device(norm.q_weight), ops.to_device(norm.k_weight),
                               norm.eps)
    got = ops.rope_kv_attention(ops.to_device(qkv), step.positions, ops.to_device(rope),
                                gpu_cache, attn, head_dim ** -0.5, num_heads, num_kv_heads,
                                head_dim, qk_norm=gpu_norm)
    split = max(contexts) > partition
    assert ops.counters.launches == (2 if split else 1)  # fused; the split-K reduction
    np.testing.assert_allclose(ops.to_numpy(got), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ops.to_numpy(gpu_cache), cpu_cache, rtol=1e-6, atol=1e-6)


def test_the_sandwich_norm_add_and_next_norm_are_one_launch() -> None:
    """``fused_add_rms_norm`` with ``x_weight`` (Gemma 3's post-block norms,
    issue 46 item 5) equals the float64 reference: x normed by x_weight,
    added to the residual, the sum normed by weight; one launch."""
    rng = np.random.default_rng(9)
    x, residual = rng.standard_normal((3, 40)).astype(np.float32) * 4, \
        rng.standard_normal((3, 40)).astype(np.float32)
    x_weight, weight = rng.uniform(0.5, 2, 40).astype(np.float32), \
        rng.uniform(0.5, 2, 40).astype(np.float32)
    eps = 1e-6

    def norm(a, w):
        return a / np.sqrt((a * a).mean(-1, keepdims=True) + eps) * w

    want_residual = residual.astype(np.float64) + norm(x.astype(np.float64), x_weight)
    want_x = norm(want_residual, weight)
    ops = CudaOps()
    gx, gr = ops.to_device(x), ops.to_device(residual)
    ops.reset_counters()
    ops.fused_add_rms_norm(gx, gr, ops.to_device(weight), eps, x_weight=ops.to_device(x_weight))
    assert ops.counters.launches == 1
    np.testing.assert_allclose(ops.to_numpy(gr), want_residual, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ops.to_numpy(gx), want_x, rtol=1e-5, atol=1e-5)
    cpu_x, cpu_r = x.copy(), residual.copy()
    CpuOps().fused_add_rms_norm(cpu_x, cpu_r, weight, eps, x_weight=x_weight)
    np.testing.assert_allclose(cpu_r, want_residual, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cpu_x, want_x, rtol=1e-5, atol=1e-5)


def test_a_group_larger_than_the_fused_kernels_takes_the_three_ops() -> None:
    heads = kernels.MAX_GROUP * 2
    qkv, batch, cache, rope, geometry = _fused_case(4, heads, 1, 4, [5])
    ops = CudaOps()
    step = ops.prepare_step(batch, geometry)
    attn = AttentionMetadata(step.slot_mapping, step.block_tables, step.seq_lens,
                             step.query_start_loc, plan=step)
    ops.reset_counters()
    ops.rope_kv_attention(ops.to_device(qkv), step.positions, ops.to_device(rope),
                          ops.to_device(cache), attn, 0.5, heads, 1, 4)
    assert ops.counters.launches == 2 + 1 + 2  # RoPE of q and k, the KV write, split-K decode


@pytest.mark.slow
def test_decode_graph_buckets_pad_and_replay_the_eager_tokens(tmp_path):
    """The CUDA-graph path's buckets and padding (``kvserve.cuda.graphs``),
    with ``EagerReplay`` standing in for the capture the simulator cannot
    do: 3 requests decode through the bucket of 4 and give the tokens of
    eager steps; a replayed step is one copy each way."""
    from kvserve.cuda.graphs import DecodeGraphs, EagerReplay, decode_run

    config, weights = load_tiny(tmp_path, DEFAULT_HEADS)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (4, 7, 2)]
    outputs, counters = {}, {}
    for mode in ("eager", "graphs"):
        ops = CudaOps(partition_size=8)  # split-K: the graphs launch all 4 partitions of 32
        runner, scheduler = make_runner(config, weights, ops, num_blocks=16, block_size=4,
                                        budget=64)
        if mode == "graphs":
            cache = runner.kv_caches[0]
            geometry = StepGeometry(config.vocab_size, int(runner.model.rope_cache.shape[0]),
                                    int(cache.shape[0]), int(cache.shape[2]))
            runner.graphs = DecodeGraphs(ops, decode_run(runner.model, runner.kv_caches),
                                         geometry, max_num_seqs=4, max_model_len=32,
                                         capture=EagerReplay())
            assert sorted(runner.graphs.buckets) == [1, 2, 4]
        requests = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=3))
                    for i, p in enumerate(prompts)]
        for request in requests:
            scheduler.add_request(request)
        while scheduler.has_unfinished_requests():
            output = scheduler.schedule()
            if all(chunk.num_tokens == 1 for chunk in output.scheduled):
                ops.reset_counters()
                result = runner.execute(output)
                counters[mode] = (ops.counters.h2d, ops.counters.d2h)
            else:
                result = runner.execute(output)
            scheduler.update_from_output(output, result.sampled)
        outputs[mode] = [r.output_token_ids for r in requests]
    assert outputs["graphs"] == outputs["eager"]
    assert counters["graphs"] == counters["eager"] == (1, 1)
