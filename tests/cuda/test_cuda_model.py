"""The CUDA backend end to end, under Numba's CUDA simulator: the tiny
random-weight Llama through ``ModelRunner`` (greedy tokens equal the CPU
backend's, logits the float64 reference's), its w8a8-quantized forward
against the CPU backend's, the engine serving a request with
``backend="cuda"``, and ``--backend cuda`` on a machine without a GPU
refused in one line.

Tokens are compared for equality with the CPU backend's, which computes in
float32: the CUDA side is pinned to float32 too (``CudaOps(dtype=float32)``,
``EngineConfig(dtype="float32")``). Under the simulator that is its default
anyway; on a GPU the default is float16, whose rounding may flip a greedy
choice between two near-tied logits, so the tests hold on a GPU machine
(``NUMBA_ENABLE_CUDASIM=0``) as well."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))  # the tiny checkpoint

from test_forward_reference import (  # noqa: E402
    check_against_reference,
    greedy,
    make_runner,
    rel_err,
    run_steps,
    serve,
)
from tiny_llama import SPECS, load_tiny, write_byte_tokenizer  # noqa: E402

from kvserve.actors.messages import GenerateRequest, RequestOutput  # noqa: E402
from kvserve.config import (CacheConfig, EngineConfig, SchedulerConfig,  # noqa: E402
                            SpeculativeConfig)
from kvserve.core.request import Request  # noqa: E402
from kvserve.core.sampling_params import SamplingParams  # noqa: E402
from kvserve.cpu.ops import CpuOps  # noqa: E402
from kvserve.cuda import kernels  # noqa: E402
from kvserve.cuda.ops import CudaOps  # noqa: E402
from kvserve.engine import AsyncEngine  # noqa: E402
from kvserve.model.backend import cuda_device_present  # noqa: E402
from kvserve.model.llama import LlamaModel  # noqa: E402


def _serve_tiny(ops, config, weights, prompts, max_tokens):
    """Chunked prefill (budget 8) beside decodes, blocks of 4, two steps in
    flight; returns the requests and their logprob entries."""
    runner, scheduler = make_runner(config, weights, ops, num_blocks=16, block_size=4, budget=8)
    requests = [Request(f"r{i}", p, greedy(max_tokens)) for i, p in enumerate(prompts)]
    return requests, serve(runner, scheduler, requests)


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_tiny_llama_on_simulated_cuda_equals_cpu_greedy_and_reference(spec, tmp_path):
    """Float32 on both sides (the module docstring says why), so greedy
    tokens are equal on the simulator and on a GPU."""
    config, weights = load_tiny(tmp_path, spec)
    rng = np.random.default_rng(500 + spec.seed)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (5, 11)]
    on_cuda, entries = _serve_tiny(CudaOps(dtype=np.float32), config, weights, prompts,
                                   max_tokens=3)
    on_cpu, _ = _serve_tiny(CpuOps(), config, weights, prompts, max_tokens=3)
    for cuda_request, cpu_request in zip(on_cuda, on_cpu):
        assert cuda_request.output_token_ids == cpu_request.output_token_ids
        check_against_reference(weights, config, cuda_request, entries[cuda_request.request_id])


#: CUDA against CPU logits of the w8a8 model (relative to their range): the
#: backends quantize the same activations to the same codes except where
#: float32 rounding upstream moves a value across a rounding tie (one code
#: step, 1/127 of a group's absmax).  The quantization itself moves these
#: logits by 1.8-7.7% (tests/model/test_quantization.py), a group scaled by
#: another group's scale by more than this bound.
W8A8_BACKEND_REL = 1e-3


def _w8a8_logits(ops, config, weights, tokens):
    """Logits of every position: a prefill chunk of all but the last token,
    then a decode step.  No step has more than GEMV_MAX_ROWS rows: the tiled
    kernel took about a minute for an 11-row chunk under the simulator (a
    barrier per K step of every 4x4 tile); test_cuda_w8a8.py covers it."""
    model = LlamaModel(config, weights, ops, quantization="w8a8")
    n = len(tokens)
    steps = [[(0, 0, n - 1)], [(0, n - 1, n)]]
    return run_steps(model, ops, [tokens], steps, block_size=4, num_blocks=8,
                     rng=np.random.default_rng(2))[0]


@pytest.mark.slow
def test_tiny_llama_w8a8_on_simulated_cuda_equals_cpu(tmp_path):
    # One layer of the spec with q/k/v biases: each GEMV launch costs ~0.4 s
    # under the simulator, and one layer has all four quantized products.
    spec = dataclasses.replace(SPECS[1], num_hidden_layers=1)
    config, weights = load_tiny(tmp_path, spec)
    n = kernels.GEMV_MAX_ROWS + 1
    tokens = np.random.default_rng(600 + spec.seed).integers(0, config.vocab_size, n).tolist()
    on_cuda = _w8a8_logits(CudaOps(dtype=np.float32), config, weights, tokens)
    on_cpu = _w8a8_logits(CpuOps(), config, weights, tokens)
    assert rel_err(on_cuda, on_cpu) <= W8A8_BACKEND_REL
    np.testing.assert_array_equal(on_cuda.argmax(axis=1), on_cpu.argmax(axis=1))


async def _generate(engine: AsyncEngine, prompt_ids: list[int], max_tokens: int) -> list[int]:
    stream = engine.generate(GenerateRequest(
        request_id=f"sim-{time.monotonic_ns()}", arrival_time=time.monotonic(),
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        prompt_token_ids=tuple(prompt_ids)))
    tokens: list[int] = []
    async for event in stream:
        if isinstance(event, RequestOutput):
            tokens += event.token_ids
            if event.finish_reason is not None:
                assert event.finish_reason == "length", event
    return tokens


def _engine_tokens(folder: Path, backend: str, prompt_ids: list[int], max_tokens: int = 4,
                   speculative: SpeculativeConfig | None = None) -> list[int]:
    """Greedy tokens of the engine on ``backend``, in float32 on either (a GPU's
    default float16 may flip a near-tied greedy choice against the CPU's float32)."""
    config = EngineConfig(model=str(folder), backend=backend, dtype="float32",
                          cache=CacheConfig(block_size=4, kv_cache_memory=64 * 4 * 2 * 2 * 32 * 4),
                          scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4,
                                                    speculative=speculative))

    async def run():
        engine = await AsyncEngine.start(config, stats_interval=0)
        try:
            assert engine.core.backend.name == backend
            return await asyncio.wait_for(_generate(engine, prompt_ids, max_tokens), timeout=120)
        finally:
            await engine.shutdown()

    return asyncio.run(run())


