"""Plain data exchanged between the scheduler, the model runner and the engine.

All frozen dataclasses of tuples, ints and strings, so they can cross a
thread boundary (the worker thread) and be logged as they are. Token counts
are in tokens, positions are 0-based token indices, block ids index the KV
cache's block dimension.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .kv_transfer import BlockTransfer
from .request import FinishReason, Request
from .sampling_params import SamplingParams


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's work in a step, as a delta to what the runner holds.

    - ``num_tokens``: tokens whose K/V are computed this step (a prompt
      chunk, the last generated token, or after preemption the prompt +
      output tokens being recomputed); the runner knows their ids: the
      prompt and earlier outputs came with ``NewRequestData``, later tokens
      are the ones it sampled.
    - ``start_position``: position of the first of them (= tokens already in
      the KV cache before this step).
    - ``new_block_ids``: blocks appended to the request's block table since
      it was last scheduled; the whole table when ``is_new``. Token at
      position p lives in block ``table[p // block_size]``, slot
      ``p % block_size``.
    - ``sample``: True iff this step computes the request's last known token,
      so the runner samples the next token from its logits.
    - ``is_new``: first scheduling or resume after preemption; the runner
      (re)creates its per-request state from ``SchedulerOutput.new_requests``.
    - ``spec_token_ids``: draft tokens (speculative decoding): the chunk is
      the request's last known token followed by these, ``num_tokens`` =
      1 + their count; the runner scores every position and returns the
      drafts it accepts plus one token of its own.
    - ``num_lookahead_tokens``: draft tokens the worker's draft model
      proposes for the request's next step, after this one samples
      (``draft_model`` speculation; vLLM's lookahead slots). Its block table
      already covers that many positions past the chunk, where the draft
      model writes its own K/V.
    """

    request_id: str
    num_tokens: int
    start_position: int
    new_block_ids: tuple[int, ...]
    sample: bool
    is_new: bool
    spec_token_ids: tuple[int, ...] = ()
    num_lookahead_tokens: int = 0


@dataclass(frozen=True)
class NewRequestData:
    """What the runner needs to (re)create a request's state.

    ``output_token_ids`` are the tokens generated before a preemption (empty
    for a first scheduling); ``num_cached_tokens`` the prefix-cache hit tokens
    of this (re)scheduling; ``resumed`` is True after a preemption.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    num_cached_tokens: int
    resumed: bool


@dataclass(frozen=True)
class PreemptionEvent:
    """A request preempted by recompute this step; its ``num_blocks_freed``
    blocks went back to the pool (cached ones stay reusable)."""

    request_id: str
    reason: str
    num_blocks_freed: int


@dataclass(frozen=True)
class PrefixCacheDivergence:
    """A prefix-cache miss that a different prefix caused (the cache-miss
    explainer, ``kvserve.core.prefix_explainer``), reported once per request
    at its first admission.

    - ``position``: 0-based token index where the prompt first differs from
      the best-matching cached prompt.
    - ``would_hit_tokens``: prompt tokens that would have hit had the prompt
      been identical to that cached prompt up to where they agree again.
    - ``hit_tokens``: prompt tokens that did hit (always < ``would_hit_tokens``).
    """

    request_id: str
    position: int
    would_hit_tokens: int
    hit_tokens: int


@dataclass(frozen=True)
class RequestUpdate:
    """What changed for one request: new tokens and/or that it finished.

    - ``new_token_ids``: tokens appended this step (after stop truncation).
    - ``finish_reason``: None while it runs; else why it finished.
    - ``stop_reason``: the stop token id that finished it, if it was one of
      ``stop_token_ids`` (EOS reports None, like vLLM).
    - ``num_cached_tokens``: prefix-cache hit tokens at first scheduling
      (-1 if never scheduled).
    - ``num_prompt_tokens`` / ``num_output_tokens``: totals so far.
    - ``num_preemptions``: times it was preempted so far.
    - ``error``: message when ``finish_reason`` is ERROR.
    - ``num_draft_tokens`` / ``num_accepted_tokens``: speculative decoding's
      draft tokens proposed for it and accepted, so far.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    num_cached_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int
    stop_reason: int | None = None
    error: str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        """True when the request finished with this update."""
        return self.finish_reason is not None

    @classmethod
    def of(cls, request: Request, new_token_ids: Sequence[int] = ()) -> RequestUpdate:
        """The update of ``request`` as it is now, with these new tokens."""
        return cls(
            request_id=request.request_id, new_token_ids=tuple(new_token_ids),
            finish_reason=request.status.finish_reason,
            num_cached_tokens=request.num_cached_tokens,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_preemptions=request.num_preemptions, stop_reason=request.stop_reason,
            error=request.error,
            num_draft_tokens=request.spec.num_draft_tokens if request.spec else 0,
            num_accepted_tokens=request.spec.num_accepted_tokens if request.spec else 0)


