"""Property test: random add / schedule / complete / abort / finish sequences
against the scheduler + KV cache manager, with one or two steps in flight
(async scheduling), never double-free, never leak, keep ref counts equal to
the block tables, respect the limits, never emit a token past a request's
stop, feed the runner's persistent batch the right token ids, and end with
every block free."""

from collections import deque

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager, cdiv
from kvserve.core.request import Request, RequestStatus
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.request_queue import priority_key
from kvserve.core.scheduler import Scheduler
from kvserve.model.input_batch import InputBatch

BS = 4
EOS, STOP, GEN = 2, 3, 1000
# the second prefix is the first with one token changed (a "timestamp"), so
# the cache-miss explainer has divergences to report
PREFIXES = ([10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
            [10, 99, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30] * 12, [])


class SchedulerMachine(RuleBasedStateMachine):
    """Drives one scheduler with a fake runner that samples drawn tokens into
    a real ``InputBatch``, with up to ``max_in_flight`` steps scheduled."""

    @initialize(policy=st.sampled_from(["fcfs", "priority"]), num_blocks=st.integers(3, 12),
                budget=st.integers(1, 24), max_seqs=st.integers(1, 4), caching=st.booleans(),
                max_in_flight=st.sampled_from([1, 2]))
    def setup(self, policy, num_blocks, budget, max_seqs, caching, max_in_flight):
        self.manager = KVCacheManager(num_blocks, BS, caching)
        self.config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                      max_model_len=40, policy=policy)
        self.sched = Scheduler(self.config, self.manager, BS)
        self.max_in_flight = max_in_flight
        self.in_flight = deque()
        self.batch = InputBatch(BS, rows=2, tokens=8, blocks=2)
        self.count = 0
        self.diverged = set()
        self.tables: dict[str, list[int]] = {}  # block tables as the deltas build them
        self.emitted: dict[str, int] = {}  # request id -> output tokens streamed
        self.done: set[str] = set()  # finished requests: nothing may follow

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), prefix_len=st.integers(0, 12),
          tail=st.lists(st.integers(4, 9), max_size=10), max_tokens=st.integers(1, 6),
          min_tokens=st.integers(0, 2), priority=st.integers(0, 2))
    def add(self, prefix, prefix_len, tail, max_tokens, min_tokens, priority):
        prompt = PREFIXES[prefix][:prefix_len] + tail
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens),
                                stop_token_ids=(STOP,))
        self.count += 1
        self.sched.add_request(Request(f"r{self.count}", prompt, params,
                                       arrival_time=float(self.count), priority=priority,
                                       eos_token_ids=(EOS,)))

    @rule()
    def schedule(self):
        if len(self.in_flight) < self.max_in_flight:
            out = self.sched.schedule()
            self._check_output(out)
            self.in_flight.append(out)

    @rule(data=st.data())
    def complete(self, data):
        """The oldest step in flight runs on the fake runner and returns."""
        if self.in_flight:
            out = self.in_flight.popleft()
            self._apply(out, self._run(out, lambda: data.draw(
                st.sampled_from([GEN, GEN, EOS, STOP]))))

    def _run(self, out, draw):
        """The runner's side: deltas into the persistent batch, whose input ids
        must be the request's tokens (those sampled by a step in flight
        included), then one drawn token per sampling chunk."""
        self.batch.apply(out)
        if out.scheduled:
            built = self.batch.build(out.scheduled)
            offset = 0
            for s in out.scheduled:
                ids = built.input_ids[offset:offset + s.num_tokens].tolist()
                offset += s.num_tokens
                req = self.sched.requests.get(s.request_id)
                if req is not None and req.status is RequestStatus.RUNNING:
                    assert ids == req.all_token_ids[s.start_position:s.start_position
                                                    + s.num_tokens]
        sampled = {s.request_id: [draw()] for s in out.scheduled if s.sample}
        for rid, tokens in sampled.items():
            self.batch.append_tokens(rid, tokens)
        return sampled

    def _apply(self, out, sampled):
        for update in self.sched.update_from_output(out, sampled):
            assert update.new_token_ids or update.finished
            self._record(update)

    def _record(self, update):
        rid = update.request_id
        assert rid not in self.done, "an update after the request finished"
        self.emitted[rid] = self.emitted.get(rid, 0) + len(update.new_token_ids)
        assert self.emitted[rid] == update.num_output_tokens
        if update.finished:
            self.done.add(rid)

    @rule(data=st.data(), status=st.sampled_from([RequestStatus.FINISHED_ABORTED,
                                                  RequestStatus.FINISHED_STOPPED]))
    def finish(self, data, status):
        live = sorted(self.sched.requests)
        if live:
            rid = data.draw(st.sampled_from(live))
            (update,) = self.sched.finish_requests([rid], status)
            assert update.finish_reason is status.finish_reason
            self._record(update)
            assert rid not in self.manager.req_to_blocks

    def _check_output(self, out):
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        assert out.num_batched_tokens == sum(s.num_tokens for s in out.scheduled)
        assert len(out.scheduled) <= self.config.max_num_seqs
        ids = [s.request_id for s in out.scheduled]
        assert len(set(ids)) == len(ids)
        assert not set(ids) & {p.request_id for p in out.preemptions}
        if out.preemptions and self.config.policy == "fcfs":
            assert not out.new_requests
        if out.preemptions and self.config.policy == "priority":
            # Only requests that go before every preempted one may be admitted.
            worst_new = max((self._key(n.request_id) for n in out.new_requests), default=None)
            best_preempted = min(self._key(p.request_id) for p in out.preemptions)
            assert worst_new is None or worst_new <= best_preempted
        self._check_divergences(out)
        seen_prefill = False
        for s in out.scheduled:
            req = self.sched.requests[s.request_id]
            end = s.start_position + s.num_tokens
            assert req.num_computed_tokens == end  # advanced when scheduled
            known = req.num_tokens_with_placeholders - s.sample
            assert s.num_tokens >= 1 and end <= known
            assert req.num_output_placeholders <= len(self.in_flight) + 1
            params = req.sampling_params
            assert req.num_output_tokens + req.num_output_placeholders <= params.max_tokens
            # The deltas rebuild the block table the KV cache manager holds.
            if s.is_new:
                self.tables[s.request_id] = []
            self.tables[s.request_id] += s.new_block_ids
            table = self.manager.get_block_ids(s.request_id)
            assert self.tables[s.request_id] == table and len(table) * BS >= end
            assert s.sample == (end == known)
            is_decode = not s.is_new and s.start_position >= req.num_prompt_tokens
            assert not (seen_prefill and is_decode), "a decode after a prefill chunk"
            seen_prefill = seen_prefill or not is_decode

    def _key(self, request_id):
        return priority_key(self.sched.requests[request_id])

    def _check_divergences(self, out):
        first = set(out.first_scheduled_request_ids)
        for d in out.divergences:
            req = self.sched.requests[d.request_id]
            assert d.request_id in first and d.request_id not in self.diverged
            self.diverged.add(d.request_id)
            assert d.hit_tokens == req.num_cached_tokens and d.hit_tokens % BS == 0
            assert d.hit_tokens <= d.position < d.hit_tokens + BS
            assert d.hit_tokens < d.would_hit_tokens <= (req.num_prompt_tokens - 1) // BS * BS
        assert self.manager.stats.divergences == len(self.diverged)

    @invariant()
    def blocks_consistent(self):
        if not hasattr(self, "sched"):
            return
        self.manager.check_consistency()
        free, cached_free, in_use = self.manager.pool.count_blocks()
        assert free + cached_free + in_use == self.manager.num_blocks
        running = {r.request_id for r in self.sched.running}
        assert set(self.manager.req_to_blocks) == running
        for req in self.sched.running:
            assert req.status is RequestStatus.RUNNING
            held = len(self.manager.get_block_ids(req.request_id))
            assert held >= cdiv(req.num_computed_tokens, BS)
        for req in self.sched.staged:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert req.num_computed_tokens == 0 and req.num_output_placeholders == 0
        assert len(running) + len(self.sched.staged) == len(self.sched.requests)
        assert len(running) <= self.config.max_num_seqs

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(2000):
            if not self.sched.has_unfinished_requests() and not self.in_flight:
                break
            self.schedule()
            out = self.in_flight.popleft()
            self._apply(out, self._run(out, lambda: GEN))
            self.blocks_consistent()
        assert not self.sched.has_unfinished_requests(), "requests never finished"
        assert self.manager.num_free_blocks == self.manager.num_blocks
        assert self.manager.usage == 0.0 and not self.manager.req_to_blocks


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestSchedulerMachine = SchedulerMachine.TestCase
