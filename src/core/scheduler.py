"""Iteration-level scheduler: continuous batching with chunked prefill,
paged KV blocks, prefix caching and preemption by recompute.

Modelled on vLLM v1's scheduler (docs: "Optimization and Tuning -- chunked
prefill", "Automatic Prefix Caching"; Kwon et al. 2023, PagedAttention; Yu
et al. 2022, Orca, for iteration-level scheduling). There is no separate
prefill phase: every step gives each request enough tokens for its computed
count to catch up with its known count, within the token budget
``max_num_batched_tokens`` and ``max_num_seqs``.

Protocol: ``schedule()`` -> the runner computes the ``SchedulerOutput`` ->
``update_from_output()`` with the sampled tokens, in step order. At most two
steps may be in flight (async scheduling, vLLM V1's ``--async-scheduling``):
step N+1 may be scheduled before step N's ``update_from_output``.
``add_request`` and ``finish_requests`` may be called between any two calls.

The invariant that makes this work: ``schedule()`` advances each scheduled
request's ``num_computed_tokens`` at once, and counts each token the step
will sample as a placeholder (``Request.num_output_placeholders``), so the
next step schedules the decode of a token the scheduler does not know yet;
the runner, which sampled it, supplies its id. ``update_from_output``
replaces placeholders with the sampled tokens. A request that stops (EOS, a
stop token or string, an abort) while a later step holds it is finished at
once and its blocks freed; that later step's token for it is dropped, never
emitted. A request is not scheduled again once the tokens in flight will
reach its ``max_tokens`` or ``max_model_len``. A preempted request drops
its placeholder but keeps the token that the step in flight samples for it
(computed from its state before the preemption, so it is its next token; it
may also stop it); it must not run again before that token is back -- true
with at most two steps in flight: the step that preempts it is scheduled
while only the step before holds it, and the next ``schedule()`` comes after
that one returned.

Pipeline parallelism (``SchedulerConfig.pipeline_parallel_size`` P > 1):
the worker begins step N+1 before step N's tokens are back, so the two
must not share a request whose token is in flight (the stages need its
id): a decoding request with a placeholder is left out, and a step takes
at most ceil(D / P) of the D decoding requests, so the next step finds the
others (vLLM's micro-batches). A prompt's next chunk may follow the chunk
in flight: every stage computes the steps in order.

Speculative decoding (``SchedulerConfig.speculative``, ``core.spec_decode``)
adds draft tokens to a decoding request's chunk. N-gram drafts are copied
from the request's own tokens; a draft model's come back with the step
that sampled the request's latest token (``update_from_output``'s
``drafts``). Either way the scheduler drafts only for a request no step in
flight holds -- such a request waits a step rather than draft from a stale
token -- and counts the drafts as computed like any other token of the
chunk; ``update_from_output`` takes back the rejected ones (the runner
returns the accepted drafts and one token more) before registering full
blocks, so prefix-cache hashes only ever cover verified tokens. A chunk
that will propose draft-model drafts gets that many lookahead slots
(vLLM's ``num_lookahead_tokens``), where the draft model writes its K/V;
they stay in the request's table and are freed with it.

The waiting queue is admission's (``core.admission_queue``): it orders the
waiting requests and releases what this scheduler reports room for.
Released requests are *staged* here (``staged``, in the policy's order)
until a step admits them, and stay staged until it can: nothing goes back
to admission per step. A request goes back only when it is preempted
(``take_preempted``), after the step's results, when no step in flight
holds it (see above).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..config import SchedulerConfig
from .admission_queue import SchedulerCapacity
from .kv_cache_manager import KVCacheManager, cdiv
from .kv_transfer import BlockTransfer
from .kv_transfer_book import KVTransferBook
from .outputs import (NewRequestData, PreemptionEvent, PrefixCacheDivergence, RequestUpdate,
                      ScheduledRequest, SchedulerOutput)
from .request import FinishReason, Request, RequestStatus, check_stop
from .request_queue import create_queue, priority_key
from .spec_decode import SpecDecodingStats, SpecState, draft_tokens, may_speculate


@dataclass
class _Step:
    """Working state of one ``schedule()`` call."""

    budget: int
    num_new: dict[str, int] = field(default_factory=dict)  # request id -> tokens, in order
    new_requests: dict[str, NewRequestData] = field(default_factory=dict)
    first_scheduled: list[str] = field(default_factory=list)
    preemptions: list[PreemptionEvent] = field(default_factory=list)
    rejected: list[RequestUpdate] = field(default_factory=list)
    divergences: list[PrefixCacheDivergence] = field(default_factory=list)
    loads: list[BlockTransfer] = field(default_factory=list)
    drafts: dict[str, list[int]] = field(default_factory=dict)  # request id -> draft tokens
    lookahead: dict[str, int] = field(default_factory=dict)  # request id -> drafts to propose
    offload_queries: int = 0  # the tier counters when the step began
    offload_hits: int = 0
    stored: list[BlockTransfer] = field(default_factory=list)  # computed by earlier steps

    def add(self, request: Request, num_new: int) -> None:
        self.num_new[request.request_id] = num_new
        self.budget -= num_new

    @property
    def preempted_ids(self) -> set[str]:
        return {event.request_id for event in self.preemptions}


class Scheduler:
    """Decides, each step, which tokens of which requests the model computes.

    ``block_size`` (tokens per KV block) must match the KV cache manager's;
    it defaults to it. Raises ``ValueError`` on a mismatch.
    """

    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 block_size: int | None = None) -> None:
        if block_size is not None and block_size != kv_cache_manager.block_size:
            raise ValueError(f"block_size {block_size} != KV cache manager's "
                             f"{kv_cache_manager.block_size}")
        self.config = scheduler_config
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.staged = create_queue(scheduler_config.policy,
                                    scheduler_config.priority_aging_seconds)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: dict[str, None] = {}  # ordered set, drained each step
        # request id -> length of its block table the runner has (deltas)
        self._blocks_sent: dict[str, int] = {}
        self._step_id = 0
        #: KV transfers (exports, adopted blocks' loads) for the next step.
        self.transfers = KVTransferBook(kv_cache_manager)
        #: Speculative decoding counts since the last ``take_spec_stats``.
        self._spec_stats = SpecDecodingStats()
        self._num_requests_at_step_start = 0  # running + staged when schedule() began
        self._num_queued = 0  # admission's waiting requests, as schedule() was told
        self._preempted: dict[str, None] = {}  # preempted, not handed back yet (ordered set)

    # ----------------------------------------------------------- bookkeeping

    @property
    def num_running(self) -> int:
        """Requests admitted and holding KV blocks."""
        return len(self.running)

    @property
    def num_staged(self) -> int:
        """Requests staged here and not running (``staged``)."""
        return len(self.staged)

    @property
    def num_staged_tokens(self) -> int:
        """Tokens the staged requests still have to compute (prompt + output)."""
        return self.staged.num_tokens

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.requests)

    def has_pending_transfers(self) -> bool:
        """True while KV blocks wait to be copied (exports, adopted blocks
        to load, computed blocks to save in the offload tier): a step must
        run even if no request computes."""
        return bool(self.transfers.pending
                    or self.kv_cache_manager.pool.stored)

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV cache's blocks in use (0..1), for the gauges."""
        return self.kv_cache_manager.usage

    @property
    def num_divergences(self) -> int:
        """Prefix-cache divergences found so far (the cache-miss explainer)."""
        return self.kv_cache_manager.stats.divergences

    @property
    def external_tier(self):
        """The offload tier block look-ups consult (an ``ExternalKV``), or None."""
        return self.kv_cache_manager.external

    def attach_external(self, tier) -> list:
        """Consult ``tier`` (an ``ExternalKV``) for block look-ups from now
        on; returns the tiers no longer used (the previous one, or ``tier``
        itself when the cache refuses it: no prefix caching), for the
        caller to close."""
        manager = self.kv_cache_manager
        previous = manager.external
        manager.set_external(tier)
        return [t for t in (previous, tier) if t is not None and t is not manager.external]

    def running_ids(self) -> list[str]:
        """Ids of the running requests, in admission order."""
        return [r.request_id for r in self.running]

    def forget_cached_blocks(self) -> None:
        """Forget the prefix-cache hashes of every block no running request
        holds (the worker lost its cache: no later request may hit one)."""
        manager = self.kv_cache_manager
        held = {b for r in self.running for b in manager.get_block_ids(r.request_id)}
        manager.evict_hashes(b for b in range(manager.pool.num_blocks) if b not in held)

    def forget_written_blocks(self, output: SchedulerOutput) -> None:
        """Forget the prefix-cache hashes of the blocks ``output`` was to
        write (its step failed, or lost K/V it read)."""
        self.kv_cache_manager.evict_hashes(output.written_block_ids)

    def get_request(self, request_id: str) -> Request | None:
        """The live (unfinished) request with this id, or None."""
        return self.requests.get(request_id)

    def add_request(self, request: Request) -> None:
        """Stage a request admission released (new, or one handed back
        earlier). Its ``max_model_len`` is capped at the scheduler's.
        Raises ``ValueError`` for a duplicate live id or a request that is
        running or finished."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        waiting = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        if request.status not in waiting or request.num_computed_tokens \
                or request.num_output_placeholders:
            raise ValueError(f"request {request.request_id!r} is not waiting")
        limit = self.config.max_model_len
        if request.max_model_len is None or request.max_model_len > limit:
            request.max_model_len = limit
        self.requests[request.request_id] = request
        self.staged.add(request)

    def take_preempted(self) -> list[Request]:
        """The requests preempted since the last call and still staged (not
        admitted again meanwhile), in service order, forgotten here: they go
        back to admission, which owns the waiting requests. Released requests
        that are merely waiting for room stay staged.

        Call it only when no step in flight holds one of them (after a step's
        ``update_from_output``, with at most two steps in flight: see the
        module docstring), since their sampled tokens would be dropped.
        """
        if not self._preempted:
            return []
        preempted, self._preempted = self._preempted, {}
        taken = [r for r in self.staged if r.request_id in preempted]
        self.staged.remove([r.request_id for r in taken])
        for request in taken:
            del self.requests[request.request_id]
        return taken

    def capacity(self, released_seen: int = 0) -> SchedulerCapacity:
        """What this scheduler can start now (``released_seen``: requests it
        has received from admission so far, passed through)."""
        manager = self.kv_cache_manager
        worst = None
        if self.config.policy == "priority" and self.running:
            worst = self._priority_key(self._pick_victim())
        return SchedulerCapacity(
            free_seqs=self.config.max_num_seqs - len(self.running) - len(self.staged),
            free_blocks=manager.num_free_blocks, num_running=len(self.running),
            worst_running=worst, released_seen=released_seen)

    def finish_requests(self, request_ids: str | Iterable[str],
                        status: RequestStatus) -> list[RequestUpdate]:
        """Finish live requests from outside (abort, stop string, step fault).

        Removes them from the waiting queue or the running batch and frees
        their blocks; unknown or already finished ids are ignored. Returns one
        ``RequestUpdate`` per request finished. Raises ``ValueError`` if
        ``status`` is not a FINISHED_* status.
        """
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status}")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:  # adopted for a request that never got here
            self.kv_cache_manager.release_adopted(request_id)
        found = [self.requests[i] for i in dict.fromkeys(ids) if i in self.requests]
        running = {r.request_id for r in found if r.status is RequestStatus.RUNNING}
        if running:
            self.running = [r for r in self.running if r.request_id not in running]
        self.staged.remove([r.request_id for r in found if r.request_id not in running])
        return [self._finish(r, status) for r in found]

    def _finish(self, request: Request, status: RequestStatus, error: str | None = None,
                new_token_ids: Sequence[int] = ()) -> RequestUpdate:
        """Mark finished, free blocks, forget it. Caller removed it from queues."""
        request.status = status
        request.error = error
        self._blocks_sent.pop(request.request_id, None)
        self.kv_cache_manager.release_adopted(request.request_id)
        if not self.transfers.export(request):
            self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_ids[request.request_id] = None
        return RequestUpdate.of(request, new_token_ids)

    # ---------------------------------------------------------- KV transfer

    def release_exports(self, request_ids: Iterable[str]) -> None:
        """The runner copied these requests' exported blocks (or failed to):
        free them (``KVTransferBook.release``)."""
        self.transfers.release(request_ids)

    def adopt_blocks(self, request_id: str, block_hashes: Sequence[bytes]) -> list[BlockTransfer]:
        """Adopt a prefill replica's blocks for ``request_id``; the next step
        loads them (``KVTransferBook.adopt``). Returns the loads queued."""
        return self.transfers.adopt(request_id, block_hashes)

    # -------------------------------------------------------------- schedule

    def schedule(self, token_budget: int | None = None, num_queued: int = 0) -> SchedulerOutput:
        """Build the next step: running requests first (decodes before prefill
        chunks), then -- if nothing was preempted -- admit staged requests
        while budget, ``max_num_seqs`` and free blocks allow.

        ``token_budget`` (tokens) lowers this step's budget below
        ``max_num_batched_tokens`` (the step-time target, ``StepBudget``).
        ``num_queued``: requests in admission's waiting queue, added to the
        staged ones in the output's ``num_waiting`` (the step's statistics).
        """
        self._num_queued = num_queued
        stats = self.kv_cache_manager.stats
        queries, hits = stats.queries, stats.hits
        budget = self.config.max_num_batched_tokens
        step = _Step(budget=budget if token_budget is None else min(budget, token_budget),
                     offload_queries=stats.external_queries, offload_hits=stats.external_hits,
                     stored=self.kv_cache_manager.take_stored())
        self._num_requests_at_step_start = len(self.running) + len(self.staged)
        self._schedule_running(step)
        if not step.preemptions or self.config.policy == "priority":
            self._schedule_waiting(step)
        output = self._build_output(step, stats.queries - queries, stats.hits - hits)
        self._advance(output)
        self._step_id += 1
        return output

    def _advance(self, output: SchedulerOutput) -> None:
        """Count the step's tokens as computed and its samples as placeholders."""
        for chunk in output.scheduled:
            request = self.requests[chunk.request_id]
            request.num_computed_tokens += chunk.num_tokens
            request.num_output_placeholders += chunk.sample

    def _schedule_running(self, step: _Step) -> None:
        decodes = [r for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens]
        prefills = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        stages = self.config.pipeline_parallel_size
        if stages > 1:
            # Pipeline micro-batches: a request whose token is in flight waits
            # for it (the stages need its id), and a step takes at most 1/P
            # of the decodes, so the next step has the others to run.
            decodes = [r for r in decodes if not r.num_output_placeholders][
                :-(-len(decodes) // stages)]
        for request in decodes + prefills:
            if step.budget <= 0:
                return
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            if stages > 1 and request.num_output_placeholders:
                continue
            self._schedule_running_request(request, step)

    def _schedule_running_request(self, request: Request, step: _Step) -> bool:
        """Allocate for one running request, preempting others if needed.

        Returns False when ``request`` itself was the victim. Unlike vLLM we
        then go on with the remaining running requests rather than ending the
        step: they are all better victims-to-keep (earlier admitted, or of
        better priority) and may fit in the blocks just freed.
        """
        limit = request.max_model_len or self.config.max_model_len
        num_new = min(request.num_tokens_with_placeholders - request.num_computed_tokens,
                      step.budget, limit - request.num_computed_tokens)
        if request.num_computed_tokens < request.num_prompt_tokens and self.staged:
            num_new = self._capped(num_new)  # a prefill leaves room for those waiting
        if num_new <= 0 or _ends_in_flight(request, limit):
            return True
        speculates = self._speculates(request)
        if not speculates and request.spec is not None:
            request.spec.draft_token_ids = []  # stale by the time it speculates again
        if speculates:
            if request.num_output_placeholders:
                return True  # it drafts from its latest token: wait for the step in flight
            step.drafts[request.request_id] = drafts = self._draft(request, step.budget, limit)
            num_new += len(drafts)
        lookahead = self._num_lookahead(request, num_new, limit, speculates)
        while self._allocate(request, num_new, lookahead, step) is None:
            victim = self._pick_victim()
            self._preempt(victim, step)
            if victim is request:
                return False
        self._add_to_step(request, num_new, step)
        return True

    def _allocate(self, request: Request, num_new: int, lookahead: int, step: _Step,
                  hits: Sequence = ()) -> list | None:
        """``KVCacheManager.allocate_slots`` for ``num_new`` tokens and, if
        they fit too, ``lookahead`` more for the draft model (lookahead slots
        never cost a preemption): the new blocks, or None."""
        manager = self.kv_cache_manager
        if lookahead:
            blocks = manager.allocate_slots(request, num_new + lookahead, hits)
            if blocks is not None:
                step.lookahead[request.request_id] = lookahead
                return blocks
        return manager.allocate_slots(request, num_new, hits)

    def _num_lookahead(self, request: Request, num_new: int, limit: int,
                       speculates: bool) -> int:
        """Drafts the draft model proposes after this chunk: k (fewer near
        ``limit``) when the chunk samples and the request speculates next --
        a decode that speculates now, or a prompt's last chunk whose sampling
        allows it; 0 with n-gram speculation."""
        spec = self.config.speculative
        if spec is None or not spec.uses_draft_model or self._batch_too_large():
            return 0
        end = request.num_computed_tokens + num_new
        if end < request.num_tokens_with_placeholders:
            return 0  # a prefill chunk that does not sample
        if not speculates:  # the chunk ending a prompt (or a resumed request's tokens)
            state = request.spec
            if (request.num_computed_tokens >= request.num_prompt_tokens
                    or (state is not None and not state.enabled)
                    or not may_speculate(request.sampling_params, request.num_output_tokens + 1)):
                return 0
        return max(0, min(spec.num_speculative_tokens, limit - end))

    def _speculates(self, request: Request) -> bool:
        """Whether ``request`` drafts this step: speculation is configured,
        its prompt is computed, its sampling allows it and its off switch
        has not tripped (``core.spec_decode``)."""
        if (self.config.speculative is None or self._batch_too_large()
                or request.num_computed_tokens < request.num_prompt_tokens):
            return False
        if request.spec is None:
            request.spec = SpecState()
        if not may_speculate(request.sampling_params, request.num_output_tokens):
            return False
        alone = len(self.running) == 1 and not self.staged  # sitting out costs nothing
        if request.spec.enabled or alone:
            return True
        request.spec.plain_step()
        return False

    def _batch_too_large(self) -> bool:
        """``disable_by_batch_size``: at least that many requests were running
        or waiting when this step began."""
        limit = self.config.speculative.disable_by_batch_size
        return limit is not None and self._num_requests_at_step_start >= limit

    def _draft(self, request: Request, budget: int, limit: int) -> list[int]:
        """The draft of a decoding request (``spec_decode.draft_tokens``)."""
        return draft_tokens(request, self.config.speculative, budget, limit)

    def take_spec_stats(self) -> SpecDecodingStats:
        """Speculative decoding counts since the last call (of the steps
        whose results were applied)."""
        stats, self._spec_stats = self._spec_stats, SpecDecodingStats()
        return stats

    def _capped(self, num_new: int) -> int:
        """``num_new`` prefill tokens, at most ``long_prefill_token_threshold``
        (vLLM's flag) when it is set."""
        cap = self.config.long_prefill_token_threshold
        return min(num_new, cap) if cap > 0 else num_new

    def _add_to_step(self, request: Request, num_new: int, step: _Step) -> None:
        """Schedule ``num_new`` tokens and register the blocks they fill."""
        step.add(request, num_new)
        self.kv_cache_manager.cache_computed_blocks(request, request.num_computed_tokens + num_new)

    def _pick_victim(self) -> Request:
        """fcfs: the most recently admitted; priority: the worst (highest
        priority value, then latest arrival, then latest admitted)."""
        if self.config.policy != "priority":
            return self.running[-1]
        order = {id(r): i for i, r in enumerate(self.running)}
        return max(self.running, key=lambda r: (*self._priority_key(r), order[id(r)]))

    def _priority_key(self, request: Request) -> tuple[float, float]:
        return priority_key(request, self.config.priority_aging_seconds)

    def _preempt_for(self, request: Request, step: _Step) -> bool:
        """Under ``priority``: make room for a waiting ``request`` by
        preempting the worst running request, if ``request`` is strictly
        better. Returns True if something was preempted."""
        if self.config.policy != "priority" or not self.running:
            return False
        victim = self._pick_victim()
        if self._priority_key(victim) <= self._priority_key(request):
            return False
        self._preempt(victim, step)
        return True

    def _preempt(self, request: Request, step: _Step) -> None:
        """Preempt by recompute: free all blocks and requeue at the front."""
        self.running.remove(request)
        if request.request_id in step.num_new:  # scheduled earlier this step
            step.budget += step.num_new.pop(request.request_id)
            # Blocks registered for this step's tokens will not be computed now.
            first_unwritten = request.num_computed_tokens // self.block_size
            manager = self.kv_cache_manager
            manager.evict_hashes(manager.get_block_ids(request.request_id,
                                                       first_unwritten * manager.num_groups))
        num_freed = self._requeue(request)
        step.preemptions.append(PreemptionEvent(request.request_id, "kv_cache_full", num_freed))

    def _requeue(self, request: Request) -> int:
        """A request taken off ``running``, preempted by recompute: free its
        blocks, reset its progress, requeue it at the front and tell the
        runner to forget it. Returns the blocks freed."""
        num_freed = self.kv_cache_manager.free(request)
        self._blocks_sent.pop(request.request_id, None)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # the tokens in flight for it are dropped
        if request.spec is not None:
            request.spec.draft_token_ids = []
        request.num_preemptions += 1
        self.staged.prepend(request)
        self._preempted[request.request_id] = None
        self._finished_ids[request.request_id] = None
        return num_freed

    def recompute(self, request_ids: Iterable[str], reason: str) -> list[PreemptionEvent]:
        """Restart running requests whose K/V are bad (a block the step was
        to load from an offload tier was gone: vLLM's ``recompute`` policy
        for KV load failures) as a preemption by recompute: forget the
        prefix-cache hashes of all their blocks (what they loaded or will
        compute from it is bad), free them, requeue them at the front, and
        void every result of a step already scheduled for them (their
        tokens were computed from the bad K/V: ``update_from_output`` drops
        them). Unknown, finished and waiting ids are ignored. Returns the
        preemptions (``reason`` as given)."""
        events = []
        manager = self.kv_cache_manager
        for request_id in dict.fromkeys(request_ids):
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            self.running.remove(request)
            manager.evict_hashes(manager.get_block_ids(request_id))
            request.outputs_void_through = self._step_id - 1  # the last step scheduled
            request.num_kv_restarts += 1
            events.append(PreemptionEvent(request_id, reason, self._requeue(request)))
        return events

    def _schedule_waiting(self, step: _Step) -> None:
        """Admit waiting requests in queue order while budget, sequence slots
        and blocks allow. Under ``priority`` a waiting request that finds no
        slot or no blocks preempts worse running requests (vLLM's priority
        scheduling)."""
        while self.staged and step.budget > 0:
            request = self.staged.peek()
            if request.request_id in step.preempted_ids:
                return  # preempted this step: never recompute it in the same step
            error = self._reject_reason(request)
            if error is not None:
                self.staged.pop()
                step.rejected.append(self._finish(request, RequestStatus.FINISHED_ERROR, error))
                continue
            if len(self.running) >= self.config.max_num_seqs:
                if self._preempt_for(request, step):
                    continue
                return
            if not self._admit(request, step) and not self._preempt_for(request, step):
                return

    def _reject_reason(self, request: Request) -> str | None:
        """Why a waiting request can never run (defensive; the engine should
        have rejected it already), or None."""
        limit = request.max_model_len or self.config.max_model_len
        if request.num_prompt_tokens == 0:
            return "the prompt is empty"
        if request.num_tokens > limit:
            return (f"the prompt ({request.num_tokens} tokens) is longer than "
                    f"max_model_len ({limit} tokens)")
        needed = self.kv_cache_manager.max_blocks(request.num_tokens,
                                                  self.config.max_num_batched_tokens)
        if needed > self.kv_cache_manager.num_blocks:
            return (f"the request needs {needed} KV cache blocks but the cache has only "
                    f"{self.kv_cache_manager.num_blocks}; lower max_model_len")
        return None

    def _admit(self, request: Request, step: _Step) -> bool:
        """Try to start (or resume) the head of the waiting queue.

        On a first admission the cache-miss explainer runs against the cache
        as the hit look-up saw it (before this allocation evicts anything);
        its divergence, if any, is reported only once the request is admitted.
        """
        manager = self.kv_cache_manager
        hit_blocks, num_hit = manager.get_computed_blocks(request)
        num_hit_blocks = num_hit // self.block_size  # logical: hit_blocks has one per group
        num_loaded = manager.get_external_blocks(request, num_hit_blocks)
        first = request.num_cached_tokens < 0
        divergence = manager.find_divergence(request, num_hit_blocks) if first else None
        num_new = min(request.num_tokens - num_hit - num_loaded * self.block_size, step.budget)
        if len(self.staged) > 1:  # others wait behind it
            num_new = self._capped(num_new)
        num_slots = num_loaded * self.block_size + num_new
        limit = request.max_model_len or self.config.max_model_len
        lookahead = self._num_lookahead(request, num_hit + num_slots, limit,  # none computed yet
                                        False)
        new_blocks = self._allocate(request, num_slots, lookahead, step, hit_blocks)
        if new_blocks is None:
            return False
        manager.release_adopted(request.request_id)  # its hits hold them now
        manager.record_external(request, num_hit_blocks, num_loaded)
        self._load(request, num_hit_blocks, new_blocks[:num_loaded], step)
        num_hit += num_loaded * self.block_size
        self.staged.pop()
        resumed = request.status is RequestStatus.PREEMPTED
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit
        if first:
            request.num_cached_tokens = num_hit
            step.first_scheduled.append(request.request_id)
            self._report_divergence(divergence, step)
        self.running.append(request)
        self._add_to_step(request, num_new, step)
        step.new_requests[request.request_id] = NewRequestData(
            request.request_id, request.prompt_token_ids, tuple(request.output_token_ids),
            request.sampling_params, num_hit, resumed)
        return True

    def _load(self, request: Request, first: int, blocks: Sequence, step: _Step) -> None:
        """Queue loads from the offload tier of ``blocks``, the request's
        blocks from index ``first`` on."""
        hashes = request.block_hashes[first:first + len(blocks)]
        step.loads += [BlockTransfer(request.request_id, block.block_id, block_hash)
                       for block, block_hash in zip(blocks, hashes)]

    def _report_divergence(self, divergence: PrefixCacheDivergence | None, step: _Step) -> None:
        if divergence is not None:
            self.kv_cache_manager.record_divergence(divergence)
            step.divergences.append(divergence)

    def _build_output(self, step: _Step, queries: int, hits: int) -> SchedulerOutput:
        scheduled = [self._scheduled_request(rid, n, rid in step.new_requests,
                                             step.drafts.get(rid, ()), step.lookahead.get(rid, 0))
                     for rid, n in step.num_new.items()]
        num_decode = sum(s.num_tokens for s in scheduled if self._is_decode(s))
        num_batched = sum(s.num_tokens for s in scheduled)
        finished = tuple(self._finished_ids)
        self._finished_ids.clear()
        saves, exports, export_ids, loads = self.transfers.take(step.stored, step.loads)
        stats = self.kv_cache_manager.stats
        return SchedulerOutput(
            step_id=self._step_id, scheduled=tuple(scheduled),
            new_requests=tuple(step.new_requests.values()), finished_request_ids=finished,
            preemptions=tuple(step.preemptions), rejected=tuple(step.rejected),
            num_batched_tokens=num_batched, num_prefill_tokens=num_batched - num_decode,
            num_decode_tokens=num_decode, first_scheduled_request_ids=tuple(step.first_scheduled),
            prefix_cache_queries=queries, prefix_cache_hits=hits,
            kv_cache_usage=self.kv_cache_manager.usage, num_running=len(self.running),
            num_waiting=self.num_staged + self._num_queued,
            divergences=tuple(step.divergences),
            written_block_ids=self._written_blocks(scheduled) + tuple(b.block_id for b in loads),
            kv_saves=saves, kv_exports=exports, kv_export_ids=export_ids, kv_loads=loads,
            kv_offload_queries=stats.external_queries - step.offload_queries,
            kv_offload_hits=stats.external_hits - step.offload_hits)

    def _written_blocks(self, scheduled: list[ScheduledRequest]) -> tuple[int, ...]:
        """Block ids that the scheduled chunks write into."""
        bs, groups = self.block_size, self.kv_cache_manager.num_groups
        written: list[int] = []
        for chunk in scheduled:
            end = chunk.start_position + chunk.num_tokens
            written += self.kv_cache_manager.get_block_ids(
                chunk.request_id, chunk.start_position // bs * groups, cdiv(end, bs) * groups)
        return tuple(written)

    def _scheduled_request(self, request_id: str, num_new: int, is_new: bool,
                           drafts: Sequence[int] = (), lookahead: int = 0) -> ScheduledRequest:
        """The step's delta for one request: its blocks since it was last
        scheduled (all of them when new; a table only grows while running),
        its draft tokens and the drafts it proposes after."""
        request = self.requests[request_id]
        start = request.num_computed_tokens
        manager = self.kv_cache_manager
        sent = 0 if is_new else self._blocks_sent.get(request_id, 0)
        self._blocks_sent[request_id] = manager.num_request_blocks(request_id)
        known_end = start + num_new - len(drafts)
        return ScheduledRequest(
            request_id=request_id, num_tokens=num_new, start_position=start,
            new_block_ids=tuple(manager.get_block_ids(request_id, sent)),
            sample=known_end == request.num_tokens_with_placeholders, is_new=is_new,
            spec_token_ids=tuple(drafts), num_lookahead_tokens=lookahead)

    def _is_decode(self, scheduled: ScheduledRequest) -> bool:
        request = self.requests[scheduled.request_id]
        known = scheduled.num_tokens - len(scheduled.spec_token_ids)  # a verify chunk decodes
        return (not scheduled.is_new and known == 1
                and scheduled.start_position >= request.num_prompt_tokens)

    # ----------------------------------------------------- update_from_output

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled: Mapping[str, Sequence[int]],
                           drafts: Mapping[str, Sequence[int]] | None = None
                           ) -> list[RequestUpdate]:
        """Apply the runner's results of ``scheduler_output`` (steps in order).

        For every request that sampled in it and is still live: replace one
        placeholder by ``sampled[request_id]`` (token ids), appended one by
        one until a stop condition, finishing and freeing it then; register
        the blocks that became full and known in the prefix cache. Requests
        finished or aborted since the schedule are skipped: their tokens are
        dropped; so are those of requests restarted since (``recompute``). A request preempted since keeps its token (see the module
        docstring). A sampling request missing from ``sampled`` finishes with
        an error. ``drafts`` (request id -> token ids) are the draft model's
        proposals for the requests' next steps; a request that is no longer
        running drops its own. Returns an update per request that got tokens
        or finished, in scheduled order.
        """
        updates = []
        for scheduled in scheduler_output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if (not scheduled.sample or request is None
                    or scheduler_output.step_id <= request.outputs_void_through):
                continue
            running = request.status is RequestStatus.RUNNING
            if running:
                request.num_output_placeholders -= 1
            tokens = sampled.get(request.request_id)
            if scheduled.spec_token_ids:
                self._verified(request, scheduled, tokens, running)
            update = self._apply_sampled(request, tokens)
            if running and update.finish_reason is None:
                self.kv_cache_manager.cache_computed_blocks(request)
                if drafts and request.request_id in drafts:
                    request.spec = request.spec or SpecState()
                    request.spec.draft_token_ids = list(drafts[request.request_id])
            updates.append(update)
        return updates

    def _verified(self, request: Request, scheduled: ScheduledRequest,
                  tokens: Sequence[int] | None, running: bool) -> None:
        """A speculative step came back: count its acceptance, feed the
        request's off switch and give back the K/V slots of the rejected
        drafts (the step computed them; the next one overwrites them)."""
        num_draft = len(scheduled.spec_token_ids)
        num_accepted = max(0, min(len(tokens or ()) - 1, num_draft))
        request.spec.record(num_draft, num_accepted)
        self._spec_stats.observe(num_draft, num_accepted)
        if running:
            request.num_computed_tokens -= num_draft - num_accepted

    def _apply_sampled(self, request: Request, token_ids: Sequence[int] | None) -> RequestUpdate:
        if not token_ids:
            return self._finish_running(request, RequestStatus.FINISHED_ERROR,
                                        "the model runner returned no sampled token", ())
        appended: list[int] = []
        reason = None
        for token_id in token_ids:
            request.append_output_token_ids(token_id)
            appended.append(token_id)
            reason = check_stop(request)
            if reason is not None:
                break
        if reason is None:
            return RequestUpdate.of(request, appended)
        request.stop_reason = _stop_token(request) if reason is FinishReason.STOP else None
        status = RequestStatus.from_finish_reason(reason)
        return self._finish_running(request, status, None, appended)

    def _finish_running(self, request: Request, status: RequestStatus, error: str | None,
                        new_token_ids: Sequence[int]) -> RequestUpdate:
        """Finish a running request (or a preempted one that stopped on the
        token a step in flight sampled for it)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.staged.remove([request.request_id])
        return self._finish(request, status, error, new_token_ids)


def _ends_in_flight(request: Request, limit: int) -> bool:
    """True when the tokens in flight will reach ``max_tokens`` or ``limit``
    (tokens), so scheduling another would only compute a token to drop."""
    if not request.num_output_placeholders:
        return False
    max_tokens = request.sampling_params.max_tokens
    num_output = request.num_output_tokens + request.num_output_placeholders
    return ((max_tokens is not None and num_output >= max_tokens)
            or request.num_tokens_with_placeholders >= limit)


def _stop_token(request: Request) -> int | None:
    """The stop token id that finished ``request`` (None for EOS, like vLLM)."""
    last = request.output_token_ids[-1]
    params = request.sampling_params
    is_eos = not params.ignore_eos and last in request.eos_token_ids
    return last if last in params.stop_token_ids and not is_eos else None