@dataclass(frozen=True)
class SchedulerOutput:
    """One scheduling step, consumed by the model runner and the engine.

    - ``step_id``: 0, 1, 2, ... per ``schedule()`` call.
    - ``scheduled``: requests to run, decodes first then prefill chunks.
    - ``new_requests``: data for the ``is_new`` ones.
    - ``finished_request_ids``: finished, aborted or preempted since the last
      step (including during this ``schedule()``); the runner drops their
      state. May name requests the runner never saw.
    - ``preemptions``: preemptions made in this step.
    - ``rejected``: requests finished with an error while scheduling (e.g. a
      prompt longer than ``max_model_len``); report them like updates.
    - ``num_batched_tokens`` = ``num_prefill_tokens`` + ``num_decode_tokens``
      (a decode token is a 1-token step of a request whose prompt is fully
      computed, not newly (re)scheduled).
    - ``first_scheduled_request_ids``: requests scheduled for the very first
      time (their prompt's queue time ends here).
    - ``prefix_cache_queries`` / ``prefix_cache_hits``: tokens queried / hit
      in the prefix cache by admissions of this step.
    - ``kv_cache_usage``: fraction (0..1) of blocks in use after scheduling.
    - ``num_running`` / ``num_waiting``: queue lengths after scheduling.
    - ``divergences``: prefix-cache divergences of the requests admitted for
      the first time in this step (see ``PrefixCacheDivergence``).
    - ``written_block_ids``: the blocks this step writes K/V into, loads
      included (their prefix-cache hashes must go if the step fails).
    - ``kv_saves`` / ``kv_exports`` / ``kv_loads``: blocks the runner copies
      to the offload tier, out for a decode replica, and in from the tier or
      an import, in that order, before the forward pass (``kv_transfer``).
    - ``kv_export_ids``: the requests whose exports ``kv_exports`` carries
      (one with no full block exports none, and is listed all the same).
    - ``kv_offload_queries`` / ``kv_offload_hits``: tokens looked up in /
      loaded from the offload tier by admissions of this step.
    """

    step_id: int
    scheduled: tuple[ScheduledRequest, ...]
    new_requests: tuple[NewRequestData, ...]
    finished_request_ids: tuple[str, ...]
    preemptions: tuple[PreemptionEvent, ...]
    rejected: tuple[RequestUpdate, ...]
    num_batched_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    first_scheduled_request_ids: tuple[str, ...]
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_cache_usage: float
    num_running: int
    num_waiting: int
    divergences: tuple[PrefixCacheDivergence, ...] = ()
    written_block_ids: tuple[int, ...] = ()
    kv_saves: tuple[BlockTransfer, ...] = ()
    kv_exports: tuple[BlockTransfer, ...] = ()
    kv_export_ids: tuple[str, ...] = ()
    kv_loads: tuple[BlockTransfer, ...] = ()
    kv_offload_queries: int = 0
    kv_offload_hits: int = 0

    @property
    def is_empty(self) -> bool:
        """True when there is nothing for the runner to compute or copy."""
        return not (self.scheduled or self.kv_saves or self.kv_export_ids or self.kv_loads)
