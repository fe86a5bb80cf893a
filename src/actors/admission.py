"""AdmissionActor: decides, before any compute is spent, whether a request enters."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.actors.base import Actor
from kvserve.actors.messages import QueueLoad, RequestAccepted, RequestFailed, TokenizedRequest
from kvserve.actors.registry import StreamRegistry


@dataclass(frozen=True)
class AdmissionLimits:
    """Bounds of the waiting queue (None = unbounded) and the policy.

    ``max_waiting_requests``: waiting sequences (each of ``n`` samples counts).
    ``max_waiting_tokens``: tokens the waiting sequences still need to compute
    (prompt tokens, plus generated ones of preempted requests).
    ``retry_after``: seconds suggested to a refused client (``Retry-After``).
    """

    policy: str = "fcfs"
    max_waiting_requests: int | None = None
    max_waiting_tokens: int | None = None
    retry_after: float = 1.0


@dataclass
class WaitingEstimate:
    """Admission's view of the waiting load, from messages alone.

    Between admission's ``send`` and the scheduler actor's ``add_request`` a
    request sits in the scheduler's inbox, invisible to the queue counts the
    scheduler reports; without counting those a burst would be admitted whole
    past the limits. So admission counts what it sent, the scheduler reports
    what it queued (``QueueLoad``), and the difference is in transit. Stale
    reports only overestimate (requests that left the queue since), so the
    limits hold.
    """

    sent_requests: int = 0
    sent_tokens: int = 0
    report: QueueLoad = QueueLoad(0, 0, 0, 0)

    def sent(self, num_tokens: int) -> None:
        """One request of ``num_tokens`` prompt tokens was sent to the scheduler."""
        self.sent_requests += 1
        self.sent_tokens += num_tokens

    def load(self) -> tuple[int, int]:
        """(waiting sequences, waiting tokens), those in transit included."""
        r = self.report
        return (r.waiting_requests + self.sent_requests - r.queued_requests,
                r.waiting_tokens + self.sent_tokens - r.queued_tokens)


def refusal(limits: AdmissionLimits, load: tuple[int, int], request: TokenizedRequest,
            n: int) -> RequestFailed | None:
    """Why ``request`` (with its ``n`` samples) may not enter now, or None.

    ``load`` is (waiting sequences, waiting prompt tokens). A non-zero
    priority under fcfs is a 400 (the flag is missing); a full waiting
    queue is a 429 with ``retry_after``, as vLLM and OpenAI signal overload.
    """
    rid = request.parent_id
    if request.priority != 0 and limits.policy != "priority":
        return RequestFailed(rid, 400, "priority is only supported with "
                             "--scheduling-policy priority (this server runs fcfs)",
                             param="priority")
    waiting, tokens = load
    if limits.max_waiting_requests is not None and waiting + n > limits.max_waiting_requests:
        return RequestFailed(rid, 429, f"The server is overloaded: {waiting} requests are "
                             f"waiting (--max-waiting-requests {limits.max_waiting_requests}).",
                             type="server_overloaded", code="too_many_requests",
                             retry_after=limits.retry_after)
    new_tokens = n * len(request.prompt_token_ids)
    if limits.max_waiting_tokens is not None and tokens + new_tokens > limits.max_waiting_tokens:
        return RequestFailed(rid, 429, f"The server is overloaded: {tokens} prompt tokens are "
                             f"waiting (--max-waiting-tokens {limits.max_waiting_tokens}).",
                             type="server_overloaded", code="too_many_requests",
                             retry_after=limits.retry_after)
    return None


class AdmissionActor(Actor):
    """Admits tokenized requests into the scheduler (and the detokenizer).

    The waiting queue itself (fcfs or priority order) lives in the core
    scheduler, which also needs it for preemption; this actor applies the
    policy check and the waiting-queue limits first, so an overloaded server
    answers 429 at once instead of queueing work it cannot serve in time.
    The first sample of a request decides for all its samples. It knows the
    queue only from the scheduler's ``QueueLoad`` messages (no shared state).
    """

    name = "admission"

    def __init__(self, streams: StreamRegistry, scheduler: Actor, detokenizer: Actor,
                 limits: AdmissionLimits | None = None) -> None:
        super().__init__()
        self.streams = streams
        self.scheduler = scheduler
        self.detokenizer = detokenizer
        self.limits = limits or AdmissionLimits()
        self.estimate = WaitingEstimate()

    async def handle(self, message: TokenizedRequest | QueueLoad) -> None:
        if isinstance(message, QueueLoad):
            self.estimate.report = message
            return
        if not self.streams.is_open(message.parent_id):
            return  # the client left (or the request was refused) meanwhile
        if message.index == 0:
            n = self.streams.num_samples(message.parent_id)
            failed = refusal(self.limits, self.estimate.load(), message, n)
            if failed is not None:
                self.log.info("request_rejected", request_id=message.parent_id,
                              status=failed.status, reason=failed.message)
                self.streams.fail(failed)
                return
            self.streams.put(message.parent_id,
                             RequestAccepted(message.parent_id, message.prompt_token_ids))
        self.detokenizer.send(message)
        self.estimate.sent(len(message.prompt_token_ids))
        self.scheduler.send(message)
