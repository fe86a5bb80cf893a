"""Async scheduling in the core scheduler: step N+1 is scheduled before step
N's tokens come back. A request that stops a step early streams nothing
extra and frees its blocks; aborts, ``max_tokens`` and preemption with a step
in flight keep the accounting exact (the invariant in ``core.scheduler``)."""

from kvserve.core.request import RequestStatus

from test_core_scheduler import EOS, GEN, by_id, make_req, make_sched


def test_the_next_decode_is_scheduled_on_a_placeholder():
    sched = make_sched(block_size=4)
    sched.add_request(make_req("a", 6))
    first = sched.schedule()
    second = sched.schedule()  # before the first step's token is known
    (chunk,) = second.scheduled
    assert (chunk.start_position, chunk.num_tokens, chunk.sample) == (6, 1, True)
    request = sched.requests["a"]
    assert request.num_computed_tokens == 7 and request.num_output_placeholders == 2
    (update,) = sched.update_from_output(first, {"a": [GEN]})
    assert update.new_token_ids == (GEN,) and request.num_output_placeholders == 1
    (update,) = sched.update_from_output(second, {"a": [GEN + 1]})
    assert request.output_token_ids == [GEN, GEN + 1] and request.num_output_placeholders == 0


def test_a_request_that_stops_a_step_early_streams_nothing_extra_and_frees_its_blocks():
    sched = make_sched(num_blocks=8, block_size=4)
    manager = sched.kv_cache_manager
    sched.add_request(make_req("a", 6))
    first, second = sched.schedule(), sched.schedule()
    assert by_id(second)["a"].sample  # step N+1 holds "a" when it stops
    (update,) = sched.update_from_output(first, {"a": [EOS]})
    assert update.finish_reason is not None and update.new_token_ids == (EOS,)
    assert manager.num_free_blocks == manager.num_blocks and "a" not in sched.requests
    # The extra token of the step that was in flight is dropped, not emitted.
    assert sched.update_from_output(second, {"a": [GEN]}) == []
    assert manager.num_free_blocks == manager.num_blocks
    # The runner learns it is gone with the next step.
    assert "a" in sched.schedule().finished_request_ids
    manager.check_consistency()


def test_an_abort_while_two_steps_are_in_flight():
    sched = make_sched(num_blocks=8, block_size=4)
    manager = sched.kv_cache_manager
    sched.add_request(make_req("a", 6))
    sched.add_request(make_req("b", 5, first=100))
    first, second = sched.schedule(), sched.schedule()
    (aborted,) = sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert aborted.finish_reason is not None and aborted.new_token_ids == ()
    updates = sched.update_from_output(first, {"a": [GEN], "b": [GEN]})
    assert [u.request_id for u in updates] == ["b"]
    updates = sched.update_from_output(second, {"a": [GEN], "b": [GEN]})
    assert [u.request_id for u in updates] == ["b"]
    assert sched.requests["b"].output_token_ids == [GEN, GEN]
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert manager.num_free_blocks == manager.num_blocks
    manager.check_consistency()


def test_no_step_is_scheduled_past_max_tokens():
    sched = make_sched()
    sched.add_request(make_req("a", 6, max_tokens=1))
    first = sched.schedule()
    assert sched.schedule().is_empty  # its one token is already in flight
    (update,) = sched.update_from_output(first, {"a": [GEN]})
    assert update.finish_reason is not None and update.num_output_tokens == 1


def test_a_request_preempted_with_a_step_in_flight_keeps_that_token():
    """The token in flight was computed from the state before the
    preemption: it is the request's next token, and it is kept (dropping it
    would let a request that cannot grow loop forever)."""
    sched = make_sched(num_blocks=3, block_size=4, max_model_len=64)
    sched.add_request(make_req("a", 8))
    sched.add_request(make_req("b", 4, first=100))
    first = sched.schedule()  # "a" 2 blocks, "b" 1 block: the cache is full
    second = sched.schedule()  # "b" needs a 2nd block for its decode: "b" is preempted
    assert [p.request_id for p in second.preemptions] == ["b"]
    b = sched.requests["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_output_placeholders == 0
    updates = {u.request_id: u for u in sched.update_from_output(first, {"a": [GEN], "b": [7]})}
    assert updates["b"].new_token_ids == (7,) and b.output_token_ids == [7]
    assert b.status is RequestStatus.PREEMPTED  # waits, with its token, to be resumed
    sched.update_from_output(second, {"a": [GEN]})
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    third = sched.schedule()
    (resumed,) = third.new_requests
    assert resumed.request_id == "b" and resumed.output_token_ids == (7,)
    assert by_id(third)["b"].num_tokens == 5  # prompt + the kept token, recomputed


def test_a_preempted_request_that_stops_on_the_token_in_flight_finishes_from_the_queue():
    sched = make_sched(num_blocks=3, block_size=4, max_model_len=64)
    manager = sched.kv_cache_manager
    sched.add_request(make_req("a", 8))
    sched.add_request(make_req("b", 4, first=100))
    first = sched.schedule()
    second = sched.schedule()
    assert [p.request_id for p in second.preemptions] == ["b"]
    updates = {u.request_id: u for u in sched.update_from_output(first, {"a": [GEN], "b": [EOS]})}
    assert updates["b"].finish_reason is not None
    assert "b" not in sched.requests and not any(r.request_id == "b" for r in sched.staged)
    sched.update_from_output(second, {"a": [GEN]})
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert manager.num_free_blocks == manager.num_blocks
