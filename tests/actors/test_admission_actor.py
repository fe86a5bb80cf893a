"""The admission actor moves messages only: it queues, refuses, releases on
capacity reports, takes back requests, and finds an aborted request wherever
it is (queued, released, or travelling back from the scheduler)."""

import asyncio

from actor_support import Inbox

from kvserve.actors.admission import AdmissionActor
from kvserve.actors.messages import (AbortRequest, CapacityReport, Deliver, ReleaseRequests,
                                     RequestAccepted, RequestFailed, RequestQueued, TokenDelta,
                                     TokenizedRequest)
from kvserve.core.admission_queue import AdmissionLimits, AdmissionQueue, SchedulerCapacity
from kvserve.core.sampling_params import SamplingParams


def make_actor(**limits):
    scheduler, detokenizer, stats = Inbox(), Inbox(), Inbox()
    queue = AdmissionQueue(AdmissionLimits(**limits), block_size=4, max_chunk_tokens=64)
    actor = AdmissionActor(scheduler, detokenizer, stats, queue, eos_token_ids=(2,))
    return actor, stats, scheduler, detokenizer


def arrive(actor, detokenizer, rid, num_tokens=4, priority=0):
    """``rid`` reaches admission; the answer its client gets (acceptance or
    refusal), as delivered to the detokenizer."""
    handle(actor, TokenizedRequest(rid, rid, 0, tuple(range(num_tokens)),
                                   SamplingParams(max_tokens=4), arrival_time=0.0,
                                   priority=priority))
    (answer,) = [m.event for m in detokenizer.take(Deliver) if m.request_id == rid]
    return answer


def handle(actor, message):
    asyncio.run(actor.handle(message))


def report(free_seqs, released_seen, returned=(), finished=(), running=1):
    capacity = SchedulerCapacity(free_seqs=free_seqs, free_blocks=100, num_running=running,
                                 released_seen=released_seen)
    return CapacityReport(capacity, tuple(returned), tuple(finished))


def released(scheduler):
    return [r.request_id for m in scheduler.take(ReleaseRequests) for r in m.requests]


def test_queues_then_releases_on_capacity_and_never_answers_a_report():
    """Issue 49 item 1: a report with no room gets no message back (the
    scheduler does not wait on admission); room releases what fits."""
    actor, stats, scheduler, detokenizer = make_actor()
    handle(actor, report(free_seqs=1, released_seen=0))
    assert isinstance(arrive(actor, detokenizer, "a"), RequestAccepted)
    assert [m.request_id for m in stats.take(RequestQueued)] == ["a"]
    arrive(actor, detokenizer, "b")
    assert released(scheduler) == ["a"]  # one slot
    handle(actor, report(free_seqs=0, released_seen=1))
    assert scheduler.take(ReleaseRequests) == []
    handle(actor, report(free_seqs=1, released_seen=1, finished=["a"]))
    assert released(scheduler) == ["b"] and actor.released == {"b"}


def test_refusals_are_4xx_and_queue_nothing():
    actor, stats, scheduler, detokenizer = make_actor(max_waiting_requests=1)
    handle(actor, report(free_seqs=0, released_seen=0))
    arrive(actor, detokenizer, "a")
    failed = arrive(actor, detokenizer, "b")
    assert isinstance(failed, RequestFailed) and failed.status == 429
    assert "--max-waiting-requests 1" in failed.message
    failed = arrive(actor, detokenizer, "c", priority=3)  # fcfs
    assert failed.status == 400 and failed.param == "priority"
    assert actor.queue.num_waiting == 1
    assert [m.request_id for m in stats.take(RequestQueued)] == ["a"]


def test_a_returned_request_goes_ahead_of_later_arrivals():
    actor, _, scheduler, detokenizer = make_actor()
    handle(actor, report(free_seqs=1, released_seen=0))
    arrive(actor, detokenizer, "first")
    (first,) = scheduler.take(ReleaseRequests)[0].requests
    arrive(actor, detokenizer, "second")
    handle(actor, report(free_seqs=0, released_seen=1, returned=[first]))  # e.g. preempted
    handle(actor, report(free_seqs=2, released_seen=1))
    assert released(scheduler) == ["first", "second"]


def test_abort_of_a_queued_request_ends_it_here():
    actor, _, scheduler, detokenizer = make_actor()
    handle(actor, report(free_seqs=0, released_seen=0))
    arrive(actor, detokenizer, "a")
    handle(actor, AbortRequest(("a",)))
    (delta,) = detokenizer.take(TokenDelta)
    assert delta.request_id == "a" and delta.finish_reason == "abort"
    assert actor.queue.num_waiting == 0 and not scheduler.take(AbortRequest)
    assert scheduler.take(ReleaseRequests)[-1].num_waiting == 0  # the gauge hears of it


def test_abort_of_a_released_request_goes_to_the_scheduler():
    actor, _, scheduler, detokenizer = make_actor()
    handle(actor, report(free_seqs=1, released_seen=0))
    arrive(actor, detokenizer, "a")
    handle(actor, AbortRequest(("a", "unknown")))
    (forwarded,) = scheduler.take(AbortRequest)
    assert forwarded.request_ids == ("a",)
    handle(actor, report(free_seqs=1, released_seen=1, finished=["a"]))
    assert not actor.released and not actor.abort_pending


def test_abort_that_crosses_a_request_travelling_back_still_ends_it():
    """The scheduler handed "a" back just as its abort reached admission:
    admission forwards the abort (the scheduler no longer has it), and ends
    "a" itself when it arrives, instead of queueing it again."""
    actor, _, scheduler, detokenizer = make_actor()
    handle(actor, report(free_seqs=1, released_seen=0))
    arrive(actor, detokenizer, "a")
    (a,) = scheduler.take(ReleaseRequests)[0].requests
    handle(actor, AbortRequest(("a",)))
    assert scheduler.take(AbortRequest)
    handle(actor, report(free_seqs=1, released_seen=1, returned=[a]))
    (delta,) = detokenizer.take(TokenDelta)
    assert delta.request_id == "a" and delta.finish_reason == "abort"
    assert actor.queue.num_waiting == 0 and released(scheduler) == []
