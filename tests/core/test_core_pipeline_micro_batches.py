"""Pipeline micro-batches in the core scheduler (``pipeline_parallel_size``
2): a request whose sampled token is in flight is left out of the next
step (the stages need its id), a step takes at most half of the decoding
requests, and a prompt's next chunk may follow the one in flight (every
stage computes steps in order)."""

from dataclasses import replace

from test_core_scheduler import GEN, make_req, make_sched


def pipelined(**kwargs):
    sched = make_sched(**kwargs)
    sched.config = replace(sched.config, pipeline_parallel_size=2)
    return sched


def ids(output) -> list[str]:
    return [c.request_id for c in output.scheduled]


def test_decodes_alternate_between_two_disjoint_micro_batches():
    sched = pipelined(block_size=4)
    for i in range(5):
        sched.add_request(make_req(f"r{i}", 3, first=10 * i))
    prompts = sched.schedule()
    assert ids(prompts) == ["r0", "r1", "r2", "r3", "r4"]
    assert sched.schedule().is_empty  # every request's first token is in flight
    sched.update_from_output(prompts, {f"r{i}": [GEN] for i in range(5)})
    a = sched.schedule()
    b = sched.schedule()  # before a's tokens are back
    assert ids(a) == ["r0", "r1", "r2"] and ids(b) == ["r3", "r4"]  # ceil(5 / 2), then the rest
    assert sched.schedule().is_empty
    sched.update_from_output(a, {rid: [GEN] for rid in ids(a)})
    c = sched.schedule()
    assert ids(c) == ["r0", "r1", "r2"]  # a's requests again, b's still in flight
    sched.update_from_output(b, {rid: [GEN] for rid in ids(b)})
    assert ids(sched.schedule()) == ["r3", "r4"]
    sched.kv_cache_manager.check_consistency()


def test_one_decoding_request_runs_one_step_at_a_time():
    sched = pipelined(block_size=4)
    sched.add_request(make_req("a", 6))
    first = sched.schedule()
    assert sched.schedule().is_empty  # async scheduling alone would schedule a placeholder
    sched.update_from_output(first, {"a": [GEN]})
    (chunk,) = sched.schedule().scheduled
    assert (chunk.start_position, chunk.num_tokens) == (6, 1)


def test_a_prompts_next_chunk_follows_the_chunk_in_flight():
    sched = pipelined(block_size=4, budget=8)
    sched.add_request(make_req("long", 20))
    first, second = sched.schedule(), sched.schedule()
    assert [(c.start_position, c.num_tokens, c.sample) for c in first.scheduled] == [(0, 8, False)]
    assert [(c.start_position, c.num_tokens, c.sample) for c in second.scheduled] == [(8, 8, False)]
