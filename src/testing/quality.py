"""Model quality through the serving path: perplexity and greedy-token agreement.

A gate for quantization and kernel changes (``tools/quality.py``, the
quantization tests). Both measures run in-process through ``AsyncEngine``,
so they see exactly the weights, kernels and sampler a server would use.

- **Perplexity** of a text: the text's tokens in non-overlapping windows of
  ``window`` tokens, each sent as a prompt with ``prompt_logprobs=0`` and
  ``max_tokens=1``; ``exp(-mean log p(token | the window before it))`` over
  every token but each window's first (raw log-softmax of the logits, the
  usual definition; e.g. Hugging Face's "Perplexity of fixed-length models").
- **Greedy agreement** of a candidate engine with a reference one: the
  reference generates ``max_tokens`` greedy tokens per prompt; the candidate
  scores prompt + those tokens with ``prompt_logprobs=1`` (teacher forcing),
  and agreement is the fraction of the generated positions where its top-1
  token equals the reference's. Divergences do not cascade, so the number
  measures per-token agreement, not the length of a common prefix.
- **Decode match**: the candidate generates its own ``max_tokens`` greedy
  tokens per prompt (decode steps, which may take other kernels than the
  prompt pass: ``--quantization w4a8`` quantizes activations only there),
  and the match is the fraction of the reference's tokens that the
  candidate reproduces before its first divergence.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.actors.messages import GenerateRequest, RequestFailed, RequestOutput
from kvserve.config import EngineConfig
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine import AsyncEngine

#: Prompts of the agreement check when none are given: short, varied, English.
DEFAULT_PROMPTS = (
    "The capital of France is",
    "Here is a recipe for pancakes:",
    "def fibonacci(n):",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "Water boils at a temperature of",
    "The most important lesson I learned in school was",
    "To install the package, run",
)


@dataclass(frozen=True)
class Perplexity:
    """``value`` = exp(mean negative log-likelihood) over ``num_tokens`` tokens."""

    value: float
    num_tokens: int
    seconds: float


@dataclass(frozen=True)
class Agreement:
    """Fraction of generated positions where the candidate's top-1 token
    equals the reference's greedy token, over ``num_tokens`` positions of
    ``num_prompts`` prompts; ``per_prompt`` the same per prompt."""

    value: float
    num_tokens: int
    num_prompts: int
    per_prompt: tuple[float, ...]


async def _run(engine: AsyncEngine, prompt_ids: Sequence[int], params: SamplingParams,
               tag: str) -> RequestOutput:
    """The final output of one request, with the first output's prompt logprobs."""
    stream = engine.generate(GenerateRequest(
        request_id=f"{tag}-{time.monotonic_ns()}", sampling_params=params,
        arrival_time=time.monotonic(), prompt_token_ids=tuple(prompt_ids)))
    tokens: list[int] = []
    prompt_logprobs = None
    async for event in stream:
        if isinstance(event, RequestFailed):
            raise RuntimeError(f"quality request failed: {event.message}")
        if isinstance(event, RequestOutput):
            tokens += event.token_ids
            prompt_logprobs = prompt_logprobs or event.prompt_logprobs
            if event.finish_reason is not None:
                return RequestOutput(event.request_id, 0, "", tuple(tokens),
                                     event.finish_reason, prompt_logprobs=prompt_logprobs)
    raise RuntimeError("the stream ended without a final output")


async def perplexity(engine: AsyncEngine, token_ids: Sequence[int], window: int = 512,
                     llamacpp_convention: bool = False) -> Perplexity:
    """Perplexity of ``token_ids`` under ``engine`` (see the module docstring).

    ``llamacpp_convention``: score as llama.cpp's ``llama-perplexity -c
    window`` does, for a figure comparable with its: whole windows only, and
    in each only the tokens after its first half (predicted from at least
    ``window // 2`` tokens of context). Raises ``ValueError`` for a window
    below 2 tokens or a text shorter (than one window, by that convention).
    """
    if window < 2 or len(token_ids) < 2:
        raise ValueError("perplexity needs a window and a text of at least 2 tokens")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    windows = [token_ids[i:i + window] for i in range(0, len(token_ids) - 1, window)]
    first = 1
    if llamacpp_convention:
        windows = [w for w in windows if len(w) == window]
        first = window // 2 + 1
        if not windows:
            raise ValueError(f"the text is shorter than one window of {window} tokens")
    t0 = time.perf_counter()
    outputs = await asyncio.gather(*(_run(engine, w, params, "ppl") for w in windows))
    logprobs = [entry[0] for out in outputs for entry in out.prompt_logprobs[first:]]
    nll = -math.fsum(logprobs) / len(logprobs)
    return Perplexity(math.exp(nll), len(logprobs), time.perf_counter() - t0)


async def greedy_tokens(engine: AsyncEngine, prompts: Sequence[Sequence[int]],
                        max_tokens: int) -> list[list[int]]:
    """``max_tokens`` greedy tokens per prompt (EOS ignored)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = await asyncio.gather(*(_run(engine, p, params, "ref") for p in prompts))
    return [list(out.token_ids) for out in outputs]


async def agreement(candidate: AsyncEngine, prompts: Sequence[Sequence[int]],
                    reference_tokens: Sequence[Sequence[int]]) -> Agreement:
    """Teacher-forced top-1 agreement of ``candidate`` with the reference's
    greedy continuations (see the module docstring)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outputs = await asyncio.gather(*(
        _run(candidate, list(p) + list(r), params, "agree")
        for p, r in zip(prompts, reference_tokens)))
    per_prompt, matched, total = [], 0, 0
    for prompt, ref, out in zip(prompts, reference_tokens, outputs):
        entries = out.prompt_logprobs[len(prompt):len(prompt) + len(ref)]
        hits = sum(entry[1][0][0] == token for entry, token in zip(entries, ref))
        per_prompt.append(hits / len(ref))
        matched, total = matched + hits, total + len(ref)
    return Agreement(matched / total, total, len(prompts), tuple(per_prompt))


async def decode_match(candidate: AsyncEngine, prompts: Sequence[Sequence[int]],
                       reference_tokens: Sequence[Sequence[int]]) -> Agreement:
    """The fraction of each prompt's reference greedy tokens that the
    candidate's own greedy generation reproduces before its first
    divergence (see the module docstring)."""
    max_tokens = max(len(r) for r in reference_tokens)
    generated = await greedy_tokens(candidate, prompts, max_tokens)
    per_prompt, matched, total = [], 0, 0
    for ref, got in zip(reference_tokens, generated):
        common = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b),
                      min(len(ref), len(got)))
        per_prompt.append(common / len(ref))
        matched, total = matched + common, total + len(ref)
    return Agreement(matched / total, total, len(prompts), tuple(per_prompt))


async def start_engine(config: EngineConfig) -> AsyncEngine:
    """An engine for quality runs: raw log-probabilities, no stats lines."""
    from dataclasses import replace

    return await AsyncEngine.start(replace(config, logprobs_mode="raw_logprobs"),
                                   stats_interval=0)
