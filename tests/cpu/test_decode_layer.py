"""The fused CPU decode step (``kvserve.cpu.decode_layer`` / ``decode_path``)
against the op-by-op path it replaces.

Tiny random-weight Llamas (``tests/model/tiny_llama.py``: GQA 2 with a tied
head, GQA 1 with q/k/v bias and an untied head), with float32 weights and
with GGUF blocks (Q4_1, Q4_0 and Q8_0 projections, as ``--quantization q4``
serves them), and with K-quant panels (hidden 256: Q4_K q/k/gate/up/down and
a Q6_K v, so that q/k/v is a stack of two kinds, and a Q5_K o: random
super-blocks, ``test_kquant.random_blocks``). Three sequences are prefilled to contexts of 5, 13 and 22
tokens in blocks of 4 (shuffled physical blocks), then two decode steps run
on copies of the state, fused (``KVSERVE_CPU_FUSED_DECODE`` unset, and
``=layer``) and op by op (``=0``): batches of one and of three sequences.
The logits and every KV cache must agree, the second step reading the K/V
the first one wrote; as for a verification step (sequences of 1, 4 and 2
new tokens, a row per token in the fused kernel) and the decode after it; with int8 KV caches (``--kv-cache-dtype int8``) too,
the caches byte for byte.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import quantize as gguf_quantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from tiny_llama import SPECS, load_tiny  # noqa: E402

from kvserve.cpu import decode_layer, decode_path  # noqa: E402
from kvserve.cpu.ops import CpuOps  # noqa: E402
from kvserve.model.ggml_blocks import from_gguf_bytes  # noqa: E402
from kvserve.model.llama import AttentionMetadata, LlamaModel  # noqa: E402

#: As the forward tests' REL_TOL: max |fused - op path| <= TOL * max |op path|.
TOL = 2e-5
BLOCK = 4
CONTEXTS = (5, 13, 22)
#: GGUF type per projection for the block form (both 4-bit kinds and Q8_0).
TYPES = {"q_proj": "Q4_1", "k_proj": "Q4_1", "v_proj": "Q4_1", "o_proj": "Q8_0",
         "gate_proj": "Q4_0", "up_proj": "Q4_0", "down_proj": "Q4_1"}


def _blocks(weights: dict) -> dict:
    """The projections of ``weights`` as ``BlockQuantizedWeight`` s (gguf-py's quantizer)."""
    out = dict(weights)
    for name, w in weights.items():
        kind = TYPES.get(name.split(".")[-2]) if name.endswith(".weight") else None
        if kind is not None:
            raw = gguf_quantize(w, gguf.GGMLQuantizationType[kind])
            out[name] = from_gguf_bytes(np.asarray(raw).reshape(-1), kind, w.shape)
    return out


#: GGUF type per projection for the K-quant form.
KQ_TYPES = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q5_K",
            "gate_proj": "Q4_K", "up_proj": "Q4_K", "down_proj": "Q4_K"}


