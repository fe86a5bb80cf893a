"""Property test: random add / step / abort / finish sequences against the
scheduler + KV cache manager never double-free, never leak, keep ref counts
equal to the block tables, respect the limits, and end with every block free."""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager, cdiv
from kvserve.core.request import Request, RequestStatus
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.request_queue import priority_key
from kvserve.core.scheduler import Scheduler

BS = 4
EOS, STOP, GEN = 2, 3, 1000
# the second prefix is the first with one token changed (a "timestamp"), so
# the cache-miss explainer has divergences to report
PREFIXES = ([10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
            [10, 99, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30] * 12, [])


class SchedulerMachine(RuleBasedStateMachine):
    """Drives one scheduler with a fake runner that samples drawn tokens."""

    @initialize(policy=st.sampled_from(["fcfs", "priority"]), num_blocks=st.integers(3, 12),
                budget=st.integers(1, 24), max_seqs=st.integers(1, 4), caching=st.booleans())
    def setup(self, policy, num_blocks, budget, max_seqs, caching):
        self.manager = KVCacheManager(num_blocks, BS, caching)
        self.config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                      max_model_len=40, policy=policy)
        self.sched = Scheduler(self.config, self.manager, BS)
        self.count = 0
        self.diverged = set()
        self.tables: dict[str, list[int]] = {}  # block tables as the deltas build them

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

    @rule(data=st.data())
    def step(self, data):
        out = self.sched.schedule()
        self._check_output(out)
        sampled = {s.request_id: [data.draw(st.sampled_from([GEN, GEN, EOS, STOP]))]
                   for s in out.scheduled if s.sample}
        for update in self.sched.update_from_output(out, sampled):
            assert update.new_token_ids or update.finished

    @rule(data=st.data(), status=st.sampled_from([RequestStatus.FINISHED_ABORTED,
                                                  RequestStatus.FINISHED_STOPPED]))
    def finish(self, data, status):
        live = sorted(self.sched.requests)
        if live:
            rid = data.draw(st.sampled_from(live))
            (update,) = self.sched.finish_requests([rid], status)
            assert update.finish_reason is status.finish_reason
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
            assert s.start_position == req.num_computed_tokens
            end = s.start_position + s.num_tokens
            assert s.num_tokens >= 1 and end <= req.num_tokens
            # The deltas rebuild the block table the KV cache manager holds.
            if s.is_new:
                self.tables[s.request_id] = []
            self.tables[s.request_id] += s.new_block_ids
            table = self.manager.get_block_ids(s.request_id)
            assert self.tables[s.request_id] == table and len(table) * BS >= end
            assert s.sample == (end == req.num_tokens)
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
        for req in self.sched.waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert req.num_computed_tokens == 0
        assert len(running) + len(self.sched.waiting) == len(self.sched.requests)
        assert len(running) <= self.config.max_num_seqs

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(2000):
            if not self.sched.has_unfinished_requests():
                break
            out = self.sched.schedule()
            self._check_output(out)
            self.sched.update_from_output(
                out, {s.request_id: [GEN] for s in out.scheduled if s.sample})
            self.blocks_consistent()
        assert not self.sched.has_unfinished_requests(), "requests never finished"
        assert self.manager.num_free_blocks == self.manager.num_blocks
        assert self.manager.usage == 0.0 and not self.manager.req_to_blocks


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestSchedulerMachine = SchedulerMachine.TestCase
