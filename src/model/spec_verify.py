"""Speculative decoding, the runner's side: verify a request's draft tokens.

The step computed the request's last known token and its ``d`` drafts in
one chunk, so row i of its logits is the target model's distribution for
the token after draft i (row 0: after the last known token). With a draft
that is one proposed token per position (n-gram drafts: a point mass q),
the rejection sampling of Leviathan et al. (2023) and Chen et al. (2023) --
accept draft x with probability min(1, p(x) / q(x)) = p(x), else sample
from the normalized max(p - q, 0), i.e. p without x -- emits each token
with probability p, exactly as drawing ``t ~ p`` and accepting the draft
iff ``t == x``; on a rejection ``t`` itself is the emitted token. So
``verify_drafts`` samples every row as the plain sampler would (argmax
for greedy rows) and keeps the drafts while they agree: the output
distribution is the target's, and the first disagreement, or the row
after the last draft, adds the step's own token.

Seeds: a request draws exactly one uniform per *emitted* token (the
generator is rewound past the rows it did not use), as without
speculation, so a seeded request samples the same tokens with or without
it (up to the float rounding of a batched forward pass).

A draft model's sampled drafts come with their distributions q
(``kvserve.model.drafter``); ``verify_rejection`` then runs the full
rejection sampling, which accepts more often (its acceptance is
1 - TV(p, q) per position rather than p(x)). Greedy and seeded requests
get argmax drafts and ``verify_drafts``, so a seeded request keeps the
property above.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np

from kvserve.model import sampling_kernels as kernels
from kvserve.model.sampler import SamplingState, _host, _warpers


def verify_drafts(logits, drafts: Sequence[int], state: SamplingState,
                  xp: ModuleType = np) -> list[int]:
    """The tokens a speculative step emits: the accepted prefix of
    ``drafts`` and one more.

    Args:
        logits: float32[1 + d, V] (an ``xp`` array), row i the logits after
            the last known token (i = 0) or after draft i; not modified.
        drafts: the d draft token ids.
        state: the request's sampling state (no penalties, bias or logprobs:
            the scheduler only lets such requests speculate).
        xp: the array module of ``logits``.

    Returns:
        1 to d + 1 token ids.
    """
    rows = len(drafts) + 1
    if logits.shape[0] != rows:
        raise ValueError(f"verify_drafts: {logits.shape[0]} logits rows for {len(drafts)} drafts")
    params = state.params
    if params.temperature == 0.0:
        targets = _host(logits.argmax(axis=1)).tolist()
        return _accepted(targets, drafts)
    generator = state.generator
    saved = generator.bit_generator.state
    u = xp.asarray(generator.random(rows))
    warpers = _warpers([params] * rows, logits.shape[1], xp)
    targets = _host(kernels.sample_random(logits, warpers, u, xp)).tolist()
    emitted = _accepted(targets, drafts)
    generator.bit_generator.state = saved
    generator.random(len(emitted))  # one uniform per emitted token
    return emitted


def _accepted(targets: list[int], drafts: Sequence[int]) -> list[int]:
    """``targets`` up to and including the first that differs from its draft."""
    accepted = 0
    while accepted < len(drafts) and targets[accepted] == drafts[accepted]:
        accepted += 1
    return targets[:accepted + 1]


def verify_rejection(logits, drafts: Sequence[int], draft_probs: np.ndarray,
                     state: SamplingState, xp: ModuleType = np) -> list[int]:
    """The tokens a speculative step emits, by rejection sampling (Leviathan
    et al. 2023, Algorithm 1; Chen et al. 2023): draft i, drawn from q_i, is
    accepted with probability min(1, p_i(x) / q_i(x)); the first rejected
    position emits a draw from max(p_i - q_i, 0) normalized, and when every
    draft is accepted the row after the last adds a draw from p_d. Each
    emitted token is distributed as the target's own sampling would draw it.

    Args:
        logits: float32[1 + d, V] (an ``xp`` array), the target's rows as for
            ``verify_drafts``; not modified.
        drafts: the d draft token ids, draft i drawn from ``draft_probs[i]``.
        draft_probs: float64[d, V] host array, the draft model's warped
            distributions (the request's temperature, top-k, top-p, min-p).
        state: the request's sampling state (random, no penalties); its
            generator gives one uniform per accept test and per draw.
        xp: the array module of ``logits``.

    Returns:
        1 to d + 1 token ids.

    Raises:
        ValueError: when the shapes of ``logits``, ``drafts`` and
            ``draft_probs`` disagree.
    """
    d = len(drafts)
    if logits.shape[0] != d + 1 or draft_probs.shape[0] != d:
        raise ValueError(f"verify_rejection: {logits.shape[0]} logits rows and "
                         f"{draft_probs.shape[0]} draft rows for {d} drafts")
    warpers = _warpers([state.params] * (d + 1), logits.shape[1], xp)
    p = _host(kernels.warped_probs(logits, warpers, xp))
    generator = state.generator
    for i, x in enumerate(drafts):
        if generator.random() * draft_probs[i, x] < p[i, x]:
            continue  # accepted: u < p(x) / q(x)
        residual = np.maximum(p[i] - draft_probs[i], 0.0)
        if not residual.sum() > 0.0:
            residual = p[i]  # p == q up to rounding: the residual is p itself
        return list(drafts[:i]) + [draw_from(residual, generator.random())]
    return list(drafts) + [draw_from(p[d], generator.random())]


def draw_from(weights: np.ndarray, u: float) -> int:
    """The inverse CDF of unnormalized float64[V] ``weights`` (host) at ``u``
    in [0, 1): a token of positive weight."""
    cdf = np.cumsum(weights)
    token = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return min(token, int(np.flatnonzero(weights)[-1]))
