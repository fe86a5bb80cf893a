"""Typed messages: one frozen dataclass per edge between actors.

Data flow (DESIGN.md section 2; ``docs/architecture.md`` draws it)::

    API --GenerateRequest--> TokenizerActor --TokenizedRequest--> AdmissionActor
        --ReleaseRequests--> SchedulerActor --ExecuteStep--> WorkerActor
        --StepResult--> SchedulerActor --TokenDelta--> DetokenizerActor
        --RequestOutput--> the request's RequestStream --> API (SSE)

    SchedulerActor --CapacityReport--> AdmissionActor (free slots and blocks,
        requests handed back, requests finished)

The detokenizer alone writes client streams: the engine opens one with
``OpenStream`` and ends it with ``CloseStream``; the tokenizer's and
admission's refusals reach it as ``Deliver``. Aborts travel as
``AbortRequest`` through the tokenizer (requests it is still preparing) to
the admission actor, which forwards them to the scheduler when the request
is no longer waiting there; the detokenizer sends one to admission when a
stop string matched. Every statistic reaches the ``StatsActor`` as a
message (``RequestReceived`` ... ``FlushStats``). KV blocks move in the
worker's steps: saves, loads and exports are listed in the ``ExecuteStep``'s
``SchedulerOutput`` and exports come back in the ``StepResult``; imports
(``ImportBlocks``) and a tier (``AttachTier``) are sent to the worker, which
alone holds the KV connector.

Each actor's inbox takes one union of these types (its ``accepts``); a
``Mailbox`` refuses any other at the sender.

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
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables (chat)
    add_generation_prompt: bool = True  # chat: the template's assistant turn opener
    continue_final_message: bool = False  # chat: continue the last (assistant) message
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
    num_samples: int = 1  # the parent's n


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

    Sent when the capacity changed while admission has requests waiting,
    when released requests finished, or with preempted requests; never
    answered (the scheduler does not wait on admission). ``returned``:
    requests preempted since the last report, in service order, keeping
    their arrival time. ``finished_ids``: requests released earlier that
    finished since the last report.
    """

    capacity: SchedulerCapacity
    returned: tuple[Request, ...] = ()
    finished_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class ReleaseRequests:
    """Requests the scheduler may start now, in queue order (admission ->
    scheduler). ``num_waiting``: requests still queued in admission (also
    sent alone, with no requests, when that count changed: the scheduler
    reports its capacity only while it is not 0)."""

    requests: tuple[Request, ...]
    num_waiting: int


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


# --------------------------------------------------------------------------- streams
#
# A client's stream is written by the detokenizer alone: the engine opens it
# there, and the other actors' answers to the client (acceptance, refusals)
# travel to the detokenizer as these messages.


@dataclass(frozen=True)
class OpenStream:
    """A request's stream, opened by the engine before the request enters
    the tokenizer (engine -> detokenizer): every later event of request
    ``request_id`` (``n`` samples) is written to ``stream``."""

    request_id: str
    n: int
    stream: Any


@dataclass(frozen=True)
class Deliver:
    """An event for an open stream that no token delta carries: acceptance,
    a refusal, a timeout or a shutdown (tokenizer, admission, engine ->
    detokenizer). Dropped when the stream is no longer open."""

    request_id: str
    event: Any  # StreamEvent


@dataclass(frozen=True)
class CloseStream:
    """The client left: forget the request's stream (engine -> detokenizer)."""

    request_id: str


# --------------------------------------------------------------------------- the worker's KV


@dataclass(frozen=True)
class ImportBlocks:
    """A prefill replica's K/V for a request, kept by the worker's KV
    connector until a step loads them (engine -> worker): its full prompt
    blocks' ``block_hashes`` in order and ``data``
    (``[len(block_hashes), *block_shape]``)."""

    request_id: str
    block_hashes: tuple[bytes, ...]
    data: Any


@dataclass(frozen=True)
class DropImports:
    """Imported blocks no step will load (scheduler -> worker)."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class AttachTier:
    """Use the offload tier another process created at ``path`` (engine ->
    worker, and engine -> scheduler for its look-ups); ``reply`` (a future)
    gets None, or the ``ValueError`` of a tier that holds another model's
    blocks."""

    path: str
    reply: Any = None


# --------------------------------------------------------------------------- statistics
#
# Lifecycle logs, metrics and the ``engine_stats`` line are the stats
# actor's (``kvserve.actors.stats``); the others report to it. ``at`` is
# ``time.monotonic()`` when the reported thing happened, so timings do not
# include the message's wait in the stats actor's inbox.


@dataclass(frozen=True)
class RequestReceived:
    """The API handed a request to the engine (engine -> stats)."""

    request_id: str
    arrival_time: float
    priority: int
    request_class: str | None
    n: int
    prompt: Any = None
    log_prompts: bool = False
    stream: bool | None = None
    max_tokens: int | None = None


@dataclass(frozen=True)
class RequestQueued:
    """A sample entered the waiting queue (admission -> stats)."""

    request_id: str
    parent_id: str
    arrival_time: float
    prompt_tokens: int
    priority: int
    request_class: str | None
    at: float


@dataclass(frozen=True)
class StepScheduled:
    """``schedule()`` returned a step (scheduler -> stats); ``num_waiting``
    counts the waiting queue and the requests staged in the scheduler."""

    output: SchedulerOutput
    num_running: int
    num_waiting: int
    kv_usage: float
    at: float


@dataclass(frozen=True)
class StepFinished:
    """A step's results were emitted (scheduler -> stats): the worker's span
    (``start``, ``end``), its phases (``times``), and the step's
    speculative-decoding and KV-transfer counts when there are any."""

    output: SchedulerOutput
    start: float
    end: float
    times: Any  # core.stats.StepTimes
    spec: Any = None  # core.spec_decode.SpecDecodingStats
    transfer: Any = None  # kv_offload.kv_connector.TransferStats


@dataclass(frozen=True)
class RequestsUpdated:
    """Requests' token deltas left the core, or requests finished without
    one (scheduler, admission -> stats): ``(update, emitted)`` pairs, where
    ``emitted`` is False for one the detokenizer already ended (a stop
    string)."""

    updates: tuple[tuple[Any, bool], ...]  # (core.outputs.RequestUpdate, emitted)
    at: float


@dataclass(frozen=True)
class LoadReport:
    """The engine's load now (scheduler -> stats): requests running, waiting
    (in the queue and staged), KV cache usage (0..1)."""

    num_running: int
    num_waiting: int
    kv_usage: float


@dataclass(frozen=True)
class StallReport:
    """A stall reading (scheduler -> stats): seconds with work and no
    finished step, and whether that is past ``--stall-timeout``."""

    seconds: float
    stalled: bool


@dataclass(frozen=True)
class FlushStats:
    """Write an ``engine_stats`` line now (the stats actor's timer, the
    engine's ``log_stats`` and shutdown -> stats). ``force``: even when the
    engine was idle for two intervals; ``reply``: a future that receives the
    line's fields (None when the line was skipped)."""

    force: bool = False
    reply: Any = None  # asyncio.Future[dict | None]


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
    #: The worker lost the K/V of the cache (a pipeline stage restarted,
    #: ``kvserve.model.runner.KVCacheLost``): the scheduler fails the running
    #: requests and forgets every cached block.
    kv_lost: bool = False
    #: A block the step was to load from an offload tier was gone
    #: (``kvserve.model.runner.KVLoadLost``): the step computed nothing; the
    #: scheduler restarts its requests from their prompts instead of failing them.
    kv_load_lost: bool = False
