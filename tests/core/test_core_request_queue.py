"""FCFS and priority waiting queues."""

import pytest

from kvserve.core.request import Request
from kvserve.core.request_queue import FCFSQueue, PriorityQueue, create_queue


def req(rid, priority=0, arrival=0.0):
    return Request(rid, [1], arrival_time=arrival, priority=priority)


def ids(queue):
    return [r.request_id for r in queue]


def test_fcfs_order_prepend_remove():
    queue = create_queue("fcfs")
    assert isinstance(queue, FCFSQueue) and not queue
    for rid in "abc":
        queue.add(req(rid))
    queue.prepend(req("p"))
    assert ids(queue) == ["p", "a", "b", "c"] and len(queue) == 4
    assert [r.request_id for r in queue.remove(["a", "zz"])] == ["a"]
    assert queue.peek().request_id == "p"
    assert [queue.pop().request_id for _ in range(3)] == ["p", "b", "c"]
    with pytest.raises(IndexError):
        queue.pop()


def test_priority_order():
    queue = create_queue("priority")
    assert isinstance(queue, PriorityQueue)
    queue.add(req("late_hi", priority=0, arrival=5.0))
    queue.add(req("low", priority=3, arrival=0.0))
    queue.add(req("early_hi", priority=0, arrival=1.0))
    queue.add(req("neg", priority=-1, arrival=9.0))
    assert ids(queue) == ["neg", "early_hi", "late_hi", "low"]
    # a preempted request keeps its arrival: it goes ahead of later arrivals
    queue.prepend(req("preempted", priority=0, arrival=2.0))
    assert ids(queue) == ["neg", "early_hi", "preempted", "late_hi", "low"]
    queue.remove(["early_hi"])
    assert [queue.pop().request_id for _ in range(len(queue))] == ["neg", "preempted", "late_hi",
                                                                   "low"]


def test_priority_ties_keep_insertion_order():
    queue = PriorityQueue()
    for rid in "xyz":
        queue.add(req(rid))
    assert ids(queue) == ["x", "y", "z"] and queue.peek().request_id == "x"


def test_unknown_policy():
    with pytest.raises(ValueError, match="policy"):
        create_queue("lifo")
