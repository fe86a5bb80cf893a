"""The forward pass over an int8 KV cache against the float64 reference that
quantizes K and V the way ``kvserve.model.kv_quant`` specifies.

``reference_forward(..., kv_cache_dtype="int8")`` rounds each layer's rotated
K and its V to the format's codes and scales and back before a float64
attention: what a correct int8 cache hands the attention. The engine's
logits must be close to that and measurably farther from the float-cache
reference, so a cache that silently stays float, a wrong scale or a wrong
rounding fails.

Tolerance: ``INT8_TOL = 1e-4`` of the largest logit. The engine quantizes
float32 K/V where the reference quantizes float64 K/V rounded to float32, so
a code may round the other way where ``x * 127 / max|x|`` lies within float32
rounding of a half (one code off moves one value by ``max|x| / 127``); the
errors seen on the tiny checkpoints were 3e-7 to 1.3e-6, and the float-cache
logits differ from the int8 reference by 6.5e-3 to 3.3e-2, so the two are
told apart by a wide margin (asserted: ``FLOAT_GAP`` x the tolerance).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_forward_reference import (BACKENDS, greedy, make_runner, rel_err, run_steps,
                                    serve)
from tiny_llama import SPECS, load_tiny

from kvserve.core.request import Request
from kvserve.model.llama import LlamaModel
from kvserve.testing.reference import reference_forward

INT8_TOL = 1e-4
#: The float-cache reference must be at least this many INT8_TOL away.
FLOAT_GAP = 10.0


@pytest.fixture(scope="module", params=SPECS, ids=[s.name for s in SPECS])
def tiny(request, tmp_path_factory):
    spec = request.param
    config, weights = load_tiny(tmp_path_factory.mktemp(spec.name), spec)
    return spec, config, weights


@pytest.fixture(params=sorted(BACKENDS))
def ops(request):
    return BACKENDS[request.param]()


def test_forward_over_int8_cache_matches_the_int8_reference(tiny, ops):
    """Chunked prefill mixed with decodes over shuffled blocks of an int8 cache."""
    spec, config, weights = tiny
    model = LlamaModel(config, weights, ops)
    rng = np.random.default_rng(spec.seed)
    seqs = [rng.integers(0, config.vocab_size, n).tolist() for n in (45, 6, 9)]
    steps = [[(0, 0, 20), (1, 0, 6), (2, 0, 1)],
             [(0, 20, 44), (2, 1, 2)],
             [(0, 44, 45), (2, 2, 9)]]
    logits = run_steps(model, ops, seqs, steps, block_size=4, num_blocks=3 * 16, rng=rng,
                       kv_cache_dtype="int8")
    for s, toks in enumerate(seqs):
        want = reference_forward(weights, config, toks, kv_cache_dtype="int8")
        assert rel_err(logits[s], want) < INT8_TOL, s
    longest = reference_forward(weights, config, seqs[0])
    assert rel_err(logits[0], longest) > FLOAT_GAP * INT8_TOL


def test_runner_over_int8_cache_with_prefix_hits_and_preemption(tiny, ops):
    """The scheduler's chunked prefill, a prefix-cache hit and preemption by
    recompute, all over an int8 cache: every sampled token's raw logits
    equal the int8 reference's at its position."""
    spec, config, weights = tiny
    runner, scheduler = make_runner(config, weights, ops, num_blocks=10, block_size=4,
                                    budget=7, kv_cache_dtype="int8")
    rng = np.random.default_rng(400 + spec.seed)
    prefix = rng.integers(0, config.vocab_size, 12).tolist()
    requests = [Request(f"q{i}", prefix + rng.integers(0, config.vocab_size, 2 + i).tolist(),
                        greedy(10)) for i in range(3)]
    entries = serve(runner, scheduler, requests)
    assert sum(r.num_cached_tokens for r in requests) > 0
    assert sum(r.num_preemptions for r in requests) > 0
    for request in requests:
        prompt, output = list(request.prompt_token_ids), request.output_token_ids
        ref = reference_forward(weights, config, prompt + output[:-1],
                                kv_cache_dtype="int8")[len(prompt) - 1:]
        for i, (token, (value, _)) in enumerate(zip(output, entries[request.request_id])):
            row = ref[i].astype(np.float64)
            assert abs(value - row[token]) <= INT8_TOL * np.abs(row).max(), (request, i)
