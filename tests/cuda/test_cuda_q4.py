"""``--quantization q4`` on the CUDA backend: ``CudaOps.linear_q4`` and the
embedding of a block table, on ggml's Q4_0 / Q4_1 / Q8_0 blocks written by
the ``gguf`` package, under Numba's CUDA simulator (tiny shapes); and the
tiny model served from its GGUF on the simulated CUDA backend against the
CPU backend.

What is asserted:

* the blocks as ``kvserve.model.ggml_blocks`` reads them dequantize to
  ``gguf.quants.dequantize``'s values (the format's source);
* ``linear_q4`` against ``x @ W.T + b`` in float64 on those values:
  ``|y - ref| <= gamma_n * (|x| @ |W|.T + |b|)``, ``gamma_n = n u / (1 - n u)``,
  ``u = 2**-24``, ``n = K + 2`` (the kernels dequantize each weight exactly
  as the reference does, then K products and sums and the bias, in any
  order); for a float16 output plus half an ulp (2**-11 relative), and for
  the float16 panels of the many-row path 2**-11 of ``|x| @ |W|.T`` (each
  weight rounded to float16).  Rows: 1 and ``GEMV_MAX_ROWS`` (GEMV kernels,
  both warp-reduction paths), ``GEMV_MAX_ROWS + 1`` (panels and matmul,
  several panels); K = 32 (one block), 96 and 160 (not multiples of 128);
  N = 7 (a ragged last block of channels);
* the embedding of a block table: the rows of the dequantized table,
  exactly (rounded once to the backend dtype);
* bad arguments raise ValueError naming them;
* the tiny model on its GGUF blocks: greedy tokens and logits on the
  simulated CUDA backend equal the CPU backend's (float32).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))  # the tiny checkpoint

from test_forward_reference import (  # noqa: E402
    check_against_reference,
    greedy,
    rel_err,
    run_steps,
    serve,
)
from test_q4_model import write_gguf  # noqa: E402
from tiny_llama import SPECS, load_tiny  # noqa: E402

from kvserve.config import EngineConfig, SchedulerConfig  # noqa: E402
from kvserve.core.kv_cache_manager import KVCacheManager  # noqa: E402
from kvserve.core.request import Request  # noqa: E402
from kvserve.core.scheduler import Scheduler  # noqa: E402
from kvserve.cpu import block_ops  # noqa: E402
from kvserve.cpu.ops import CpuOps  # noqa: E402
from kvserve.cuda import gemv_kernels, kernels  # noqa: E402
from kvserve.cuda.backend import CudaBackend  # noqa: E402
from kvserve.cuda.ops import CudaOps  # noqa: E402
from kvserve.model.ggml_blocks import (  # noqa: E402
    BlockQuantizedWeight,
    dequantize,
    from_gguf_bytes,
)
from kvserve.model.llama import LlamaModel  # noqa: E402
from kvserve.model.loader import load_checkpoint_weights  # noqa: E402
from kvserve.model.quantization import quantize_weight  # noqa: E402
from kvserve.model.runner import ModelRunner  # noqa: E402

TYPES = ["Q4_0", "Q4_1", "Q8_0"]
N_OUT = 7
KS = [32, 96, 160]
ROWS = [1, kernels.GEMV_MAX_ROWS, kernels.GEMV_MAX_ROWS + 1]
U = 2.0**-24
HALF_ULP16 = 2.0**-11


def block_weight(ggml_type: str, k: int, n: int = N_OUT, seed: int = 0):
    """(host BlockQuantizedWeight, float64 values): a random [n, k] weight
    quantized by gguf-py; the values are gguf-py's own dequantization."""
    rng = np.random.default_rng(seed + k + 7 * TYPES.index(ggml_type))
    w = (rng.standard_normal((n, k)) * rng.uniform(0.2, 2.0, (n, 1))).astype(np.float32)
    qtype = GGMLQuantizationType[ggml_type]
    raw = gguf_quantize(w, qtype)
    blocks = from_gguf_bytes(np.asarray(raw).reshape(-1), ggml_type, (n, k))
    values = gguf_dequantize(raw, qtype).reshape(n, k).astype(np.float64)
    return blocks, values


def on_device(ops: CudaOps, blocks: BlockQuantizedWeight) -> BlockQuantizedWeight:
    """The weight as the model loads it (``quantize_weight``'s ``to_device``)."""
    return quantize_weight(blocks, "q4", ops.to_device)


