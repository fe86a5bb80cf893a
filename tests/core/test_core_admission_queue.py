"""The admission queue: order (fcfs, priority, aging), the waiting limits,
requests handed back keeping their place, and the release rule against the
scheduler's reported capacity."""

import pytest

from kvserve.core.admission_queue import AdmissionLimits, AdmissionQueue, SchedulerCapacity
from kvserve.core.request import Request, RequestStatus
from kvserve.core.request_queue import priority_key

BS = 4


def make_queue(policy="fcfs", chunk=64, **limits):
    return AdmissionQueue(AdmissionLimits(policy=policy, **limits), BS, chunk)


def req(rid, num_tokens=4, priority=0, arrival=0.0):
    return Request(rid, list(range(num_tokens)), priority=priority, arrival_time=arrival)


def room(seqs=64, blocks=1000, running=1, worst=None, seen=None, queue=None):
    return SchedulerCapacity(free_seqs=seqs, free_blocks=blocks, num_running=running,
                             worst_running=worst,
                             released_seen=queue.num_released if queue else (seen or 0))


def ids(requests):
    return [r.request_id for r in requests]


def test_fcfs_releases_in_arrival_order_as_slots_allow():
    queue = make_queue()
    for i, rid in enumerate("abcd"):
        queue.add(req(rid, arrival=float(i)))
    assert ids(queue.release(room(seqs=2, queue=queue))) == ["a", "b"]
    assert ids(queue.release(room(seqs=0, queue=queue))) == []
    assert ids(queue.release(room(seqs=5, queue=queue))) == ["c", "d"]
    assert queue.num_waiting == 0 and queue.num_waiting_tokens == 0


def test_priority_order_then_arrival():
    queue = make_queue("priority")
    queue.add(req("low-early", priority=2, arrival=0.0))
    queue.add(req("high-late", priority=0, arrival=5.0))
    queue.add(req("low-late", priority=2, arrival=1.0))
    queue.add(req("mid", priority=1, arrival=9.0))
    assert ids(queue.release(room(queue=queue))) == ["high-late", "mid", "low-early", "low-late"]


def test_aging_lets_an_old_low_priority_request_pass_new_high_ones():
    """With aging every 10 s, priority 5 that arrived at t=0 ranks as 5 + 0 =
    5; priority 0 arriving at t=60 ranks as 0 + 6 = 6: the old one goes first."""
    queue = make_queue("priority", priority_aging_seconds=10.0)
    queue.add(req("new-high", priority=0, arrival=60.0))
    queue.add(req("old-low", priority=5, arrival=0.0))
    queue.add(req("newer-high", priority=0, arrival=40.0))
    assert ids(queue.release(room(queue=queue))) == ["newer-high", "old-low", "new-high"]


def test_waiting_limits_name_their_flag_and_count_incrementally():
    queue = make_queue(max_waiting_requests=3, max_waiting_tokens=20)
    queue.add(req("a", 8))
    queue.add(req("b", 8))
    assert queue.num_waiting == 2 and queue.num_waiting_tokens == 16
    assert queue.refusal(1, 4) is None
    assert "--max-waiting-tokens 20" in queue.refusal(1, 5)
    assert "--max-waiting-requests 3" in queue.refusal(2, 1)  # n=2 samples
    queue.remove("a")
    assert queue.num_waiting == 1 and queue.num_waiting_tokens == 8
    assert queue.refusal(2, 6) is None
    queue.release(room(queue=queue))
    assert queue.num_waiting == 0 and queue.refusal(3, 6) is None


