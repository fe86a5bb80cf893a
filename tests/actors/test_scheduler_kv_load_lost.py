"""Issue 47 item 10, the scheduler actor's side: a step whose load from the
offload tier lost a block (``StepResult.kv_load_lost``) restarts its
requests from their prompts -- handed back to admission as preempted, no
error sent to their streams -- where any other failed step fails them."""

from __future__ import annotations

from itertools import takewhile

from structlog.testing import capture_logs

from kvserve.actors.messages import (CapacityReport, ExecuteStep, ReleaseRequests, StepResult,
                                     TokenDelta)
from kvserve.actors.scheduler import SchedulerActor
from kvserve.config import SchedulerConfig
from kvserve.core.block_hash import hash_request_blocks
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.scheduler import Scheduler

BS = 4


class Tier:
    """An offload tier holding the first blocks of one prompt (``ExternalKV``)."""

    def __init__(self, hashes) -> None:
        self.hashes = list(hashes)

    def lookup(self, block_hashes) -> int:
        return sum(1 for _ in takewhile(lambda pair: pair[0] == pair[1],
                                        zip(block_hashes, self.hashes)))


class Peer:
    """Stands in for an actor's mailbox: records what it is sent."""

    def __init__(self) -> None:
        self.received: list = []

    def send(self, message) -> None:
        self.received.append(message)


def _actor(prompt):
    manager = KVCacheManager(32, BS, external=Tier(hash_request_blocks(prompt[:8], BS)))
    core = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4,
                                     max_model_len=128), manager, BS)
    peers = [Peer() for _ in range(4)]  # worker, detokenizer, admission, stats
    actor = SchedulerActor(core, *peers)
    core.add_request(Request("r", prompt, SamplingParams(max_tokens=4), eos_token_ids=(2,)))
    actor._maybe_launch_step()
    (step, *_) = [m for m in peers[0].received if isinstance(m, ExecuteStep)]
    assert len(step.scheduler_output.kv_loads) == 2
    return actor, core, peers, step


def test_a_lost_load_hands_the_request_back_to_start_again():
    prompt = list(range(100, 112))
    actor, core, (_, detok, admission, _), step = _actor(prompt)
    with capture_logs() as logs:
        actor._on_step_result(StepResult(step.step_id, step.scheduler_output, None, 0.0, 0.0,
                                         "KVLoadLost: a KV block left the disk tier",
                                         kv_load_lost=True))
    assert not [m for m in detok.received if isinstance(m, TokenDelta) and m.finish_reason]
    (report,) = [m for m in admission.received if isinstance(m, CapacityReport) and m.returned]
    (request,) = report.returned
    assert (request.request_id, request.status) == ("r", RequestStatus.PREEMPTED)
    assert request.num_computed_tokens == 0 and request.num_preemptions == 1
    assert [(e["event"], e["reason"]) for e in logs if e["event"] == "request_preempted"] == [
        ("request_preempted", "kv_load_lost")]
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_usable_blocks


def test_any_other_failed_step_fails_its_requests():
    prompt = list(range(100, 112))
    actor, _, (_, detok, _, _), step = _actor(prompt)
    actor._on_step_result(StepResult(step.step_id, step.scheduler_output, None, 0.0, 0.0,
                                     "RuntimeError: boom"))
    (delta,) = [m for m in detok.received if isinstance(m, TokenDelta) and m.finish_reason]
    assert delta.request_id == "r" and delta.error == "RuntimeError: boom"


def _lose_the_cache(actor, step) -> None:
    actor._on_step_result(StepResult(step.step_id, step.scheduler_output, None, 0.0, 0.0,
                                     "KVCacheLost: pipeline stage [1] failed", kv_lost=True))


def test_a_lost_cache_restarts_every_running_request_until_it_keeps_failing():
    """Issue 47 item 8: a pipeline stage that restarted took the K/V of every
    running request; they start again (reason ``kv_cache_lost``) instead of
    ending with a 500, and a request whose K/V is lost at every try fails
    after ``MAX_KV_RESTARTS`` restarts with the error."""
    from kvserve.actors.scheduler import MAX_KV_RESTARTS

    prompt = list(range(100, 112))
    actor, core, (worker, detok, admission, _), step = _actor(prompt)
    for restart in range(MAX_KV_RESTARTS + 1):
        with capture_logs() as logs:
            _lose_the_cache(actor, step)
        finished = [m for m in detok.received if isinstance(m, TokenDelta) and m.finish_reason]
        if restart < MAX_KV_RESTARTS:
            assert not finished
            (report,) = [m for m in admission.received[-1:] if m.returned]
            assert [r.request_id for r in report.returned] == ["r"]
            assert [e["reason"] for e in logs if e["event"] == "request_preempted"] == [
                "kv_cache_lost"]
            actor._on_release(ReleaseRequests(report.returned, 0))  # admission's
            actor._in_flight.clear()  # the step behind it: void, and not waited for here
            worker.received.clear()
            actor._maybe_launch_step()
            step = worker.received[0]
        else:
            (delta,) = finished
            assert delta.request_id == "r" and delta.error.startswith("KVCacheLost")
            assert f"lost {MAX_KV_RESTARTS + 1} times" in delta.error
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_usable_blocks
