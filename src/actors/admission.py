"""AdmissionActor: owns the waiting queue; decides what enters, and when it starts."""

from __future__ import annotations

import time

from kvserve.actors.base import Actor, Mailbox
from kvserve.actors.messages import (
    AbortRequest,
    CapacityReport,
    Deliver,
    ReleaseRequests,
    RequestAccepted,
    RequestFailed,
    RequestQueued,
    RequestsUpdated,
    TokenDelta,
    TokenizedRequest,
)
from kvserve.core.admission_queue import AdmissionLimits, AdmissionQueue, SchedulerCapacity
from kvserve.core.drain_rate import DrainRate
from kvserve.core.outputs import RequestUpdate
from kvserve.core.request import Request, RequestStatus

__all__ = ["AdmissionActor", "AdmissionLimits", "refusal"]


def refusal(queue: AdmissionQueue, request: TokenizedRequest, n: int,
            drain: DrainRate | None = None, now: float = 0.0) -> RequestFailed | None:
    """Why ``request`` (with its ``n`` samples) may not enter now, or None.

    A non-zero priority under fcfs is a 400 (the flag is missing), and so is
    a request that could not wait even in an empty queue (its ``n`` or its
    prompt alone exceed a waiting limit: a retry can never succeed); a full
    waiting queue is a 429 with ``Retry-After``, as vLLM and OpenAI signal
    overload: the seconds until the queue, at its measured ``drain`` rate,
    has room for this request (``now``: seconds on the drain's clock).
    """
    limits, rid = queue.limits, request.parent_id
    if request.priority != 0 and limits.policy != "priority":
        return RequestFailed(rid, 400, "priority is only supported with "
                             "--scheduling-policy priority (this server runs fcfs)",
                             param="priority")
    never = queue.never_admissible(n, len(request.prompt_token_ids))
    if never is not None:
        return RequestFailed(rid, 400, f"This request can never be admitted: {never[0]}.",
                             param=never[1])
    reason = queue.refusal(n, len(request.prompt_token_ids))
    if reason is None:
        return None
    retry = limits.retry_after
    if drain is not None:
        retry = drain.retry_after(now, *queue.overflow(n, len(request.prompt_token_ids)),
                                  default=limits.retry_after)
    return RequestFailed(rid, 429, f"The server is overloaded: {reason}.",
                         type="server_overloaded", code="too_many_requests", retry_after=retry)