def test_a_request_over_a_limit_on_its_own_is_never_admissible():
    """Issue 14, item 4: n = 2 under --max-waiting-requests 1, or a 200-token
    prompt under --max-waiting-tokens 100, got 429 + Retry-After forever on
    an idle server; the queue now tells them apart (the actor answers 400)."""
    queue = make_queue(max_waiting_requests=1, max_waiting_tokens=100)
    message, param = queue.never_admissible(2, 4)
    assert "--max-waiting-requests 1" in message and param == "n"
    message, param = queue.never_admissible(1, 200)
    assert "--max-waiting-tokens 100" in message and param is None
    tokens_only = make_queue(max_waiting_tokens=100)
    assert "--max-waiting-tokens 100" in tokens_only.never_admissible(2, 60)[0]  # 2 x 60 > 100
    assert queue.never_admissible(1, 100) is None  # fits an empty queue: 429 when full
    queue.add(req("a", 8))
    assert queue.never_admissible(1, 100) is None and queue.refusal(1, 100) is not None
    assert make_queue().never_admissible(16, 10**6) is None  # no limits


def test_requests_handed_back_keep_their_place():
    """fcfs: returned requests (a preempted one, then one released but not
    admitted) go back to the front in the scheduler's order; priority: a
    returned request keeps its arrival time among its priority."""
    queue = make_queue()
    queue.add(req("later", arrival=9.0))
    preempted, unadmitted = req("p", arrival=1.0), req("u", arrival=2.0)
    preempted.status = RequestStatus.PREEMPTED
    queue.requeue([preempted, unadmitted])
    assert ids(queue.release(room(queue=queue))) == ["p", "u", "later"]

    queue = make_queue("priority")
    queue.add(req("same-later", priority=1, arrival=9.0))
    queue.add(req("better", priority=0, arrival=10.0))
    queue.requeue([req("back", priority=1, arrival=1.0)])
    assert ids(queue.release(room(queue=queue))) == ["better", "back", "same-later"]


def test_release_stops_at_the_kv_blocks_of_each_first_chunk():
    queue = make_queue(chunk=8)  # a first chunk is at most 8 tokens = 2 blocks
    queue.add(req("a", 6))   # 2 blocks
    queue.add(req("b", 40))  # 2 blocks (its first chunk only)
    queue.add(req("c", 3))   # 1 block
    assert ids(queue.release(room(blocks=3, queue=queue))) == ["a"]
    assert ids(queue.release(room(blocks=4, queue=queue))) == ["b", "c"]


def test_an_idle_scheduler_gets_the_head_whatever_the_estimate():
    queue = make_queue()
    queue.add(req("big", 400))
    queue.add(req("next", 4))
    assert ids(queue.release(room(blocks=2, running=1, queue=queue))) == []
    assert ids(queue.release(room(blocks=2, running=0, queue=queue))) == ["big"]


def test_requests_in_transit_take_slots_until_the_scheduler_saw_them():
    queue = make_queue()
    for rid in "abc":
        queue.add(req(rid))
    report = room(seqs=2, seen=0)
    assert ids(queue.release(report)) == ["a", "b"]
    assert ids(queue.release(report)) == []  # same stale report: a and b are in transit
    assert ids(queue.release(room(seqs=1, seen=2))) == ["c"]


def test_priority_head_better_than_the_worst_running_goes_to_preempt():
    queue = make_queue("priority")
    queue.add(req("urgent", priority=0, arrival=5.0))
    worse = priority_key(req("x", priority=3, arrival=0.0))
    same = priority_key(req("x", priority=0, arrival=1.0))
    assert ids(queue.release(room(seqs=0, blocks=0, worst=same, queue=queue))) == []
    assert ids(queue.release(room(seqs=0, blocks=0, worst=worse, queue=queue))) == ["urgent"]


def test_fcfs_never_releases_to_preempt():
    queue = make_queue()
    queue.add(req("a"))
    assert queue.release(room(seqs=0, worst=(99.0, 99.0), queue=queue)) == []


def test_remove_is_by_id_and_ignores_unknown_ids():
    queue = make_queue()
    queue.add(req("a"))
    assert queue.remove("nope") is None
    assert queue.remove("a").request_id == "a" and "a" not in queue
    with pytest.raises(IndexError):
        queue.queue.peek()
