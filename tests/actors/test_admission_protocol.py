"""Issue 49 item 1: admission owns the waiting requests, the scheduler the
running ones, and nothing travels between them per step.

The real admission and scheduler actors run on one event loop with a worker
that samples token 7 for every request a step samples; every message
between the two actors is counted by step. In steady decode with nothing
waiting, no message crosses; a request waiting for a slot is released when
a finished request frees one, and no step ever waits for admission."""

from __future__ import annotations

import asyncio

from actor_support import Inbox

from kvserve.actors.admission import AdmissionActor
from kvserve.actors.messages import (CapacityReport, ExecuteStep, ReleaseRequests, StepResult,
                                     TokenizedRequest)
from kvserve.actors.scheduler import SchedulerActor
from kvserve.config import SchedulerConfig
from kvserve.core.admission_queue import AdmissionLimits, AdmissionQueue
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.scheduler import Scheduler
from kvserve.model.runner import ModelRunnerOutput

BS = 4


class Counted:
    """A mailbox that notes each message (with the steps run so far) and
    passes it on."""

    def __init__(self, inner, log: list, steps: list) -> None:
        self.inner, self.log, self.steps = inner, log, steps

    def send(self, message) -> None:
        self.log.append((len(self.steps), type(message).__name__, message))
        self.inner.send(message)


class Worker:
    """Answers each step on the next loop turn: token 7 for every request
    the step samples."""

    def __init__(self, steps: list) -> None:
        self.scheduler = None
        self.steps = steps

    def send(self, message) -> None:
        if not isinstance(message, ExecuteStep):
            return
        output = message.scheduler_output
        self.steps.append(output)
        sampled = {c.request_id: [7] for c in output.scheduled if c.sample}
        result = StepResult(output.step_id, output, ModelRunnerOutput(sampled=sampled), 0.0, 0.0)
        asyncio.get_running_loop().call_soon(self.scheduler.send, result)


def _request(rid: str, max_tokens: int) -> TokenizedRequest:
    return TokenizedRequest(rid, rid, 0, tuple(range(10, 16)),
                            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                            arrival_time=0.0)


async def _serve(requests, max_num_seqs: int, until_steps: int):
    steps, log = [], []
    worker = Worker(steps)
    sched_box, adm_box = SchedulerActor.mailbox(), AdmissionActor.mailbox()
    detok, stats = Inbox(), Inbox()
    core = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_num_seqs,
                                     max_model_len=128), KVCacheManager(64, BS), BS)
    queue = AdmissionQueue(AdmissionLimits(), block_size=BS, max_chunk_tokens=64)
    scheduler = SchedulerActor(core, worker, detok, Counted(adm_box, log, steps), stats,
                               inbox=sched_box)
    admission = AdmissionActor(Counted(sched_box, log, steps), detok, stats, queue,
                               inbox=adm_box)
    worker.scheduler = sched_box
    tasks = [admission.start(), scheduler.start()]
    for request in requests:
        admission.send(request)
    async with asyncio.timeout(60):  # a hang deadline, not a speed bound
        while len(steps) < until_steps and (core.has_unfinished_requests() or len(steps) < 1
                                            or queue.num_waiting):
            await asyncio.sleep(0)
    await scheduler.stop()
    await admission.stop()
    await asyncio.gather(*tasks)
    return steps, log


def test_steady_decode_sends_nothing_between_admission_and_scheduler():
    steps, log = asyncio.run(_serve([_request(f"r{i}", 40) for i in range(4)],
                                    max_num_seqs=4, until_steps=30))
    assert len(steps) == 30
    decoding = [i for i, s in enumerate(steps)
                if len(s.scheduled) == 4 and all(c.num_tokens == 1 for c in s.scheduled)]
    first = decoding[0]
    assert len(decoding) >= 25 and decoding == list(range(first, 30))  # steady decode
    crossed = [(step, kind) for step, kind, _ in log if step > first + 1]
    assert crossed == []  # no capacity report, no release, no answer awaited


def test_a_waiting_request_starts_when_a_slot_frees_and_no_step_waits():
    """Two slots, three requests: "c" waits in admission; the report that
    "a" finished (one-way) releases it, and it runs. No step waits on an
    answer: the scheduler launched the step after "a"'s last before admission
    had released "c"."""
    requests = [_request("a", 3), _request("b", 12), _request("c", 3)]
    steps, log = asyncio.run(_serve(requests, max_num_seqs=2, until_steps=40))
    ran = [{c.request_id for c in s.scheduled} for s in steps]
    assert "c" not in set().union(*ran[:3]) and any("c" in r for r in ran)
    reports = [(step, m) for step, kind, m in log if kind == "CapacityReport"]
    releases = [(step, m) for step, kind, m in log if kind == "ReleaseRequests" and m.requests]
    (c_released,) = [step for step, m in releases if [r.request_id for r in m.requests] == ["c"]]
    (a_finished,) = [step for step, m in reports if "a" in m.finished_ids]
    assert a_finished <= c_released
    assert all(isinstance(m, CapacityReport) and not m.returned for _, m in reports)
    assert all(isinstance(m, ReleaseRequests) for _, m in releases)
