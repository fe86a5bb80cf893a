"""Acceptance of the quantization schemes on the default model: perplexity
of the shipped public-domain text (``tests/data/public_domain_en.txt``)
within 3% of float for int8 and q4 and 6% for w8a8, and teacher-forced greedy
agreement with the golden reference outputs above the bounds measured when
the schemes landed (``kvserve.testing.quality`` defines both measures)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from golden import golden_cases

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.testing.quality import agreement, perplexity, start_engine

# slow: the module's shared engine or servers take most of its time (make test-slow).
pytestmark = [pytest.mark.model, pytest.mark.slow]

TEXT = Path(__file__).resolve().parents[1] / "data" / "public_domain_en.txt"
PPL_BOUND = {"int8": 0.03, "w8a8": 0.06, "q4": 0.03, "w4a8": 0.03}
#: Teacher-forced top-1 agreement with the golden greedy tokens (151
#: positions over the golden cases), measured 2026-12-01: none 1.000, int8
#: 0.974, w8a8 0.974 (perplexity: 22.476, 22.683 = +0.92%, 22.935 = +2.04%);
#: after w8a8 moved to the int8 tile kernel from 2 rows on: w8a8 0.967
#: (perplexity 22.892 = +1.85%).
#: The bounds leave about three tokens of slack. q4 serves the GGUF's blocks
#: that the float checkpoint was dequantized from, so it should agree with
#: float up to summation order: measured 1.000, perplexity 22.476 (+0.00%).
#: w4a8 (Q8 activations in every product on a CPU with AVX2, as
#: llama.cpp's; prompt passes float elsewhere), measured 2026-12-03 on a
#: VNNI CPU: agreement 0.987, perplexity 22.604 (+0.57%).
#: w8a8 on an Intel Xeon with AVX-512 (2026-12-06; the same at the commit
#: before that day's changes, which do not touch w8a8): agreement 0.947
#: (143 of 151), perplexity 22.934 (+2.04%): its bound is 0.94.
AGREEMENT_BOUND = {"none": 0.99, "int8": 0.95, "w8a8": 0.94, "q4": 0.99, "w4a8": 0.95}
SCHEMES = ("none", "int8", "w8a8", "q4", "w4a8")


def _measure(model_path: str, scheme: str) -> tuple[float, float]:
    config = EngineConfig(model=model_path, quantization=scheme,
                          cache=CacheConfig(kv_cache_memory=256 * 2**20),
                          scheduler=SchedulerConfig(max_num_batched_tokens=512))
    cases = golden_cases()
    assert cases, "the golden outputs are needed for the agreement check"

    async def run():
        engine = await start_engine(config)
        try:
            text_ids = engine.tokenizer.encode(TEXT.read_text(encoding="utf-8"))
            ppl = await perplexity(engine, text_ids, window=512)
            agree = await agreement(engine, [c["prompt_token_ids"] for c in cases],
                                    [c["output_token_ids"] for c in cases])
            return ppl.value, agree.value
        finally:
            await engine.shutdown()

    return asyncio.run(run())


@pytest.fixture(scope="module")
def measured(default_model_path) -> dict[str, tuple[float, float]]:
    return {scheme: _measure(str(default_model_path), scheme)
            for scheme in SCHEMES}


@pytest.mark.parametrize("scheme", ["int8", "w8a8", "q4", "w4a8"])
def test_perplexity_within_bound_of_float(measured, scheme):
    base, _ = measured["none"]
    ppl, _ = measured[scheme]
    assert 10 < base < 40, f"float perplexity {base:.3f} is off: the text or model changed"
    assert abs(ppl / base - 1) <= PPL_BOUND[scheme], (scheme, ppl, base)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_greedy_agreement_with_golden(measured, scheme):
    _, agree = measured[scheme]
    assert agree >= AGREEMENT_BOUND[scheme], (scheme, agree)
