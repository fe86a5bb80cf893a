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


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_lazy_removal_counts_and_compaction(policy):
    """Removed requests never come out again, counters follow every change,
    and dead entries are dropped once they outnumber the live ones."""
    queue = create_queue(policy)
    requests = [Request(f"r{i}", [1] * (i + 1), arrival_time=float(i)) for i in range(100)]
    for r in requests:
        queue.add(r)
    assert len(queue) == 100 and queue.num_tokens == sum(range(1, 101))
    gone = [f"r{i}" for i in range(0, 100, 2)] + ["unknown", "r0"]
    assert len(queue.remove(gone)) == 50
    assert len(queue) == 50 and queue.num_tokens == sum(range(2, 101, 2))
    assert "r0" not in queue and "r1" in queue
    queue.remove([f"r{i}" for i in range(1, 60, 2)])  # 80 dead > 20 live: rebuilt
    structure = queue._queue if policy == "fcfs" else queue._heap
    assert len(structure) == 20 and queue._num_dead == 0
    assert ids(queue) == [f"r{i}" for i in range(61, 100, 2)]
    assert [queue.pop().request_id for _ in range(20)] == [f"r{i}" for i in range(61, 100, 2)]
    assert not queue and queue.num_tokens == 0


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_requeue_after_removal_is_one_entry(policy):
    """A request removed and queued again is served once, from its new place."""
    queue = create_queue(policy)
    a, b = req("a", arrival=1.0), req("b", arrival=2.0)
    queue.add(a)
    queue.add(b)
    queue.remove(["a"])
    queue.prepend(a)
    assert ids(queue) == ["a", "b"]
    assert [queue.pop().request_id for _ in range(2)] == ["a", "b"]
    with pytest.raises(IndexError):
        queue.peek()
    queue.add(a)
    with pytest.raises(ValueError, match="already queued"):
        queue.add(a)
