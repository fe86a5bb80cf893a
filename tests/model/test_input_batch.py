"""The persistent input batch against a fresh rebuild.

A hypothesis state machine drives the real scheduler and KV cache manager
with random additions, aborts, stops and preemptions (a small cache); the
input batch follows only the per-step deltas (and the tokens "sampled"), as
the runner does. Every step, its flat batch must equal one rebuilt from
scratch from the scheduler's own state: each chunk's token ids from the
request's tokens, its block table from the KV cache manager.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.scheduler import Scheduler
from kvserve.model.input_batch import InputBatch

BS = 4
EOS = 1


def fresh_batch(sched: Scheduler, scheduled) -> dict[str, np.ndarray]:
    """The flat batch rebuilt from the scheduler's state alone."""
    ids, pos, slots, tables, lens, qsl, sample_rows = [], [], [], [], [], [0], []
    for chunk in scheduled:
        request = sched.requests[chunk.request_id]
        table = sched.kv_cache_manager.get_block_ids(chunk.request_id)
        start, end = chunk.start_position, chunk.start_position + chunk.num_tokens
        ids += request.all_token_ids[start:end]
        pos += list(range(start, end))
        slots += [table[p // BS] * BS + p % BS for p in range(start, end)]
        tables.append(table)
        lens.append(end)
        qsl.append(qsl[-1] + chunk.num_tokens)
        if chunk.sample:
            sample_rows.append(qsl[-1] - 1)
    width = max(len(t) for t in tables)
    return {"input_ids": np.array(ids), "positions": np.array(pos),
            "slot_mapping": np.array(slots), "seq_lens": np.array(lens),
            "query_start_loc": np.array(qsl), "logits_indices": np.array(sample_rows),
            "block_tables": [t + [None] * (width - len(t)) for t in tables]}


class InputBatchMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 14), budget=st.integers(1, 20),
                max_seqs=st.integers(1, 4), caching=st.booleans())
    def setup(self, num_blocks, budget, max_seqs, caching):
        manager = KVCacheManager(num_blocks, BS, caching)
        self.sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget,
                                               max_num_seqs=max_seqs, max_model_len=36), manager)
        self.batch = InputBatch(BS, rows=1, tokens=4, blocks=1)  # small: growth is exercised
        self.count = 0

    @rule(prompt=st.lists(st.integers(2, 6), min_size=1, max_size=14),
          max_tokens=st.integers(1, 8))
    def add(self, prompt, max_tokens):
        self.count += 1
        self.sched.add_request(Request(f"r{self.count}", prompt,
                                       SamplingParams(max_tokens=max_tokens),
                                       eos_token_ids=(EOS,)))

    @rule(data=st.data())
    def abort(self, data):
        live = sorted(self.sched.requests)
        if live:
            self.sched.finish_requests([data.draw(st.sampled_from(live))],
                                       RequestStatus.FINISHED_ABORTED)

    @rule(data=st.data())
    def step(self, data):
        out = self.sched.schedule()
        self.batch.apply(out)
        if out.is_empty:
            return
        got = self.batch.build(out.scheduled)
        want = fresh_batch(self.sched, out.scheduled)
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc",
                     "logits_indices"):
            assert getattr(got, name).tolist() == want[name].tolist(), name
        for row, table in zip(got.block_tables.tolist(), want["block_tables"]):
            assert row[:len([b for b in table if b is not None])] == [b for b in table if b is not None]
        sampled = {rid: [data.draw(st.sampled_from([3, 4, 5, EOS]))] for rid in got.sample_ids}
        for rid, tokens in sampled.items():
            self.batch.append_tokens(rid, tokens)  # what the runner does after sampling
        self.sched.update_from_output(out, sampled)

    @invariant()
    def rows_are_the_live_requests_it_was_told_of(self):
        if hasattr(self, "sched"):
            assert set(self.batch.row_of) <= set(self.sched.requests) | set(self.sched._finished_ids)


InputBatchMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestInputBatch = InputBatchMachine.TestCase


def test_growth_keeps_rows_and_reuses_freed_ones():
    batch = InputBatch(4, rows=1, tokens=2, blocks=1)
    batch.add("a", [1, 2, 3], [7])
    batch.add("b", [4], [8, 9])
    batch.append_tokens("a", [5, 6])
    batch.append_blocks("a", [10])
    assert batch.token_ids[batch.row_of["a"], :5].tolist() == [1, 2, 3, 5, 6]
    assert batch.block_table[batch.row_of["a"], :2].tolist() == [7, 10]
    row_b = batch.row_of["b"]
    batch.remove("b")
    batch.add("c", [9], [3])
    assert batch.row_of["c"] == row_b and len(batch) == 2
