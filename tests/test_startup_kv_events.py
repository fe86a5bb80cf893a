"""Issue 49 item 4: a replica's KV event log reaches the block pool through
the scheduler's construction (``build_engine_core(kv_events=...)``), not by
planting it in a live engine's pool.

The scheduler is built the way start-up builds it (``_build_scheduler``); a
request of three full blocks runs one step; the log must hold their three
hashes, computed here by ``hash_request_blocks`` as the router does."""

from __future__ import annotations

from types import SimpleNamespace

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.core.block_hash import hash_request_blocks
from kvserve.core.kv_events import BlockStored, KVEventLog
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.startup import _build_scheduler

BS = 16


def test_the_scheduler_built_at_start_up_records_block_events_in_the_given_log():
    events = KVEventLog()
    config = EngineConfig(model="unused", cache=CacheConfig(enable_prefix_caching=True),
                          scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4,
                                                    max_model_len=256))
    plan = SimpleNamespace(num_blocks=32, block_size=BS, layout=None, max_model_len=256)
    scheduler = _build_scheduler(config, plan, layout=None, connector=None, kv_events=events)
    prompt = list(range(100, 100 + 3 * BS + 5))
    scheduler.add_request(Request("r", prompt, SamplingParams(max_tokens=2)))
    output = scheduler.schedule()
    scheduler.update_from_output(output, {"r": [7]}, {})
    stored = [h for e in events.drain() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == list(hash_request_blocks(prompt, BS)[:3])


def test_without_a_log_nothing_is_recorded():
    config = EngineConfig(model="unused")
    plan = SimpleNamespace(num_blocks=8, block_size=BS, layout=None, max_model_len=64)
    scheduler = _build_scheduler(config, plan, layout=None, connector=None)
    assert scheduler.kv_cache_manager.pool.events is None
