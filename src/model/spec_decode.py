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
