"""Token sampling from logits: greedy, temperature, top-k, top-p, min-p, penalties.

Runs on the host in NumPy for every backend: a [R, vocab] float32 block is
small next to the forward pass, and per-request options differ row by row.

Order of operations: logit bias, min_tokens masking (EOS and
``stop_token_ids`` banned while fewer than ``min_tokens`` tokens were
generated), repetition penalty, presence/frequency penalties; then, for
random rows, temperature -> top-k -> top-p -> min-p and one inverse-CDF draw
from the request's generator. Greedy rows (temperature 0) take the argmax of
the processed logits.

The warper order is Hugging Face transformers' (TemperatureLogitsWarper,
TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper) and llama.cpp's default
sampler chain for these three. vLLM V1 applies min-p before top-k/top-p; we
deliberately follow HF. The two differ: probabilities [.4, .3, .2, .1] with
top_p .75 and min_p .3 keep {0, 1, 2} here (top-p keeps the three tokens
reaching .75, min-p's threshold .12 keeps all three), {0, 1} in vLLM V1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvserve.core.sampling_params import SamplingParams

LogprobEntry = tuple[float, tuple[tuple[int, float], ...]]


@dataclass
class SamplingState:
    """Per-request sampling state the runner keeps between steps.

    ``generator`` gives one uniform draw per sampled token, so a seeded
    request's text does not depend on what else is in the batch; after a
    preemption the runner fast-forwards it by the tokens already generated.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...]
    generator: np.random.Generator = field(default_factory=np.random.default_rng)
    #: Prompt logprob entries gathered so far (chunked prefill computes them
    #: over several steps), starting with None for the first prompt token;
    #: None when the request did not ask or they were already delivered.
    prompt_logprobs: list[LogprobEntry | None] | None = None

    @classmethod
    def create(cls, params: SamplingParams, prompt: list[int], output: list[int],
               eos_token_ids: tuple[int, ...], fallback: np.random.Generator) -> SamplingState:
        """Build the state; a seeded request gets its own generator, advanced by
        ``len(output)`` draws so recompute after preemption continues the stream."""
        if params.seed is not None:
            gen = np.random.default_rng(params.seed % 2**64)  # numpy wants seed >= 0
            if output:
                gen.random(len(output))
        else:
            gen = fallback
        state = cls(params, list(prompt), list(output), eos_token_ids, gen)
        if params.prompt_logprobs is not None and not output:
            state.prompt_logprobs = [None]  # delivered with the first sampled token
        return state