def check_bound(out, x, values, bias, dtype, panel=False):
    x64 = np.asarray(x, np.float64)
    b = np.zeros(values.shape[0]) if bias is None else np.asarray(bias, np.float64)
    ref = x64 @ values.T + b
    n = values.shape[1] + 2
    magnitude = np.abs(x64) @ np.abs(values).T
    bound = n * U / (1 - n * U) * (magnitude + np.abs(b))
    if dtype == np.float16:
        if panel:
            bound += HALF_ULP16 * magnitude
        bound = bound * (1 + HALF_ULP16) + HALF_ULP16 * np.abs(ref)
    err = np.abs(np.asarray(out, np.float64) - ref)
    assert (err <= bound).all(), float((err / np.maximum(bound, 1e-300)).max())


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("k", KS)
def test_blocks_read_as_gguf_dequantizes_them(ggml_type, k):
    blocks, values = block_weight(ggml_type, k)
    assert blocks.shape == (N_OUT, k)
    np.testing.assert_array_equal(dequantize(blocks), values)


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.slow
def test_linear_q4_within_float32_rounding_of_reference(ggml_type, k, rows, dtype,
                                                         warp_reduction, monkeypatch):
    if rows > kernels.GEMV_MAX_ROWS:  # the panel path (no warp reduction: both params run it)
        monkeypatch.setattr(gemv_kernels, "DEQUANT_PANEL_ELEMS", 3 * k)  # panels of 3, 3, 1
    ops = CudaOps(dtype=dtype)
    blocks, values = block_weight(ggml_type, k)
    rng = np.random.default_rng(rows + k)
    x = rng.standard_normal((rows, k)).astype(dtype)
    bias = np.linspace(-1, 2, N_OUT).astype(dtype) if rows != 1 else None
    dev_bias = None if bias is None else ops.to_device(bias)
    out = ops.to_numpy(ops.linear_q4(ops.to_device(x), on_device(ops, blocks), dev_bias))
    assert out.dtype == dtype and out.shape == (rows, N_OUT)
    check_bound(out, x, values, bias, dtype, panel=rows > kernels.GEMV_MAX_ROWS)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_linear_dispatches_blocks_and_matches_the_cpu_backend(ggml_type):
    ops = CudaOps()
    blocks, values = block_weight(ggml_type, 96, n=12, seed=3)
    x = np.random.default_rng(4).standard_normal((3, 96)).astype(np.float32)
    bias = np.arange(12, dtype=np.float32)
    to = ops.to_device
    weight = on_device(ops, blocks)
    out = ops.to_numpy(ops.linear(to(x), weight, to(bias)))
    np.testing.assert_array_equal(out, ops.to_numpy(ops.linear_q4(to(x), weight, to(bias))))
    check_bound(out, x, values, bias, np.float32)
    check_bound(block_ops.linear_blocks(x, blocks, bias), x, values, bias, np.float32)


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_embedding_of_a_block_table_gathers_dequantized_rows(ggml_type, dtype):
    ops = CudaOps(dtype=dtype)
    blocks, values = block_weight(ggml_type, 160, seed=5)
    ids = np.array([0, 6, 3, 6, 1])
    out = ops.to_numpy(ops.embedding(ops.to_device(ids), on_device(ops, blocks)))
    assert out.dtype == dtype
    np.testing.assert_array_equal(out, values[ids].astype(np.float32).astype(dtype))
    with pytest.raises(ValueError, match="^embedding: token id out of range"):
        ops.embedding(ops.to_device(np.array([N_OUT])), on_device(ops, blocks))


def _bad(ops, x, w):
    """(id, call, the message's start) of each refused argument."""
    q4 = w.map(lambda a: a)
    return [
        ("x-k", lambda: ops.linear_q4(x[:, :64].copy(), q4), "x"),
        ("x-dtype", lambda: ops.linear_q4(x.astype(np.float64), q4), "x"),
        ("qs-dtype", lambda: ops.linear_q4(x, dataclasses.replace(q4, qs=q4.qs.view(np.int8))),
         "weight.qs"),
        ("qs-shape", lambda: ops.linear_q4(x, dataclasses.replace(q4, qs=q4.qs[:, :16].copy())),
         "weight.qs"),
        ("m-missing", lambda: ops.linear_q4(x, dataclasses.replace(q4, m=None)), "weight.m"),
        ("d-dtype", lambda: ops.linear_q4(x, dataclasses.replace(q4, d=q4.d.astype(np.float16))),
         "weight.d"),
        ("kind", lambda: ops.linear_q4(x, dataclasses.replace(q4, kind="q5")), "weight"),
        ("bias-shape", lambda: ops.linear_q4(x, q4, ops.xp.ones(3, np.float32)), "bias"),
    ]