class AdmissionActor(Actor):
    """Holds every waiting request and releases them as the scheduler has room.

    Inbox: ``TokenizedRequest`` (a new request: refused with a 4xx at once,
    or queued), ``CapacityReport`` (the scheduler's room, and requests it
    preempted), ``AbortRequest`` (from the API, a deadline, or a stop
    string). Requests leave in ``ReleaseRequests`` messages. The queue's
    order, limits and release rule are ``kvserve.core.admission_queue``;
    this actor only moves messages. It knows which requests it released and
    not seen finished, so an abort that misses a request in transit between
    the two actors still finds it.

    Its answers to the client (the acceptance, a refusal) go to the
    detokenizer as ``Deliver``; its queue's events to the stats actor.

    Args:
        scheduler, detokenizer, stats: the peers' mailboxes.
        queue: the admission queue (policy, limits, block arithmetic).
        eos_token_ids, max_model_len: given to each ``Request`` it creates.
    """

    name = "admission"
    accepts = (TokenizedRequest, CapacityReport, AbortRequest)

    def __init__(self, scheduler: Mailbox, detokenizer: Mailbox, stats: Mailbox,
                 queue: AdmissionQueue, eos_token_ids: tuple[int, ...] = (),
                 max_model_len: int | None = None, inbox: Mailbox | None = None) -> None:
        super().__init__(inbox)
        self.scheduler = scheduler
        self.detokenizer = detokenizer
        self.stats = stats
        self.queue = queue
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.capacity = SchedulerCapacity(free_seqs=1, free_blocks=0)  # until the first report
        self.drain = DrainRate()  # releases per second, for the Retry-After of a 429
        self.released: set[str] = set()  # released, not seen finished or returned
        self._sent_waiting = 0  # the queue length the scheduler last heard
        self.abort_pending: dict[str, str] = {}  # released id -> abort reason, forwarded
        self._refused: set[str] = set()  # refused requests whose later samples still come

    async def handle(self, message) -> None:
        if isinstance(message, TokenizedRequest):
            self._admit(message)
        elif isinstance(message, CapacityReport):
            self._on_capacity(message)
        elif isinstance(message, AbortRequest):
            self._abort(message)
        else:
            raise TypeError(f"unexpected message {type(message).__name__}")

    def on_error(self, message, exc: Exception) -> None:
        """A request that could not be queued fails alone."""
        if isinstance(message, TokenizedRequest):
            self.detokenizer.send(TokenDelta(
                request_id=message.request_id, new_token_ids=(), finish_reason="error",
                num_prompt_tokens=len(message.prompt_token_ids), error=str(exc)))

    # ------------------------------------------------------------- arrivals

    def _admit(self, message: TokenizedRequest) -> None:
        parent, last = message.parent_id, message.index == message.num_samples - 1
        if parent in self._refused:  # a later sample of a refused request
            if last:
                self._refused.discard(parent)
            return
        if message.index == 0:
            failed = refusal(self.queue, message, message.num_samples, self.drain,
                             time.monotonic())
            if failed is not None:
                self.log.info("request_rejected", request_id=parent,
                              status=failed.status, reason=failed.message)
                self.detokenizer.send(Deliver(parent, failed))
                if not last:
                    self._refused.add(parent)
                return
            self.detokenizer.send(Deliver(parent, RequestAccepted(parent,
                                                                  message.prompt_token_ids)))
        self.detokenizer.send(message)
        self.queue.add(Request(message.request_id, message.prompt_token_ids,
                               message.sampling_params, arrival_time=message.arrival_time,
                               priority=message.priority, eos_token_ids=self.eos_token_ids,
                               max_model_len=self.max_model_len))
        self._queued(message)
        self._release()

    def _queued(self, message: TokenizedRequest) -> None:
        self.stats.send(RequestQueued(message.request_id, message.parent_id,
                                      message.arrival_time, len(message.prompt_token_ids),
                                      message.priority, message.request_class,
                                      time.monotonic()))

    # ------------------------------------------------------------- releases

    def _on_capacity(self, report: CapacityReport) -> None:
        self.capacity = report.capacity
        for request_id in report.finished_ids:
            self.released.discard(request_id)
            self.abort_pending.pop(request_id, None)
        returned = []
        for request in report.returned:
            self.released.discard(request.request_id)
            reason = self.abort_pending.pop(request.request_id, None)
            if reason is None:
                returned.append(request)
            else:  # aborted while it travelled back
                self._finish_here(request, reason)
        self.queue.requeue(returned)
        self._release()

    def _release(self) -> None:
        """Send what the scheduler can start, when there is any, or the
        queue's length when it changed (the scheduler's gauges, and whether it
        reports its capacity)."""
        requests = self.queue.release(self.capacity)
        self.drain.record(time.monotonic(), len(requests),
                          sum(r.num_tokens - r.num_computed_tokens for r in requests))
        waiting = self.queue.num_waiting
        if not requests and waiting == self._sent_waiting:
            return
        self.released.update(r.request_id for r in requests)
        self._sent_waiting = waiting
        self.scheduler.send(ReleaseRequests(tuple(requests), waiting))

    # --------------------------------------------------------------- aborts

    def _abort(self, message: AbortRequest) -> None:
        """Finish queued requests here; forward the others to the scheduler."""
        forward, counts = [], []
        kept = dict(zip(message.request_ids, message.num_output_tokens))
        for request_id in message.request_ids:
            request = self.queue.remove(request_id)
            if request is not None:
                self._finish_here(request, message.reason)
            elif request_id in self.released:
                self.abort_pending[request_id] = message.reason
                forward.append(request_id)
                counts.append(kept.get(request_id))
        if forward:
            known = None not in counts
            self.scheduler.send(AbortRequest(tuple(forward), message.reason,
                                             tuple(counts) if known else ()))
        self._release()

    def _finish_here(self, request: Request, reason: str) -> None:
        """End a request that never left (or came back to) the queue."""
        request.status = (RequestStatus.FINISHED_STOPPED if reason == "stop"
                          else RequestStatus.FINISHED_ABORTED)
        update = RequestUpdate.of(request)
        if reason != "stop":  # a stop string: the detokenizer already ended the stream
            self.detokenizer.send(TokenDelta(
                request_id=request.request_id, new_token_ids=(),
                finish_reason=str(update.finish_reason),
                num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=max(request.num_cached_tokens, 0)))
        self.stats.send(RequestsUpdated(((update, reason != "stop"),), time.monotonic()))

