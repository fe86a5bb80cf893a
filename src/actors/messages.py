"""Typed messages: one frozen dataclass per edge between actors.

Data flow (DESIGN.md section 2)::

    API --GenerateRequest--> TokenizerActor --TokenizedRequest--> AdmissionActor
        --ReleaseRequests--> SchedulerActor --ExecuteStep--> WorkerActor
        --StepResult--> SchedulerActor --TokenDelta--> DetokenizerActor
        --RequestOutput--> the request's RequestStream --> API (SSE)

    SchedulerActor --CapacityReport--> AdmissionActor (free slots and blocks,
        requests handed back, requests finished)

Aborts travel as ``AbortRequest`` to the admission actor (which forwards them
to the scheduler when the request is no longer waiting there), also from the
detokenizer when a stop string matched.

A ``Request`` object (``ReleaseRequests``, ``CapacityReport.returned``)
changes owner with the message: the sender never touches it again.

All times are ``time.monotonic()`` seconds unless a field says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.core.admission_queue import SchedulerCapacity
from kvserve.core.outputs import SchedulerOutput
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams

if TYPE_CHECKING:  # the runner pulls in NumPy and the model; types only
    from kvserve.model.runner import ModelRunnerOutput


@dataclass(frozen=True)
class GenerateRequest:
    """A client's request as the API parsed it (API -> tokenizer).

    Exactly one of ``prompt`` (text), ``messages`` (chat, rendered with the
    model's chat template) or ``prompt_token_ids`` is set.
    ``priority``: lower is served first (vLLM's convention).
    ``request_class``: an optional workload label (``X-Request-Class``) that
    is carried into logs and metrics. ``parse_special``: special-token
    strings in a text ``prompt`` become control tokens (llama.cpp's
    ``parse_special``); by default they are text, as in message contents.
    """

    request_id: str
    sampling_params: SamplingParams
    arrival_time: float
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    priority: int = 0
    request_class: str | None = None
    parse_special: bool = False
    stream: bool | None = None  # the client's ``stream`` flag, for the lifecycle logs


@dataclass(frozen=True)
class TokenizedRequest:
    """A request with its prompt token ids (tokenizer -> admission -> scheduler).

    For ``n > 1`` the tokenizer sends one ``TokenizedRequest`` per sample,
    with ids ``{parent_id}-{index}``; they share the prompt (and its cached
    KV blocks) and report to the parent's stream under ``index``.
    """

    request_id: str
    parent_id: str
    index: int
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    request_class: str | None = None


@dataclass(frozen=True)
class AbortRequest:
    """Stop a request early (client gone, deadline passed, stop string matched).

    ``reason`` is ``"abort"`` or ``"stop"`` (a stop string matched; then the
    request finishes normally with finish_reason ``stop``).
    ``num_output_tokens``: for a stop, the tokens each request's output kept
    (up to the one that completed the stop string), aligned with
    ``request_ids``; its lifecycle log reports these rather than the tokens
    the engine had computed by then. Empty: not known.
    """

    request_ids: tuple[str, ...]
    reason: str = "abort"
    num_output_tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class AdoptBlocks:
    """A decode replica received a prefill replica's KV blocks for a request
    (engine -> scheduler): full prompt blocks by hash, in order; their K/V
    wait in the worker's ``KVConnector`` until a step loads them."""

    request_id: str
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class CapacityReport:
    """The scheduler's capacity, and requests going back (scheduler -> admission).

    ``returned``: waiting requests handed back in service order (preempted,
    or released but not admitted), keeping their arrival time.
    ``finished_ids``: requests released earlier that finished since the last
    report. ``wants_release``: the scheduler waits for a ``ReleaseRequests``
    answer before it schedules again (sent after a step's results, so the
    next step can admit what the finished requests freed).
    """

    capacity: SchedulerCapacity
    returned: tuple[Request, ...] = ()
    finished_ids: tuple[str, ...] = ()
    wants_release: bool = False


@dataclass(frozen=True)
class ReleaseRequests:
    """Requests the scheduler may start now, in queue order (admission ->
    scheduler). ``num_waiting``: requests still queued in admission (also
    sent alone, with no requests, when that count changed). ``answer``: this
    answers a ``CapacityReport`` with ``wants_release``."""

    requests: tuple[Request, ...]
    num_waiting: int
    answer: bool = False


@dataclass(frozen=True)
class TokenDelta:
    """New token ids of one request after a step (scheduler -> detokenizer).

    ``logprobs``: one entry per new token when the request asked for them:
    ``(sampled_logprob, ((token_id, logprob), ...top-k))``.
    ``finish_reason`` is set on the last delta: ``stop``, ``length``,
    ``abort`` or ``error`` (then ``error`` holds the message).
    ``prompt_logprobs``: when the request asked (``echo``), one entry per
    prompt token (None for the first), on the delta of its first token.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: tuple[Any, ...] | None = None
    error: str | None = None
    prompt_logprobs: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class RequestOutput:
    """What a client's stream receives: new text of one sample (``index``).

    ``text`` is the new text since the last output (never half a UTF-8
    character, never a partial stop string). ``finish_reason`` is set on the
    sample's last output (``error`` holds the message when it is ``error``).
    ``token_ids`` are the tokens generated since the previous output, with
    ``logprobs`` one entry per token when asked for. ``usage``-style counts
    ride along (cumulative) so the API can build OpenAI ``usage`` objects.

    ``text_offsets``: the character offset of each of ``token_ids`` in the
    sample's whole text (the concatenation of its ``text`` pieces): the
    number of characters completed by the tokens before it, at most the
    text's length. A token is sent with the output whose text holds its
    first character (or with the last output), so offsets never run past
    the text received so far. ``prompt_logprobs`` (``echo``): one entry per
    prompt token, None for the first, on the sample's first output.
    """

    request_id: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: tuple[Any, ...] | None = None
    error: str | None = None
    text_offsets: tuple[int, ...] | None = None
    prompt_logprobs: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class RequestAccepted:
    """First event on a stream: the prompt was tokenized and admitted."""

    request_id: str
    prompt_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class RequestFailed:
    """Terminal event on a stream: the request was refused or failed.

    ``status`` is the HTTP status the API answers with (400 bad input, 429
    overloaded, 503 not ready or draining, 500 a fault inside a step);
    ``type``/``param``/``code`` follow OpenAI's error object.
    """

    request_id: str
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after: float | None = None


def shutdown_failure(request_id: str, timeout: float) -> RequestFailed:
    """The 503 of a request still open when a drain of ``timeout`` seconds
    ended: a SIGTERM's ``--drain-timeout``, or 0 for Ctrl-C (SIGINT)."""
    why = "(--drain-timeout)" if timeout > 0 else "(interrupted: SIGINT does not wait)"
    return RequestFailed(request_id, 503, f"The server shut down before this request "
                         f"finished {why}.", type="service_unavailable")


@dataclass(frozen=True)
class HealthQuery:
    """Ask the scheduler for an ``EngineHealth`` reading (engine ->
    scheduler); the answer is set on ``reply`` (an ``asyncio.Future`` of
    the engine's loop). A scheduler whose loop is blocked never answers:
    the asker bounds its wait."""

    reply: Any


@dataclass(frozen=True)
class Stop:
    """Sentinel that ends an actor's run loop."""

    reason: str = "shutdown"


StreamEvent = RequestAccepted | RequestOutput | RequestFailed


@dataclass(frozen=True)
class ExecuteStep:
    """Run one model step (scheduler -> worker)."""

    step_id: int
    scheduler_output: SchedulerOutput


@dataclass(frozen=True)
class StepResult:
    """A finished model step (worker -> scheduler).

    ``runner_output`` is a ``ModelRunnerOutput``, or None when the step
    raised; then ``error`` describes the fault and every request of the step
    fails while the engine goes on. ``start``/``end`` are monotonic seconds.
    """

    step_id: int
    scheduler_output: SchedulerOutput
    runner_output: ModelRunnerOutput | None
    start: float
    end: float
    error: str | None = None