def test_bad_arguments_raise_value_error_naming_them():
    ops = CudaOps()
    blocks, _ = block_weight("Q4_1", 96)
    x = ops.to_device(np.ones((2, 96), np.float32))
    for name, call, what in _bad(ops, x, on_device(ops, blocks)):
        with pytest.raises(ValueError, match=f"^linear_q4: {what} "):
            call()
        assert name


def test_the_cuda_backend_accepts_q4(tmp_path):
    backend = CudaBackend(EngineConfig(model=str(tmp_path), backend="cuda", quantization="q4"))
    assert backend.name == "cuda"


# --------------------------------------------------------------------------- #
# The tiny model on its GGUF blocks (Q4_1 / Q4_0 projections, Q8_0 tables)
# --------------------------------------------------------------------------- #


def _q4_model(tmp_path, spec, ops):
    """(config, the q4 model on ``ops``, the float32 weights the GGUF holds)."""
    config, weights = load_tiny(tmp_path, spec)
    values = write_gguf(tmp_path / "model.gguf", config, weights)
    model = LlamaModel(config, load_checkpoint_weights(tmp_path, config, "q4"), ops,
                       quantization="q4")
    return config, model, {**weights, **{k: v.astype(np.float32) for k, v in values.items()}}


def _serve_greedy(config, model, ops, prompts, max_tokens):
    """Requests served greedily through ModelRunner (chunked prefill, budget
    12, beside decodes), and their raw-logit entries."""
    runner = ModelRunner(config, model, ops, 16, 4, logprobs_mode="raw_logits")
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=4,
                                          max_model_len=config.max_position_embeddings),
                          KVCacheManager(16, 4, enable_prefix_caching=True))
    requests = [Request(f"r{i}", p, greedy(max_tokens)) for i, p in enumerate(prompts)]
    return requests, serve(runner, scheduler, requests)


@pytest.mark.slow
def test_tiny_q4_model_on_simulated_cuda_equals_cpu_greedy_and_reference(tmp_path):
    """One layer, a 128-token vocabulary (each GEMV launch costs ~0.5 s under
    the simulator); tied: the Q8_0 table is the embedding and the LM head.
    The CUDA run's logits also match the float64 reference on the GGUF's values."""
    spec = dataclasses.replace(SPECS[0], num_hidden_layers=1, vocab_size=128)
    tokens = {}
    for name, ops in (("cuda", CudaOps()), ("cpu", CpuOps(num_threads=1))):
        config, model, values = _q4_model(tmp_path / name, spec, ops)
        assert isinstance(model.layers[0].qkv, BlockQuantizedWeight)
        assert isinstance(model.embed_tokens, BlockQuantizedWeight)
        rng = np.random.default_rng(700 + spec.seed)
        prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (5, 10)]
        requests, entries = _serve_greedy(config, model, ops, prompts, max_tokens=3)
        tokens[name] = [r.output_token_ids for r in requests]
        for request in requests:
            check_against_reference(values, config, request, entries[request.request_id])
    assert tokens["cuda"] == tokens["cpu"]


@pytest.mark.slow
def test_tiny_q4_model_logits_on_simulated_cuda_equal_cpu(tmp_path):
    """A prefill chunk of GEMV_MAX_ROWS + 2 tokens (the panel path) and a
    decode step (the GEMV kernels), one layer of the spec with q/k/v biases
    and an untied Q8_0 LM head: logits within float32 summation order."""
    spec = dataclasses.replace(SPECS[1], num_hidden_layers=1)
    n = kernels.GEMV_MAX_ROWS + 3
    logits = {}
    for name, ops in (("cuda", CudaOps()), ("cpu", CpuOps(num_threads=1))):
        config, model, _ = _q4_model(tmp_path / name, spec, ops)
        assert isinstance(model.lm_head, BlockQuantizedWeight)
        tokens = np.random.default_rng(800).integers(0, config.vocab_size, n).tolist()
        logits[name] = run_steps(model, ops, [tokens], [[(0, 0, n - 1)], [(0, n - 1, n)]],
                                 block_size=4, num_blocks=8, rng=np.random.default_rng(2))[0]
    assert rel_err(logits["cuda"], logits["cpu"]) <= 1e-5
    np.testing.assert_array_equal(logits["cuda"].argmax(axis=1), logits["cpu"].argmax(axis=1))