def apply_penalties(logits: np.ndarray, state: SamplingState) -> None:
    """In place on one row float32[V]: logit bias, min_tokens, penalties.

    Repetition penalty as in CTRL (Keskar et al. 2019) / HF: divide positive
    logits of seen tokens (prompt and output), multiply negative ones.
    Presence and frequency penalties as the OpenAI API reference defines:
    ``logit -= presence * (count > 0) + frequency * count`` over output tokens.
    """
    p = state.params
    vocab = logits.shape[0]
    for token_id, bias in p.logit_bias:
        if 0 <= token_id < vocab:  # the API refuses others; never index out of range
            logits[token_id] += bias
    if len(state.output_token_ids) < p.min_tokens:
        banned = [t for t in (*state.eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab]
        logits[banned] = -np.inf
    if p.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(state.prompt_token_ids + state.output_token_ids, dtype=np.int64))
        vals = logits[seen]
        logits[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and state.output_token_ids:
        ids, counts = np.unique(np.asarray(state.output_token_ids, dtype=np.int64), return_counts=True)
        logits[ids] -= p.presence_penalty + p.frequency_penalty * counts.astype(np.float32)


def _needs_processing(p: SamplingParams) -> bool:
    """True when ``apply_penalties`` would change the row."""
    return bool(p.logit_bias or p.min_tokens or p.repetition_penalty != 1.0
                or p.presence_penalty or p.frequency_penalty)


Filtered = tuple[np.ndarray, np.ndarray]


def _top_k(weights: np.ndarray, candidates: np.ndarray, p: SamplingParams) -> Filtered:
    """Keep the ``top_k`` largest weights (0 or -1, or k >= count: all)."""
    if not 0 < p.top_k < weights.shape[0]:
        return weights, candidates
    keep = np.argpartition(-weights, p.top_k - 1)[: p.top_k]
    return weights[keep], candidates[keep]


def _top_p(weights: np.ndarray, candidates: np.ndarray, p: SamplingParams) -> Filtered:
    """Keep the smallest most-likely set whose mass reaches ``top_p``
    (Holtzman et al. 2019): a token stays when the mass strictly before it,
    in descending order, is below ``top_p``, so the token crossing the
    threshold is kept. Returns the kept tokens in descending order."""
    if p.top_p >= 1.0:
        return weights, candidates
    order = np.argsort(-weights, kind="stable")
    cumulative = np.cumsum(weights[order])
    keep = cumulative - weights[order] < p.top_p * cumulative[-1]
    order = order[keep]
    return weights[order], candidates[order]


def _min_p(weights: np.ndarray, candidates: np.ndarray, p: SamplingParams) -> Filtered:
    """Drop tokens below ``min_p`` x the largest probability (Nguyen et al. 2024)."""
    if p.min_p <= 0.0:
        return weights, candidates
    keep = weights >= p.min_p * weights.max()
    return weights[keep], candidates[keep]


#: Warpers applied after temperature, in order (Hugging Face's order).
_FILTERS = (_top_k, _top_p, _min_p)


def sample_row(logits: np.ndarray, state: SamplingState) -> int:
    """Draw one token id from processed float32[V] logits (random sampling).

    Scales by the temperature in float64, turns the row into unnormalised
    probabilities float64[V], runs ``_FILTERS`` (top-k -> top-p -> min-p;
    each sees the mass left by the previous one), then inverse-CDF samples
    with exactly one uniform draw from ``state.generator``.
    """
    p = state.params
    scaled = logits.astype(np.float64) / p.temperature
    weights = np.exp(scaled - scaled.max())
    candidates = np.arange(weights.shape[0])
    for step in _FILTERS:
        weights, candidates = step(weights, candidates, p)
    cdf = np.cumsum(weights)
    u = state.generator.random() * cdf[-1]
    index = min(int(np.searchsorted(cdf, u, side="right")), len(cdf) - 1)
    return int(candidates[index])


def top_logprobs(row: np.ndarray, token_id: int, k: int, mode: str) -> LogprobEntry:
    """Logprob of the sampled token and the top-k entries of one row.

    ``mode`` ``raw_logits`` returns logits instead of log-probabilities
    (vLLM's ``--logprobs-mode``); otherwise log-softmax in float64.
    """
    if mode == "raw_logits":
        values = row.astype(np.float64)
    else:
        shifted = row.astype(np.float64) - row.max()
        values = shifted - np.log(np.exp(shifted).sum())
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        ids = np.argpartition(-values, k - 1)[:k]
        ids = ids[np.argsort(-values[ids], kind="stable")]
        top = tuple((int(i), float(values[i])) for i in ids)
    return float(values[token_id]), top


def prompt_logprobs(logits: np.ndarray, target_ids: np.ndarray, k: int, temperature: float,
                    mode: str) -> list[LogprobEntry]:
    """Logprob entries of prompt tokens (``echo`` / ``prompt_logprobs``).

    Row r of ``logits`` (float32[P, V]) is the model's prediction at prompt
    position j, scored against the prompt's token j + 1 (``target_ids[r]``).
    Same definition as for sampled tokens, but without logit bias and
    penalties (they belong to the generated tokens): the log-softmax of
    ``logits / temperature`` (temperature 0 counts as 1) in
    ``processed_logprobs`` mode, of the raw logits in ``raw_logprobs`` mode,
    the raw logits themselves in ``raw_logits`` mode.
    """
    scale = 1.0 if mode.startswith("raw") or not temperature else 1.0 / temperature
    return [top_logprobs(row * scale if scale != 1.0 else row, int(target), k, mode)
            for row, target in zip(logits, target_ids)]


def sample(logits: np.ndarray, states: list[SamplingState],
           logprobs_mode: str = "processed_logprobs") -> tuple[list[int], list[LogprobEntry | None]]:
    """Sample one token per row.

    Args:
        logits: float32[R, V], row r belongs to ``states[r]``. Modified in place.
        states: the rows' sampling states.
        logprobs_mode: ``processed_logprobs`` (after penalties and temperature,
            as the OpenAI reference describes), ``raw_logprobs`` or ``raw_logits``.

    Returns:
        (token ids, logprob entries; None where the request did not ask).
    """
    raw = logits.copy() if logprobs_mode.startswith("raw") and any(
        s.params.logprobs is not None for s in states) else None
    for r, state in enumerate(states):
        if _needs_processing(state.params):
            apply_penalties(logits[r], state)
    greedy_ids = logits.argmax(axis=1)
    tokens, entries = [], []
    for r, state in enumerate(states):
        p = state.params
        token = int(greedy_ids[r]) if p.temperature == 0.0 else sample_row(logits[r], state)
        tokens.append(token)
        if p.logprobs is None:
            entries.append(None)
            continue
        row = raw[r] if raw is not None else logits[r] / (p.temperature or 1.0)
        entries.append(top_logprobs(row, token, p.logprobs, logprobs_mode))
    return tokens, entries