def test_engine_serves_a_request_on_the_simulated_cuda_backend(tmp_path):
    load_tiny(tmp_path, SPECS[0])
    write_byte_tokenizer(tmp_path)
    prompt = list(range(2, 22))  # 20 byte tokens: five blocks, two prefill chunks
    on_cuda = _engine_tokens(tmp_path, "cuda", prompt)
    assert len(on_cuda) == 4
    assert on_cuda == _engine_tokens(tmp_path, "cpu", prompt)


def test_a_draft_model_on_the_simulated_cuda_backend_keeps_greedy_output(tmp_path):
    """The drafter's passes, its KV cache and the verification run on CudaOps."""
    load_tiny(tmp_path, SPECS[0])
    write_byte_tokenizer(tmp_path)
    prompt = list(range(2, 14))
    spec = SpeculativeConfig(method="draft_model", model=str(tmp_path), num_speculative_tokens=2)
    on_cuda = _engine_tokens(tmp_path, "cuda", prompt, max_tokens=6, speculative=spec)
    assert on_cuda == _engine_tokens(tmp_path, "cpu", prompt, max_tokens=6)


def test_backend_cuda_without_a_gpu_is_one_clear_line(tmp_path):
    """The CLI with the simulator off: the start-up probe fails (here at
    ``import``, without CuPy), is logged (``cuda_probe``, a JSON line) and
    ``kvserve serve`` exits 2 with one error line.
    Skipped where CuPy sees a GPU: there ``--backend cuda`` would serve."""
    if cuda_device_present():
        pytest.skip("a GPU is present: --backend cuda starts there")
    load_tiny(tmp_path, SPECS[0])
    write_byte_tokenizer(tmp_path)
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    done = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", "--backend", "cuda",
                           "--model", str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done
    logged = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert [e["event"] for e in logged] == ["version", "non_default_args", "cuda_probe"], logged
    assert "seconds" in logged[2], logged
    lines = [line for line in done.stderr.strip().splitlines() if not line.startswith("{")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("kvserve: error: --backend cuda needs a working CUDA stack; "
                               "the start-up probe failed at ")
    assert lines[0].endswith("; or use --backend cpu")
