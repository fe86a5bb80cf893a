"""Per-request scheduling state: token ids, progress, status and stop checks.

Modelled on vLLM v1's ``Request``/``RequestStatus`` (vllm/v1/request.py) and
its ``check_stop`` (vllm/v1/core/sched/utils.py). Timing (arrival, first
token, ...) beyond ``arrival_time`` is the engine's job, not this object's.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

from .sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    """Why a request finished; the values are OpenAI's ``finish_reason`` strings
    (``abort`` and ``error`` are vLLM/kvserve extensions)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


class RequestStatus(enum.Enum):
    """Life cycle of a request inside the scheduler.

    WAITING -> RUNNING -> (PREEMPTED -> RUNNING)* -> FINISHED_*. A preempted
    request sits in the waiting queue with status PREEMPTED until resumed.
    """

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        """True for the four FINISHED_* states."""
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        """The OpenAI ``finish_reason`` for a finished status, else None."""
        return _FINISH_REASONS.get(self)

    @classmethod
    def from_finish_reason(cls, reason: FinishReason) -> RequestStatus:
        """The FINISHED_* status that reports ``reason``."""
        return _STATUS_OF_REASON[reason]


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}
_STATUS_OF_REASON = {reason: status for status, reason in _FINISH_REASONS.items()}


class Request:
    """One sequence being served: its prompt, generated tokens and progress.

    Immutable inputs: ``request_id``, ``prompt_token_ids``,
    ``sampling_params``, ``arrival_time`` (seconds on the caller's clock; used
    only for ordering), ``priority`` (lower is served first), ``eos_token_ids``
    and ``max_model_len`` (most prompt + output tokens; None = no limit, the
    scheduler caps it at its own ``max_model_len``).

    Mutable state, owned by the scheduler:

    - ``status`` (``RequestStatus``), ``output_token_ids`` (generated tokens).
    - ``num_computed_tokens``: tokens whose K/V are in the KV cache or being
      computed by a step already scheduled (the scheduler advances it when it
      schedules, as vLLM V1 does, so the next step can be scheduled while
      this one computes).
    - ``num_output_placeholders``: tokens that scheduled steps will sample
      but that have not come back yet (async scheduling); the scheduler
      counts them as known when it plans the next chunk.
    - ``num_cached_tokens``: prefix-cache hit tokens at first scheduling
      (-1 before the first scheduling).
    - ``num_preemptions``: times preempted (by recompute).
    - ``outputs_void_through``: the last step id whose results for it are
      void (its K/V were lost and it restarts from its prompt:
      ``Scheduler.recompute``); -1 when none. ``num_kv_restarts``: such
      restarts so far.
    - ``block_hashes``: prefix-cache hashes of the full blocks of
      ``all_token_ids``, extended incrementally by the KV cache manager.
    - ``stop_reason``: the stop token id that finished it, if any.
    - ``error``: a message when it finished with FINISHED_ERROR.

    Raises ``ValueError`` for a non-string id or non-integer token ids.
    """

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int],
                 sampling_params: SamplingParams | None = None, arrival_time: float = 0.0,
                 priority: int = 0, eos_token_ids: Iterable[int] = (),
                 max_model_len: int | None = None) -> None:
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {request_id!r}")
        prompt = list(prompt_token_ids)
        if any(not isinstance(t, int) or isinstance(t, bool) for t in prompt):
            raise ValueError("prompt_token_ids must be integers")
        self.request_id = request_id
        self.prompt_token_ids: tuple[int, ...] = tuple(prompt)
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.arrival_time = float(arrival_time)
        self.priority = int(priority)
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = prompt
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.outputs_void_through = -1
        self.num_kv_restarts = 0
        self.block_hashes: list[bytes] = []
        self.stop_reason: int | None = None
        self.error: str | None = None
        #: Speculative decoding state (``core.spec_decode.SpecState``), None
        #: when the engine does not speculate.
        self.spec = None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens})")

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output tokens (a live list: do not mutate)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        """Number of known tokens: prompt + output."""
        return len(self._all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus those that steps in flight will sample."""
        return len(self._all_token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        """Number of prompt tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Number of generated tokens."""
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        """True once the status is one of the FINISHED_* states."""
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append one generated token id or several, in order."""
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        for token_id in token_ids:
            self.output_token_ids.append(token_id)
            self._all_token_ids.append(token_id)


def check_stop(request: Request) -> FinishReason | None:
    """Whether ``request`` must stop after its last generated token.

    Returns ``FinishReason.STOP`` when the last token is an EOS id (unless
    ``ignore_eos``) or in ``stop_token_ids``, but never before ``min_tokens``
    tokens were generated; ``FinishReason.LENGTH`` when ``max_tokens`` tokens
    were generated or prompt + output reached ``max_model_len``; else None.
    Stop tokens are checked first, so an EOS sampled as the very last allowed
    token reports ``stop`` (what OpenAI clients expect). Stop *strings* are
    matched by the detokenizer, which then finishes the request itself.
    Pure: it does not change the request.
    """
    num_output = request.num_output_tokens
    if num_output == 0:
        return None
    params = request.sampling_params
    if num_output >= params.min_tokens:
        last = request.output_token_ids[-1]
        if not params.ignore_eos and last in request.eos_token_ids:
            return FinishReason.STOP
        if last in params.stop_token_ids:
            return FinishReason.STOP
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return FinishReason.LENGTH
    if request.max_model_len is not None and request.num_tokens >= request.max_model_len:
        return FinishReason.LENGTH
    return None
