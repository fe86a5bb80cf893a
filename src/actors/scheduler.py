"""SchedulerActor: the async shell around ``core.Scheduler``; up to two steps in flight."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvserve.actors.base import Actor, Mailbox
from kvserve.actors.messages import (
    AbortRequest,
    AdoptBlocks,
    AttachTier,
    CapacityReport,
    DropImports,
    ExecuteStep,
    HealthQuery,
    LoadReport,
    ReleaseRequests,
    RequestsUpdated,
    StallReport,
    StepFinished,
    StepResult,
    StepScheduled,
    TokenDelta,
)
from kvserve.core.admission_queue import SchedulerCapacity
from kvserve.core.outputs import PrefixCacheDivergence, RequestUpdate, SchedulerOutput
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler
from kvserve.core.stall import EngineHealth, StallWatch
from kvserve.core.stats import StepTimes
from kvserve.core.step_budget import StepBudget

#: Times one request may start again because its K/V were lost (a pipeline
#: stage restarted, an offload-tier block vanished) before it fails instead.
MAX_KV_RESTARTS = 3


@dataclass(frozen=True)
class _InFlight:
    """A step sent to the worker and not returned yet."""

    output: SchedulerOutput
    schedule_seconds: float


class SchedulerActor(Actor):
    """Feeds the worker steps and reports token deltas.

    Its inbox takes ``ReleaseRequests`` (requests admission lets start),
    ``AbortRequest`` (finish early) and ``StepResult`` (the worker finished a
    step). The waiting queue is admission's and the running requests are
    this actor's core's; nothing travels between them per step: released
    requests stay staged here until a step admits them, a preempted request
    goes back in a ``CapacityReport`` after the step's results, and the
    capacity goes to admission only when it could change what admission
    releases (it has requests waiting, or released ones finished). No step
    ever waits on admission. After draining the inbox it schedules steps
    while fewer than
    ``SchedulerConfig.max_steps_in_flight`` are in flight and work remains:
    the batch is rebuilt every step (iteration-level scheduling, Yu et al.,
    Orca, OSDI 2022). With async scheduling (two in flight) the worker finds
    step N+1 waiting when step N ends, so scheduling, emitting and
    detokenizing overlap the forward pass; the core scheduler's docstring
    states the invariant that keeps this exact.
    """

    name = "scheduler"
    accepts = (ReleaseRequests, AbortRequest, StepResult, AdoptBlocks, HealthQuery, AttachTier)

    def __init__(self, scheduler: Scheduler, worker: Mailbox, detokenizer: Mailbox,
                 admission: Mailbox, stats: Mailbox, stall_timeout: float = 60.0,
                 on_kv_export: Callable[[str, Any], None] | None = None,
                 attach_tier: Callable[[str], Any] | None = None,
                 inbox: Mailbox | None = None) -> None:
        super().__init__(inbox)
        self.core = scheduler
        self.worker = worker
        self.detokenizer = detokenizer
        self.admission = admission
        self.stats = stats
        #: Progress while there is work (``HealthQuery`` answers from it).
        self.stall = StallWatch(stall_timeout)
        self._stalled = False  # the last reading was past the timeout
        self._in_flight: deque[_InFlight] = deque()  # oldest first, as the worker runs them
        self.max_in_flight = scheduler.config.max_steps_in_flight
        self.budget = StepBudget(scheduler.config.max_step_seconds,
                                 scheduler.config.max_num_batched_tokens)
        self.total_preemptions = 0
        self._num_received = 0  # requests released to us so far
        self._num_queued = 0  # requests in admission's queue, as of its last message
        self._finished: list[str] = []  # finished since the last capacity report
        self._reported: SchedulerCapacity | None = None
        #: Called with (request id, its exported K/V or None if the export
        #: failed) once the worker copied a prefill request's blocks out
        #: (the engine's futures of disaggregated prefill).
        self.on_kv_export = on_kv_export
        #: Opens the offload tier at a path for the core's look-ups (a
        #: ``kv_transfer.ExternalKV``); ``AttachTier`` uses it.
        self.attach_tier = attach_tier

    def start(self):
        """Start the run loop; admission learns the capacity before any request."""
        self._report(always=True)
        return super().start()

    async def run(self) -> None:
        """Drain the inbox, then launch steps, then tell admission what it
        needs to know (``_report``)."""
        from kvserve.actors.messages import Stop

        while True:
            message = await self.inbox.get()
            while True:
                if isinstance(message, Stop):
                    return
                await self._dispatch(message)
                if self.inbox.empty():
                    break
                message = self.inbox.get_nowait()
            self._maybe_launch_step()
            self._report()

    async def handle(self, message) -> None:
        if isinstance(message, ReleaseRequests):
            self._on_release(message)
        elif isinstance(message, AbortRequest):
            self._abort(message)
        elif isinstance(message, StepResult):
            self._on_step_result(message)
        elif isinstance(message, AdoptBlocks):
            self._adopt(message)
        elif isinstance(message, HealthQuery):
            reading = self._health()
            if not message.reply.done():
                message.reply.set_result(reading)
        elif isinstance(message, AttachTier):
            self._attach(message)
        else:
            raise TypeError(f"unexpected message {type(message).__name__}")

    def _attach(self, message: AttachTier) -> None:
        """Look blocks up in the tier at ``message.path`` from now on (the
        previous mapping, if any, is closed); the reply gets None or the
        error."""
        error = None
        try:
            if self.attach_tier is None:
                raise ValueError("this scheduler cannot attach an offload tier")
            for unused in self.core.attach_external(self.attach_tier(message.path)):
                if hasattr(unused, "close"):  # replaced, or refused (no prefix caching)
                    unused.close()
        except (ValueError, OSError) as exc:
            error = exc
        if message.reply is not None and not message.reply.done():
            message.reply.set_result(error)

    async def stop(self) -> None:
        """End the loop, then unmap the offload tier's look-up mapping."""
        await super().stop()
        external = self.core.external_tier
        if external is not None and hasattr(external, "close"):
            external.close()

    def _health(self) -> EngineHealth:
        """A stall reading now; logs ``engine_stalled`` when it passes the
        timeout and ``engine_recovered`` when a step ends the stall."""
        reading = self.stall.reading(time.monotonic(), self.core.num_running, self.num_waiting)
        if reading.is_stalled and not self._stalled:
            self.log.error("engine_stalled", stalled_seconds=round(reading.stalled_seconds, 1),
                           num_running=reading.num_running, num_waiting=reading.num_waiting,
                           steps_in_flight=len(self._in_flight),
                           message=f"The engine is stalled: {reading.reason()}")
        elif self._stalled and not reading.is_stalled:
            self.log.warning("engine_recovered", message="A step finished: the engine "
                             "is no longer stalled")
        self._stalled = reading.is_stalled
        self.stats.send(StallReport(reading.stalled_seconds, reading.is_stalled))
        return reading

    def _adopt(self, message: AdoptBlocks) -> None:
        """A decode replica's imported blocks: adopt those the cache lacks;
        if none needs loading, the import is dropped at once (no step will)."""
        loads = self.core.adopt_blocks(message.request_id, message.block_hashes)
        if not loads:
            self.worker.send(DropImports((message.request_id,)))
        self.log.info("kv_blocks_adopted", request_id=message.request_id,
                      num_blocks=len(message.block_hashes), num_loads=len(loads))

    def _on_release(self, message: ReleaseRequests) -> None:
        """Requests admission lets start; each that cannot be added fails alone."""
        self._num_queued = message.num_waiting
        self._num_received += len(message.requests)
        for request in message.requests:
            try:
                self.core.add_request(request)
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the rest
                self.log.exception("request_add_failed", request_id=request.request_id)
                request.status, request.error = RequestStatus.FINISHED_ERROR, str(exc)
                self._emit([RequestUpdate.of(request)])
        self._refresh_load()

    def _report(self, returned: tuple[Request, ...] = (), always: bool = False) -> None:
        """Send admission a ``CapacityReport`` when it could change what
        admission does: requests go back (``returned``, preempted), released
        ones finished since the last report, or the capacity changed while
        admission has requests waiting (``always``: at start). In steady
        decode with nothing waiting it sends nothing."""
        capacity = self.core.capacity(self._num_received)
        changed = capacity != self._reported and self._num_queued > 0
        if not (always or returned or self._finished or changed):
            return
        self._reported = capacity
        finished, self._finished = tuple(self._finished), []
        self.admission.send(CapacityReport(capacity, returned, finished))

    def _abort(self, message: AbortRequest) -> None:
        """Requests admission released (those handed back meanwhile, admission
        finishes itself)."""
        status = (RequestStatus.FINISHED_STOPPED if message.reason == "stop"
                  else RequestStatus.FINISHED_ABORTED)
        updates = self.core.finish_requests(message.request_ids, status)
        if message.reason != "stop":
            self._emit(updates)
        else:  # the detokenizer already ended the stream
            self._finished += [u.request_id for u in updates]
            kept = dict(zip(message.request_ids, message.num_output_tokens))
            stopped = []
            for update in updates:
                count = kept.get(update.request_id)
                if count is not None:  # the tokens its output kept
                    update = replace(update, num_output_tokens=count)
                stopped.append((update, False))
            if stopped:
                self.stats.send(RequestsUpdated(tuple(stopped), time.monotonic()))
        self._refresh_load()

    def _maybe_launch_step(self) -> None:
        """Schedule and send steps until the in-flight limit or no work."""
        while (len(self._in_flight) < self.max_in_flight
               and (self.core.has_unfinished_requests() or self.core.has_pending_transfers())):
            t0 = time.perf_counter()
            output = self.core.schedule(self.budget.tokens(self.core.num_running),
                                        num_queued=self._num_queued)
            schedule_seconds = time.perf_counter() - t0
            self.stats.send(StepScheduled(output, self.core.num_running, self.num_waiting,
                                          self.core.kv_usage, time.monotonic()))
            self._report_scheduling(output)
            if output.is_empty:
                return
            self._in_flight.append(_InFlight(output, schedule_seconds))
            self.worker.send(ExecuteStep(output.step_id, output))

    def _report_scheduling(self, output: SchedulerOutput) -> None:
        self._emit(output.rejected)
        for event in output.preemptions:
            self.total_preemptions += 1
            self.log.warning(
                "request_preempted", request_id=event.request_id, reason=event.reason,
                num_blocks_freed=event.num_blocks_freed, total_preemptions=self.total_preemptions,
                message=f"Request {event.request_id} preempted (recompute): not enough KV cache "
                        f"space; total preemptions {self.total_preemptions}")
        for divergence in output.divergences:
            self._log_divergence(divergence)

    def _log_divergence(self, event: PrefixCacheDivergence) -> None:
        """One ``prefix_cache_divergence`` warning (the cache-miss explainer)."""
        self.log.warning(
            "prefix_cache_divergence", request_id=event.request_id, position=event.position,
            would_hit_tokens=event.would_hit_tokens, hit_tokens=event.hit_tokens,
            total_divergences=self.core.num_divergences,
            message=f"Request {event.request_id} missed the prefix cache at token "
                    f"{event.position}: its prompt differs from a cached one there; "
                    f"{event.would_hit_tokens:,} tokens would have hit "
                    f"({event.hit_tokens:,} did)")

    def _on_step_result(self, result: StepResult) -> None:
        step = self._in_flight.popleft()
        output: SchedulerOutput = result.scheduler_output
        if step.output.step_id != output.step_id:
            raise RuntimeError(f"step {output.step_id} returned, step {step.output.step_id} "
                               "expected: the worker runs steps in order")
        t0 = time.perf_counter()
        runner_output = result.runner_output
        self.stall.on_step(time.monotonic())
        spec = None
        if result.error is not None and (result.kv_load_lost or result.kv_lost):
            # K/V gone, not a fault of the requests': they start again
            self._recompute_step(output, result.error, everyone=result.kv_lost)
            if result.kv_lost:
                self._drop_kv(result.error)
        elif result.error is not None:
            self._fail_step(output, result.error)
        else:
            if result.kv_lost:
                self._drop_kv(None)
            updates = self.core.update_from_output(output, runner_output.sampled,
                                                   runner_output.draft_token_ids)
            self._emit(updates, runner_output.logprobs,
                       prompt_logprobs=runner_output.prompt_logprobs)
            if self.core.config.speculative is not None:
                spec = self.core.take_spec_stats()
            self.budget.observe(output.num_batched_tokens, runner_output.forward_seconds)
        transfer = self._finish_exports(output, runner_output)
        self._return_preempted()
        self.stats.send(StepFinished(
            output, result.start, result.end,
            self._step_times(step, runner_output, time.perf_counter() - t0), spec,
            transfer.stats if transfer is not None else None))
        self._refresh_load()

    def _finish_exports(self, output: SchedulerOutput, runner_output):
        """Free the blocks of the step's exports and hand their K/V (None if
        the step failed) to ``on_kv_export``; the step's ``TransferResult``
        (None without transfers)."""
        transfer = getattr(runner_output, "kv_transfer", None)
        exported = transfer.exports if transfer is not None else {}
        self.core.release_exports(output.kv_export_ids)
        if self.on_kv_export is not None:
            for request_id in output.kv_export_ids:
                self.on_kv_export(request_id, exported.get(request_id))
        return transfer

    def _return_preempted(self) -> None:
        """After a step's results (no step in flight holds a preempted
        request now): the requests preempted since go back to admission,
        which owns the waiting ones. Nothing waits for an answer."""
        returned = tuple(self.core.take_preempted())
        if returned:
            self._num_queued += len(returned)
            self._report(returned=returned)

    @staticmethod
    def _step_times(step: _InFlight, runner_output, emit_seconds: float) -> StepTimes:
        """The phases of the step just finished (the runner's are 0 if it failed)."""
        if runner_output is None:
            return StepTimes(schedule=step.schedule_seconds, emit=emit_seconds)
        return StepTimes(schedule=step.schedule_seconds,
                         prepare=runner_output.prepare_seconds,
                         forward=runner_output.forward_seconds,
                         sample=runner_output.sample_seconds,
                         draft=runner_output.draft_seconds, emit=emit_seconds,
                         stages=runner_output.stage_seconds)

    def _refresh_load(self) -> None:
        """Running/waiting/KV gauges as they are now (they must reach 0 when
        idle), and whether the engine has work (for the stall watch)."""
        self.stall.on_load(time.monotonic(), bool(
            self.core.num_running or self.num_waiting or self._in_flight))
        self.stats.send(LoadReport(self.core.num_running, self.num_waiting,
                                   self.core.kv_usage))

    @property
    def num_waiting(self) -> int:
        """Waiting requests: admission's queue (as of its last message) and
        those staged here."""
        return self._num_queued + self.core.num_staged

    def _drop_kv(self, error: str | None) -> None:
        """The worker lost the K/V of the cache (a pipeline stage restarted;
        after a failed step, ``error``, whose requests and every other
        running one ``_recompute_step`` restarted): forget every cached
        block but those of running requests (a step that found the loss and
        ran only fresh prompts wrote theirs anew), so no later request reads
        a lost block through a prefix-cache hit. Logs ``kv_cache_lost``."""
        self.core.forget_cached_blocks()
        self.log.error("kv_cache_lost", error=error,
                       message="The worker lost its KV cache (a pipeline stage restarted): "
                               "every cached block forgotten"
                               + (", the running requests start again" if error else ""))

    def _fail_step(self, output: SchedulerOutput, error: str) -> None:
        """A step raised: fail its requests, and those of the step in flight
        behind it that read its blocks through a prefix-cache hit; forget the
        prefix-cache hashes of the blocks it was writing; carry on."""
        self.core.forget_written_blocks(output)
        ids = tuple(r.request_id for r in output.scheduled)
        ids += tuple(rid for later in self._in_flight
                     for rid in _hits_on(later.output, output.written_block_ids,
                                         self.core.block_size))
        updates = self.core.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        self.log.error("step_failed", step_id=output.step_id, error=error, request_ids=list(ids))
        self._emit(updates, error=error)

    def _recompute_step(self, output: SchedulerOutput, error: str, everyone: bool) -> None:
        """A step lost K/V that its requests needed, through no fault of
        theirs: a block to load from an offload tier was gone (nothing was
        computed), or, ``everyone``, the worker lost its whole cache (a
        pipeline stage restarted: every running request's K/V is gone).
        Restart them from their prompts (reason ``kv_load_lost`` or
        ``kv_cache_lost``), with those of the steps in flight behind it that
        read its blocks through a prefix-cache hit (the tier's look-up now
        misses the lost block, so they recompute it); forget the hashes of
        the blocks it was writing. A request restarted so
        ``MAX_KV_RESTARTS`` times already fails with ``error`` instead (a
        stage that dies at every step must not hold it forever). Logs
        ``request_preempted`` for each restarted."""
        core = self.core
        core.forget_written_blocks(output)
        ids = [r.request_id for r in output.scheduled]
        ids += [rid for later in self._in_flight
                for rid in _hits_on(later.output, output.written_block_ids, core.block_size)]
        if everyone:
            ids += core.running_ids()
        ids = list(dict.fromkeys(ids))
        spent = [rid for rid in ids if (r := core.get_request(rid)) is not None
                 and r.num_kv_restarts >= MAX_KV_RESTARTS]
        if spent:
            self._emit(core.finish_requests(spent, RequestStatus.FINISHED_ERROR),
                       error=f"{error} (its K/V was lost {MAX_KV_RESTARTS + 1} times)")
        reason = "kv_cache_lost" if everyone else "kv_load_lost"
        lost = ("the worker lost its KV cache" if everyone
                else "a KV block it was to load from the offload tier was lost")
        for event in core.recompute([rid for rid in ids if rid not in spent], reason):
            self.total_preemptions += 1
            self.log.warning(
                "request_preempted", request_id=event.request_id, reason=event.reason,
                num_blocks_freed=event.num_blocks_freed, total_preemptions=self.total_preemptions,
                error=error,
                message=f"Request {event.request_id} preempted (recompute): {lost} ({error}); "
                        "it starts again from its prompt")

    def _emit(self, updates: list[RequestUpdate] | tuple[RequestUpdate, ...],
              logprobs: dict | None = None, error: str | None = None,
              prompt_logprobs: dict | None = None) -> None:
        emitted = []
        for update in updates:
            if not update.new_token_ids and update.finish_reason is None:
                continue
            entries = (logprobs or {}).get(update.request_id)
            if entries is not None:
                entries = tuple(entries[: len(update.new_token_ids)])
            reason = update.finish_reason
            if reason is not None:
                self._finished.append(update.request_id)
            self.detokenizer.send(TokenDelta(
                request_id=update.request_id, new_token_ids=update.new_token_ids,
                finish_reason=None if reason is None else str(reason),
                num_prompt_tokens=update.num_prompt_tokens,
                num_cached_tokens=max(update.num_cached_tokens, 0),
                logprobs=entries, error=update.error or (error if reason is not None else None),
                prompt_logprobs=_as_tuple((prompt_logprobs or {}).get(update.request_id))))
            emitted.append((update, True))
        if emitted:  # TTFT/ITL stamped as the tokens leave the core
            self.stats.send(RequestsUpdated(tuple(emitted), time.monotonic()))


def _hits_on(output: SchedulerOutput, block_ids: tuple[int, ...], block_size: int) -> list[str]:
    """Requests first scheduled in ``output`` whose prefix-cache hit includes
    one of ``block_ids``."""
    blocks = set(block_ids)
    hits = {new.request_id: new.num_cached_tokens // block_size for new in output.new_requests}
    return [chunk.request_id for chunk in output.scheduled
            if hits.get(chunk.request_id) and blocks.intersection(
                chunk.new_block_ids[:hits[chunk.request_id]])]


def _as_tuple(entries) -> tuple | None:
    """Prompt logprob entries as a tuple (None when there are none)."""
    return None if entries is None else tuple(entries)
