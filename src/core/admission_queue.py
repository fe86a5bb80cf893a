"""The admission queue: every waiting request, its order, its limits, and
what to release to the scheduler.

Pure logic (no asyncio), driven by ``kvserve.actors.admission``. The queue
holds new requests and those the scheduler handed back (preempted, or
released but not admitted in time); they keep their arrival time, so fcfs
and priority order (with aging, ``request_queue.priority_key``) treat them
as vLLM's scheduler treats its waiting queue. The scheduler reports its
capacity (``SchedulerCapacity``) and the queue releases what it can start:
free sequence slots, and KV blocks for each request's first chunk. Under
``priority`` it also releases a request better than the worst running one
when nothing fits, so the scheduler can preempt for it.

Costs: ``add``/``requeue``/``release`` per request O(1) (fcfs) or O(log n)
(priority); ``remove`` by id O(1) (lazy); counts O(1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .kv_cache_manager import cdiv
from .request import Request
from .request_queue import create_queue, priority_key


@dataclass(frozen=True)
class SchedulerCapacity:
    """What the scheduler can start now (scheduler -> admission).

    - ``free_seqs``: sequence slots (``max_num_seqs`` - running - waiting in
      the scheduler).
    - ``free_blocks``: KV blocks free or evictable.
    - ``num_running``: requests holding KV blocks.
    - ``worst_running``: ``priority_key`` of the running request a priority
      preemption would evict (None when nothing runs, or under fcfs).
    - ``released_seen``: how many released requests the scheduler has
      received so far (the rest are in transit).
    """

    free_seqs: int
    free_blocks: int
    num_running: int = 0
    worst_running: tuple[float, float] | None = None
    released_seen: int = 0


@dataclass(frozen=True)
class AdmissionLimits:
    """Bounds of the waiting queue (None = unbounded) and the policy.

    ``max_waiting_requests``: waiting sequences (each of ``n`` samples counts).
    ``max_waiting_tokens``: tokens the waiting sequences still need to compute
    (prompt tokens, plus generated ones of preempted requests).
    ``retry_after``: seconds suggested to a refused client (``Retry-After``)
    until the queue's drain rate is measured (``kvserve.core.drain_rate``).
    """

    policy: str = "fcfs"
    max_waiting_requests: int | None = None
    max_waiting_tokens: int | None = None
    retry_after: float = 1.0
    priority_aging_seconds: float | None = None


class AdmissionQueue:
    """The waiting requests, in policy order, and the release decision.

    Args:
        limits: policy, aging and waiting limits.
        block_size: tokens per KV block.
        max_chunk_tokens: the most tokens a request computes in its first
            step (the scheduler's ``max_num_batched_tokens``), for the
            blocks its admission needs.

    Raises ``ValueError`` for an unknown policy and when a queued id is
    added again.
    """

    def __init__(self, limits: AdmissionLimits, block_size: int, max_chunk_tokens: int) -> None:
        self.limits = limits
        self.block_size = block_size
        self.max_chunk_tokens = max_chunk_tokens
        self.queue = create_queue(limits.policy, limits.priority_aging_seconds)
        self.num_released = 0  # requests released so far (cumulative)

    @property
    def num_waiting(self) -> int:
        """Requests queued."""
        return len(self.queue)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens the queued requests still have to compute."""
        return self.queue.num_tokens

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.queue

    def never_admissible(self, num_seqs: int, num_tokens: int) -> tuple[str, str | None] | None:
        """Why ``num_seqs`` sequences of ``num_tokens`` tokens each could not
        join even an empty queue, as ``(message, param)``, or None: such a
        request must get a 400 naming the limit, not a 429 whose retry can
        never succeed."""
        limits = self.limits
        if limits.max_waiting_requests is not None and num_seqs > limits.max_waiting_requests:
            return (f"n = {num_seqs} samples can never wait together under "
                    f"--max-waiting-requests {limits.max_waiting_requests}", "n")
        if limits.max_waiting_tokens is not None and \
                num_seqs * num_tokens > limits.max_waiting_tokens:
            return (f"{num_seqs} x {num_tokens} prompt tokens can never wait under "
                    f"--max-waiting-tokens {limits.max_waiting_tokens}", None)
        return None

    def refusal(self, num_seqs: int, num_tokens: int) -> str | None:
        """Why ``num_seqs`` sequences of ``num_tokens`` tokens each may not
        join the queue now (the flag that bounds it, in a message), or None."""
        limits = self.limits
        waiting, tokens = self.num_waiting, self.num_waiting_tokens
        if limits.max_waiting_requests is not None and \
                waiting + num_seqs > limits.max_waiting_requests:
            return (f"{waiting} requests are waiting "
                    f"(--max-waiting-requests {limits.max_waiting_requests})")
        if limits.max_waiting_tokens is not None and \
                tokens + num_seqs * num_tokens > limits.max_waiting_tokens:
            return (f"{tokens} prompt tokens are waiting "
                    f"(--max-waiting-tokens {limits.max_waiting_tokens})")
        return None

    def overflow(self, num_seqs: int, num_tokens: int) -> tuple[int, int]:
        """How many waiting sequences, and waiting tokens, must leave before
        ``num_seqs`` sequences of ``num_tokens`` tokens each fit the limits
        ((0, 0) when they fit now)."""
        limits = self.limits
        sequences = tokens = 0
        if limits.max_waiting_requests is not None:
            sequences = max(0, self.num_waiting + num_seqs - limits.max_waiting_requests)
        if limits.max_waiting_tokens is not None:
            tokens = max(0, self.num_waiting_tokens + num_seqs * num_tokens
                         - limits.max_waiting_tokens)
        return sequences, tokens

    def add(self, request: Request) -> None:
        """Queue a new request."""
        self.queue.add(request)

    def requeue(self, requests: Sequence[Request]) -> None:
        """Take back requests the scheduler returned, given in its service
        order: they go ahead of every other of their priority, in that order
        (their arrival times are unchanged)."""
        for request in reversed(requests):
            self.queue.prepend(request)

    def remove(self, request_id: str) -> Request | None:
        """Take a queued request out (an abort); None if it is not queued."""
        removed = self.queue.remove((request_id,))
        return removed[0] if removed else None

    def release(self, capacity: SchedulerCapacity) -> list[Request]:
        """Pop the requests the scheduler can start, in queue order.

        Each needs a free sequence slot and the KV blocks of its first chunk
        (a prefix-cache hit may need fewer: the scheduler decides). When
        nothing runs and nothing is in transit, the head goes regardless
        (an empty engine must never wait on an estimate). Under ``priority``,
        when nothing else goes, a head that is better than the worst running
        request goes too, so the scheduler can preempt for it.
        """
        in_transit = self.num_released - capacity.released_seen
        slots, blocks = capacity.free_seqs - in_transit, capacity.free_blocks
        idle = capacity.num_running == 0 and in_transit == 0
        out: list[Request] = []
        while self.queue and slots > 0:
            need = self._first_chunk_blocks(self.queue.peek())
            if need > blocks and not (idle and not out):
                break
            out.append(self.queue.pop())
            slots, blocks = slots - 1, blocks - need
        if not out and in_transit == 0 and self._outranks_running(capacity):
            out.append(self.queue.pop())
        self.num_released += len(out)
        return out

    def _first_chunk_blocks(self, request: Request) -> int:
        return cdiv(min(request.num_tokens, self.max_chunk_tokens), self.block_size)

    def _outranks_running(self, capacity: SchedulerCapacity) -> bool:
        if self.limits.policy != "priority" or capacity.worst_running is None or not self.queue:
            return False
        head = priority_key(self.queue.peek(), self.limits.priority_aging_seconds)
        return head < capacity.worst_running
