"""Speculative decoding, the scheduler's side: n-gram (prompt lookup) drafts,
who may speculate, acceptance counting and the per-request off switch.

Prompt lookup decoding (Saxena 2023; vLLM's ``ngram`` method): the last
``n`` tokens of a request (``prompt_lookup_max`` down to
``prompt_lookup_min``) are searched for earlier in its prompt and output;
the ``k`` tokens that followed the latest earlier occurrence are the draft.
The target model scores the last known token and the ``k`` drafts in one
chunk of the step; the runner keeps the drafts its own sampling agrees
with and adds one token of its own (``kvserve.model.spec_verify``), so a
step emits 1 to ``k + 1`` tokens and the output distribution is the
target's (Leviathan et al. 2023; Chen et al. 2023).

Pure logic on token ids and counts: no asyncio, no model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .request import Request
from .sampling_params import SamplingParams

#: The off switch: a request stops speculating when, over its last
#: ``OFF_WINDOW`` speculative steps, fewer than ``OFF_MIN_ACCEPTED`` drafts
#: were accepted per step on average (a step without a draft counts as 0),
#: and tries again after ``OFF_COOLDOWN`` plain decode steps. A speculating
#: request runs one step at a time (it drafts from its latest token), so in
#: a batch it sits out every other step: below about one accepted token per
#: step it loses more than it gains. Alone in the engine it loses nothing,
#: and the scheduler lets it speculate regardless.
OFF_WINDOW = 2
OFF_MIN_ACCEPTED = 1.5
OFF_COOLDOWN = 64


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` draft tokens: for n from ``max_n`` down to ``min_n``, the
    tokens after the latest earlier occurrence of the last n tokens of
    ``token_ids``; [] when none occurs (or ``k`` is 0)."""
    if k <= 0 or len(token_ids) <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
        starts = np.flatnonzero((windows == pattern).all(axis=1))
        if len(starts):
            follow = int(starts[-1]) + n
            return tokens[follow:follow + k].tolist()
    return []


def may_speculate(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a request's sampling lets its drafts be verified row by row:
    no penalties or logit bias (they would depend on the drafts), no
    ``min_tokens`` still masking EOS, no structured output, no logprobs."""
    return (params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
            and params.repetition_penalty == 1.0 and not params.logit_bias
            and params.min_tokens <= num_output_tokens and params.structured_outputs is None
            and params.logprobs is None and params.prompt_logprobs is None
            and not params.export_kv)


@dataclass
class SpecState:
    """One request's speculation: its recent accepted counts and whether it
    still speculates (``OFF_WINDOW`` / ``OFF_MIN_ACCEPTED``)."""

    enabled: bool = True
    recent: deque = field(default_factory=lambda: deque(maxlen=OFF_WINDOW))
    cooldown: int = 0  # plain steps left before it speculates again
    #: The draft model's proposal for the next step (``draft_model`` method).
    draft_token_ids: list[int] = field(default_factory=list)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, num_draft: int, num_accepted: int) -> None:
        """A speculative step's result (``num_draft`` 0: nothing to propose)."""
        self.recent.append(num_accepted)
        if num_draft:
            self.num_drafts += 1
            self.num_draft_tokens += num_draft
            self.num_accepted_tokens += num_accepted
        if len(self.recent) == OFF_WINDOW and sum(self.recent) < OFF_MIN_ACCEPTED * OFF_WINDOW:
            self.enabled, self.cooldown = False, OFF_COOLDOWN
            self.recent.clear()

    def plain_step(self) -> None:
        """A decode step without speculation while switched off: count down."""
        if not self.enabled:
            self.cooldown -= 1
            self.enabled = self.cooldown <= 0


@dataclass
class SpecDecodingStats:
    """Counts of one or more steps, as vLLM's spec-decode metrics define
    them: drafts proposed, their tokens, the accepted ones, and accepted
    tokens per draft position (index 0 = the first draft token)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """One draft of ``num_draft`` tokens, the first ``num_accepted`` accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos += [0] * (num_draft - len(self.accepted_per_pos))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a speculative step emits on average: 1 + accepted per draft
        (vLLM's "mean acceptance length"); 0.0 before any draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def draft_tokens(request: Request, spec, budget: int, limit: int) -> list[int]:
    """The draft of a decoding ``request`` -- its n-gram lookup, or the draft
    model's proposal that came back with its latest token -- no longer than
    ``budget`` (tokens left in the step), its ``max_tokens`` and the context
    length ``limit`` leave room for (the step also computes its last known
    token and samples one past the drafts). ``spec``: the scheduler's
    ``SpeculativeConfig``. A lookup that finds nothing counts as a step with
    no accepted draft for the request's off switch."""
    max_tokens = request.sampling_params.max_tokens
    room = min(spec.num_speculative_tokens, budget - 1, limit - request.num_tokens - 1)
    if max_tokens is not None:
        room = min(room, max_tokens - request.num_output_tokens - 1)
    if spec.uses_draft_model:  # proposed by the worker with the latest token
        drafts, request.spec.draft_token_ids = request.spec.draft_token_ids, []
        return drafts[:max(room, 0)]
    drafts = propose_ngram(request.all_token_ids, room, spec.prompt_lookup_min,
                           spec.prompt_lookup_max)
    if not drafts:
        request.spec.record(0, 0)  # a step run alone for nothing: the off switch counts it
    return drafts