def _kquants(weights: dict) -> dict:
    """The projections of ``weights`` as ``KQuantWeight`` s of random
    super-blocks; a layer's gate and up (and q and k) packed together, so
    that their panels lie end to end as in a served file's."""
    from test_kquant import random_blocks

    from kvserve.model.ggml_blocks import KQuantWeight
    from kvserve.model.gguf_weights import pack_tensor

    out = dict(weights)
    layers = {name.split(".")[2] for name in weights if name.startswith("model.layers.")}
    seed = 0
    for layer in sorted(layers):
        p = f"model.layers.{layer}."
        for group in (("self_attn.q_proj", "self_attn.k_proj"), ("self_attn.v_proj",),
                      ("self_attn.o_proj",), ("mlp.gate_proj", "mlp.up_proj"),
                      ("mlp.down_proj",)):
            names = [f"{p}{part}.weight" for part in group]
            kind = KQ_TYPES[group[0].split(".")[-1]]
            k = weights[names[0]].shape[1]
            raws = [random_blocks(kind, weights[n].shape[0], k, seed=seed + i)
                    for i, n in enumerate(names)]
            seed += len(names)
            packed = pack_tensor(np.concatenate(raws), kind, None)
            row = 0
            for name, raw in zip(names, raws):
                rows = slice(row, row + raw.shape[0] // 16)
                row = rows.stop
                out[name] = KQuantWeight(kind, raw.shape[0], k, packed["codes"][rows],
                                         packed["scales"][rows], packed["mins"][rows],
                                         packed["dd"][rows], raw)
    return out


FORMS = [(s, f) for s in SPECS for f in ("f32", "q4")] + [(SPECS[0], "kq")]


@pytest.fixture(scope="module", params=FORMS, ids=[f"{s.name}-{f}" for s, f in FORMS])
def model(request, tmp_path_factory):
    spec, form = request.param
    if form == "kq":  # every K a multiple of 256
        spec = dataclasses.replace(spec, hidden_size=256, intermediate_size=512)
    config, weights = load_tiny(tmp_path_factory.mktemp(spec.name), spec)
    if form == "q4":
        return LlamaModel(config, _blocks(weights), CpuOps(num_threads=2), "q4")
    if form == "kq":
        return LlamaModel(config, _kquants(weights), CpuOps(num_threads=2), "w4a8")
    return LlamaModel(config, weights, CpuOps(num_threads=2))


def _step(model, caches, tables, chunks):
    """``model.forward`` of (seq, tokens, first position) chunks; every row's logits."""
    toks, pos, qsl = [], [], [0]
    for _, t, p0 in chunks:
        toks += t
        pos.append(np.arange(p0, p0 + len(t)))
        qsl.append(qsl[-1] + len(t))
    positions = np.concatenate(pos)
    seq_of = np.repeat([s for s, _, _ in chunks], [len(t) for _, t, _ in chunks])
    slots = tables[seq_of, positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK
    attn = AttentionMetadata(
        slot_mapping=slots, block_tables=tables[[s for s, _, _ in chunks]],
        seq_lens=np.array([p0 + len(t) for _, t, p0 in chunks], np.int32),
        query_start_loc=np.array(qsl, np.int32))
    return model.forward(np.array(toks, np.int64), positions, attn, caches,
                         np.arange(len(toks), dtype=np.int64))


@pytest.fixture(scope="module")
def prefilled(model):
    """Caches and block tables after prefilling three sequences (op path)."""
    return _prefill(model)


def _prefill(model, kv_cache_dtype="auto"):
    cfg = model.config
    rng = np.random.default_rng(7)
    blocks_per_seq = 8
    tables = rng.permutation(3 * blocks_per_seq + 2)[:3 * blocks_per_seq] \
        .astype(np.int32).reshape(3, blocks_per_seq)
    caches = [model.ops.allocate_kv_cache(3 * blocks_per_seq + 2, BLOCK,
                                          cfg.num_key_value_heads, cfg.head_dim,
                                          kv_cache_dtype=kv_cache_dtype)
              for _ in range(cfg.num_hidden_layers)]
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in CONTEXTS]
    _step(model, caches, tables, [(s, p, 0) for s, p in enumerate(prompts)])
    return caches, tables


def _use_mode(model, mode, monkeypatch):
    """``KVSERVE_CPU_FUSED_DECODE=mode`` (None: unset) as a new ``CpuOps``
    reads it, given to the model's backend, whose decode path is chosen again
    (``LlamaModel.choose_decode_path``); put back after the test."""
    if mode is None:
        monkeypatch.delenv(decode_path.ENV, raising=False)
    else:
        monkeypatch.setenv(decode_path.ENV, mode)
    monkeypatch.setattr(model, "decode_path", model.decode_path)  # put back after the test
    monkeypatch.setattr(model.ops, "fused_decode", decode_path.mode_from_env())
    model.choose_decode_path()


def _decode_twice(model, prefilled, seqs, monkeypatch, mode):
    """Two decode steps of ``seqs`` on a copy of ``prefilled`` with
    ``KVSERVE_CPU_FUSED_DECODE=mode`` (None: unset); (logits, caches, fused calls)."""
    _use_mode(model, mode, monkeypatch)
    calls = []
    kernel = decode_layer.decode_layers

    def counted(*args):
        calls.append(args[:2])
        return kernel(*args)

    monkeypatch.setattr(decode_layer, "decode_layers", counted)
    caches = [c.copy() for c in prefilled[0]]
    tables = prefilled[1]
    vocab = model.config.vocab_size
    logits = []
    for step in range(2):
        chunks = [(s, [(11 * s + 5 * step + 3) % vocab], CONTEXTS[s] + step) for s in seqs]
        logits.append(np.array(_step(model, caches, tables, chunks)))
    return logits, caches, calls


@pytest.mark.parametrize("seqs", [(1,), (0, 1, 2)], ids=["batch1", "batch3"])
def test_fused_decode_matches_op_path(model, prefilled, seqs, monkeypatch):
    ref_logits, ref_caches, ref_calls = _decode_twice(model, prefilled, seqs, monkeypatch, "0")
    assert not ref_calls
    layers = model.config.num_hidden_layers
    for mode, calls_per_step in ((None, [(0, layers)]),
                                 ("layer", [(i, i + 1) for i in range(layers)])):
        logits, caches, calls = _decode_twice(model, prefilled, seqs, monkeypatch, mode)
        assert calls == 2 * calls_per_step, mode
        for got, ref in zip(logits, ref_logits):
            assert np.abs(got - ref).max() <= TOL * np.abs(ref).max(), mode
            assert (got.argmax(1) == ref.argmax(1)).all(), mode
        for got, ref in zip(caches, ref_caches):  # bit for bit: see decode_layers(window)
            np.testing.assert_array_equal(got, ref)


@pytest.fixture(scope="module")
def prefilled_int8(model):
    """As ``prefilled``, in int8 KV caches."""
    return _prefill(model, "int8")


@pytest.mark.parametrize("seqs", [(1,), (0, 1, 2)], ids=["batch1", "batch3"])
def test_fused_decode_on_int8_caches_matches_op_path(model, prefilled, prefilled_int8, seqs,
                                                     monkeypatch):
    """The fused step quantizes the new K/V as ``write_kv`` does (the same
    codes and scales, byte for byte) and attends over the int8 cache as
    ``paged_attention`` does; and stays near the float cache's logits."""
    ref_logits, ref_caches, ref_calls = _decode_twice(model, prefilled_int8, seqs, monkeypatch,
                                                      "0")
    assert not ref_calls
    logits, caches, calls = _decode_twice(model, prefilled_int8, seqs, monkeypatch, None)
    assert len(calls) == 2
    for got, ref in zip(logits, ref_logits):
        assert np.abs(got - ref).max() <= TOL * np.abs(ref).max()
    for got, ref in zip(caches, ref_caches):
        assert got.dtype == np.int8
        np.testing.assert_array_equal(got, ref)
    # 8-bit K/V (half a step: 0.4% of a vector's largest value) move the
    # logits of these 2-layer random models by 0.4-2.8% of their largest
    # (measured, fixed seeds): 5% is loose; codes read without their scales
    # would not be close at all.
    # The K-quant form's random super-blocks (codes uniform over their whole
    # range) make a far more sensitive model: 9.5% measured, 15% allowed.
    from kvserve.model.ggml_blocks import KQuantWeight
    bound = 0.15 if isinstance(model.layers[0].o_proj, KQuantWeight) else 5e-2
    float_logits, _, _ = _decode_twice(model, prefilled, seqs, monkeypatch, None)
    for got, flt in zip(logits, float_logits):
        assert 0 < np.abs(got - flt).max() <= bound * np.abs(flt).max()


_PARAMS = list(inspect.signature(decode_layer.decode_layers.py_func).parameters)


def _arg(args: tuple, name: str):
    """Argument ``name`` of a ``decode_layer.decode_layers`` call's ``args``."""
    return args[_PARAMS.index(name)]


def _counted_steps(model, prefilled, steps, monkeypatch, mode):
    """``steps`` (lists of chunks, as ``_step`` 's) on a copy of ``prefilled``
    with ``KVSERVE_CPU_FUSED_DECODE=mode`` (None: unset): (logits, caches,
    fused calls)."""
    _use_mode(model, mode, monkeypatch)
    calls = []
    kernel = decode_layer.decode_layers
    monkeypatch.setattr(decode_layer, "decode_layers",
                        lambda *a: calls.append(_arg(a, "rows_share")) or kernel(*a))
    caches = [c.copy() for c in prefilled[0]]
    logits = [np.array(_step(model, caches, prefilled[1], chunks)) for chunks in steps]
    return logits, caches, calls


@pytest.mark.parametrize("cache", ["prefilled", "prefilled_int8"])
def test_verification_step_matches_op_path(model, cache, request, monkeypatch):
    """A step whose sequences have several new tokens (a speculative
    verification: 1, 4 and 2 tokens) runs fused, a row per token with its
    causal context (``rows_share``), each sequence's rows attending as one
    tile, and equals the op path's prefill attention: every row's logits,
    the K/V written (int8 caches byte for byte), and the next decode step
    that reads them."""
    prefilled = request.getfixturevalue(cache)
    steps = [[(0, [1], CONTEXTS[0]), (1, [2, 3, 4, 5], CONTEXTS[1]), (2, [6, 7], CONTEXTS[2])],
             [(0, [8], CONTEXTS[0] + 1), (1, [9], CONTEXTS[1] + 4), (2, [10], CONTEXTS[2] + 2)]]
    ref_logits, ref_caches, ref_calls = _counted_steps(model, prefilled, steps, monkeypatch,
                                                       "0")
    assert not ref_calls
    logits, caches, calls = _counted_steps(model, prefilled, steps, monkeypatch, None)
    assert calls == [True, False]  # rows_share in the verification step only
    for got, ref in zip(logits, ref_logits):
        assert got.shape == ref.shape
        assert np.abs(got - ref).max() <= TOL * np.abs(ref).max()
        assert (got.argmax(1) == ref.argmax(1)).all()
    for got, ref in zip(caches, ref_caches):
        if got.dtype == np.int8:
            np.testing.assert_array_equal(got, ref)
        else:
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


def test_long_chunk_takes_op_path(model, prefilled, monkeypatch):
    """A chunk of more than ``MAX_QUERY_TOKENS`` tokens next to a decode:
    no fused call (the op path's tiled prefill attention)."""
    n = decode_path.MAX_QUERY_TOKENS + 1
    steps = [[(0, [1], CONTEXTS[0]), (1, list(range(2, 2 + n)), CONTEXTS[1])]]
    _, _, calls = _counted_steps(model, prefilled, steps, monkeypatch, None)
    assert not calls


def test_warmup_compiles_the_steps_signature(model, prefilled, monkeypatch):
    """``CpuOps.warmup`` (``decode_path.warmup``) compiles the very signature
    a real step uses: it adds none after one."""
    kernel = decode_layer.decode_layers
    _decode_twice(model, prefilled, (0,), monkeypatch, None)
    monkeypatch.undo()
    compiled = set(kernel.signatures)
    decode_path.warmup()
    assert set(kernel.signatures) == compiled


def test_int8_warmup_compiles_the_steps_signature(model, prefilled_int8, monkeypatch):
    """``decode_path.warmup("int8")`` compiles the signature of a step on
    int8 caches (``CpuBackend.warmup`` passes ``--kv-cache-dtype``)."""
    kernel = decode_layer.decode_layers
    _decode_twice(model, prefilled_int8, (0,), monkeypatch, None)
    monkeypatch.undo()
    compiled = set(kernel.signatures)
    decode_path.warmup("int8")
    assert set(kernel.signatures) == compiled


@pytest.fixture(scope="module", params=SPECS, ids=[s.name for s in SPECS])
def w4a8_models(request, tmp_path_factory):
    """The block form served as ``--quantization w4a8`` (Q8 activations) and
    as ``q4`` (float activations)."""
    config, weights = load_tiny(tmp_path_factory.mktemp(request.param.name), request.param)
    blocks = _blocks(weights)
    return (LlamaModel(config, blocks, CpuOps(num_threads=2), "w4a8"),
            LlamaModel(config, blocks, CpuOps(num_threads=2), "q4"))


@pytest.mark.parametrize("seqs", [(1,), (0, 1, 2)], ids=["batch1", "batch3"])
def test_w4a8_fused_decode_matches_q8_op_path(w4a8_models, seqs, monkeypatch):
    """w4a8's fused step takes every block product with Q8 activations: it
    matches w4a8's op path, whose products of at most ``Q8_MAX_ROWS`` rows
    are ``block_dot_ops.linear_blocks_q8`` (checked against a NumPy
    reference in test_block_dot.py), and differs from q4's (float
    activations) by about the activation codes' error."""
    w4a8, q4 = w4a8_models
    float_logits, _, _ = _decode_twice(q4, _prefill(q4), seqs, monkeypatch, None)
    monkeypatch.undo()
    prefilled = _prefill(w4a8)
    ref_logits, ref_caches, ref_calls = _decode_twice(w4a8, prefilled, seqs, monkeypatch, "0")
    monkeypatch.undo()
    logits, caches, calls = _decode_twice(w4a8, prefilled, seqs, monkeypatch, None)
    assert not ref_calls and len(calls) == 2
    for got, ref, flt in zip(logits, ref_logits, float_logits):
        scale = np.abs(ref).max()
        assert np.abs(got - ref).max() <= TOL * scale
        # Q8 activations move the logits by far more than the kernels' rounding:
        # the test would not notice a step that kept float activations.
        assert np.abs(got - flt).max() > 100 * TOL * scale
    for got, ref in zip(caches, ref_caches):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


def test_w4a8_fused_decode_with_panels_matches_op_path(tmp_path, monkeypatch):
    """Where a w4a8 step takes the panels of ``panel_kernels`` (from
    ``PANEL_MIN_ROWS`` rows, lowered to 1 here so that three tiny sequences
    take them, and forced on so that a CPU without AVX2 runs the generic dot
    product through the same route), the fused step is called with
    ``panels`` and matches the op path, which takes the panels too."""
    from kvserve.cpu import block_dot_ops, panel_kernels
    monkeypatch.setattr(panel_kernels, "HAS_PANELS", True)
    monkeypatch.setattr(block_dot_ops, "PANEL_MIN_ROWS", 1)
    config, weights = load_tiny(tmp_path, SPECS[0])
    w4a8 = LlamaModel(config, _blocks(weights), CpuOps(num_threads=2), "w4a8")
    prefilled = _prefill(w4a8)
    seen = []
    kernel = decode_layer.decode_layers
    monkeypatch.setattr(decode_layer, "decode_layers",
                        lambda *args: (seen.append(_arg(args, "panels")), kernel(*args))[1])
    ref_logits, ref_caches, _ = _decode_twice(w4a8, prefilled, (0, 1, 2), monkeypatch, "0")
    logits, caches, calls = _decode_twice(w4a8, prefilled, (0, 1, 2), monkeypatch, None)
    assert len(calls) == 2 and seen == [True, True]
    for got, ref in zip(logits, ref_logits):
        assert np.abs(got - ref).max() <= TOL * np.abs(ref).max()
    for got, ref in zip(caches, ref_caches):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
