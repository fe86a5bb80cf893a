"""A tiny random-weight Gemma 3 on the CUDA backend (Numba's simulator here)
gives the CPU backend's greedy tokens and logits (issue 30).

The model mixes full and sliding-window layers with a window shorter than
the prompts, blocks of 4 tokens and chunked prefill, so the run crosses
windows, frees sliding-group blocks (the null block takes their place in
the tables) and uses both KV-cache groups' tables in prefill and decode
steps. Float32 on both backends: the logits agree to float32 summation
order (``LOGIT_REL`` of their range), and the greedy tokens are equal.

The checkpoint is ``tests/model/tiny_gemma.py``'s, written and read back
through the production loader.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))

from test_forward_reference import greedy, serve  # noqa: E402
from tiny_gemma import TinyGemmaSpec, load_tiny_gemma  # noqa: E402

from kvserve.config import SchedulerConfig  # noqa: E402
from kvserve.core.kv_cache_manager import KVCacheManager  # noqa: E402
from kvserve.core.request import Request  # noqa: E402
from kvserve.cpu.ops import CpuOps  # noqa: E402
from kvserve.cuda.ops import CudaOps  # noqa: E402

#: CUDA against CPU raw logits, relative to the row's largest magnitude:
#: float32 sums in another order, through a few layers (the tiny llama's
#: reference tolerance in tests/model).
LOGIT_REL = 1e-4
WINDOW = 5
BLOCK = 4


def _tiny_gemma(folder: Path):
    return load_tiny_gemma(folder, TinyGemmaSpec(seed=0, sliding_window=WINDOW))


def _serve(ops, config, weights, prompts, max_tokens):
    """Prompts through the runner and scheduler with the model's KV-cache
    groups (chunked prefill, budget 6; two steps in flight)."""
    from kvserve.core.scheduler import Scheduler
    from kvserve.model.llama import LlamaModel
    from kvserve.model.runner import ModelRunner

    num_blocks = 48
    model = LlamaModel(config, weights, ops)
    runner = ModelRunner(config, model, ops, num_blocks, BLOCK, logprobs_mode="raw_logits")
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=True,
                        windows=runner.kv_layout.windows)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=6, max_num_seqs=4,
                                          max_model_len=config.max_position_embeddings), kv)
    requests = [Request(f"r{i}", p, greedy(max_tokens)) for i, p in enumerate(prompts)]
    return requests, serve(runner, scheduler, requests)


@pytest.mark.slow
def test_tiny_gemma_on_simulated_cuda_equals_cpu(tmp_path):
    config, weights = _tiny_gemma(tmp_path)
    assert config.sliding_window == WINDOW
    assert "sliding_attention" in config.layer_types and "full_attention" in config.layer_types
    rng = np.random.default_rng(30)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (11, 3)]
    on_cuda, cuda_entries = _serve(CudaOps(dtype=np.float32), config, weights, prompts, 4)
    on_cpu, cpu_entries = _serve(CpuOps(), config, weights, prompts, 4)
    for cuda_request, cpu_request in zip(on_cuda, on_cpu, strict=True):
        rid = cuda_request.request_id
        assert cuda_request.output_token_ids == cpu_request.output_token_ids, rid
        for (value, top), (ref_value, ref_top) in zip(cuda_entries[rid], cpu_entries[rid],
                                                      strict=True):
            ref = np.array([v for _, v in ref_top] + [ref_value], np.float64)
            got = np.array([v for _, v in top] + [value], np.float64)
            assert [t for t, _ in top] == [t for t, _ in ref_top], rid
            assert np.abs(got - ref).max() <= LOGIT_REL * np.abs(ref).max(), rid


#: Numba launches of a Gemma decode step outside the layers: the embedding,
#: the first layer's input norm, the last layer's post-feedforward norm and
#: the final norm.
GEMMA_LAUNCHES_OUTSIDE_LAYERS = 4


def test_a_gemma_decode_step_is_four_launches_a_layer(tmp_path):
    """Issue 46, item 5: Gemma 3's sandwich norms and q/k norms ride in the
    launches SmolLM2 has (add + norms, q/k norms + RoPE + KV write +
    attention, add + norms, GELU-and-mul), not 8 launches a layer."""
    from kvserve.core.scheduler import Scheduler
    from kvserve.model.llama import LlamaModel
    from kvserve.model.runner import ModelRunner

    config, weights = _tiny_gemma(tmp_path)
    ops = CudaOps(dtype=np.float32)
    runner = ModelRunner(config, LlamaModel(config, weights, ops), ops, 16, BLOCK,
                         logprobs_mode="raw_logits")
    kv = KVCacheManager(16, BLOCK, enable_prefix_caching=True, windows=runner.kv_layout.windows)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4,
                                          max_model_len=config.max_position_embeddings), kv)
    rng = np.random.default_rng(46)
    for i, n in enumerate((3, 6)):  # contexts within the window: one partition each
        scheduler.add_request(Request(f"r{i}", rng.integers(0, config.vocab_size, n).tolist(),
                                      greedy(4)))
    prefill = scheduler.schedule()
    scheduler.update_from_output(prefill, runner.execute(prefill).sampled)
    decode = scheduler.schedule()
    assert all(chunk.num_tokens == 1 for chunk in decode.scheduled)
    ops.reset_counters()
    runner.execute(decode)
    # 4 a layer, less the first layer's add (its input norm is counted outside)
    layers = config.num_hidden_layers
    assert ops.counters.launches == GEMMA_LAUNCHES_OUTSIDE_LAYERS + 4 * layers - 1, ops.counters
