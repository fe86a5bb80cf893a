"""Waiting queues of the scheduler: first-come-first-served and priority.

After vLLM v1's ``request_queue.py``: under ``priority`` the lower
``priority`` value is served first, ties broken by arrival time (earlier
first) and then by insertion order. Preempted requests keep their original
arrival time, so they go back ahead of later arrivals of the same priority.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from .request import Request


class RequestQueue(ABC):
    """Ordered collection of waiting requests (by the policy of the subclass)."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a new request."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Re-queue a preempted request at the front of its priority level."""

    @abstractmethod
    def peek(self) -> Request:
        """The next request, without removing it; ``IndexError`` when empty."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return the next request; ``IndexError`` when empty."""

    @abstractmethod
    def remove(self, request_ids: Iterable[str]) -> list[Request]:
        """Remove the requests with these ids; returns those that were queued."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in service order."""

    def __bool__(self) -> bool:
        return len(self) > 0

    def readd(self, request: Request) -> None:
        """Alias of ``prepend`` (vLLM's name)."""
        self.prepend(request)


class FCFSQueue(RequestQueue):
    """First come, first served; preempted requests go to the very front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty queue")
        return self._queue[0]

    def pop(self) -> Request:
        if not self._queue:
            raise IndexError("pop from an empty queue")
        return self._queue.popleft()

    def remove(self, request_ids: Iterable[str]) -> list[Request]:
        ids = set(request_ids)
        removed = [r for r in self._queue if r.request_id in ids]
        if removed:
            self._queue = deque(r for r in self._queue if r.request_id not in ids)
        return removed

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._queue))


def priority_key(request: Request, aging_seconds: float | None = None) -> tuple[float, float]:
    """Service order under ``priority``: lower first.

    Without aging: ``(priority, arrival_time)``. With aging every ``S``
    seconds, a request's effective priority at time t is
    ``priority - (t - arrival_time) / S`` (one level better per S seconds
    waited). Every request ages at the same rate, so ordering by it at any t
    equals ordering by the time-free key ``priority + arrival_time / S``,
    which a heap can keep.
    """
    if aging_seconds:
        return (request.priority + request.arrival_time / aging_seconds, request.arrival_time)
    return (request.priority, request.arrival_time)


class PriorityQueue(RequestQueue):
    """Heap ordered by ``priority_key`` then insertion number; lower first."""

    def __init__(self, aging_seconds: float | None = None) -> None:
        self.aging_seconds = aging_seconds
        self._heap: list[tuple[float, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        entry = (*priority_key(request, self.aging_seconds), next(self._counter), request)
        heapq.heappush(self._heap, entry)

    def prepend(self, request: Request) -> None:
        # Keeping the original arrival time puts it ahead of later arrivals.
        self.add(request)

    def peek(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][3]

    def pop(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)[3]

    def remove(self, request_ids: Iterable[str]) -> list[Request]:
        ids = set(request_ids)
        removed = [e[3] for e in self._heap if e[3].request_id in ids]
        if removed:
            self._heap = [e for e in self._heap if e[3].request_id not in ids]
            heapq.heapify(self._heap)
        return removed

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter([entry[3] for entry in sorted(self._heap, key=lambda e: e[:3])])


def create_queue(policy: str, aging_seconds: float | None = None) -> RequestQueue:
    """A queue for ``policy`` (``"fcfs"`` or ``"priority"``, the latter with
    optional aging); ``ValueError`` otherwise."""
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue(aging_seconds)
    raise ValueError(f"scheduling policy must be fcfs or priority, got {policy!r}")
