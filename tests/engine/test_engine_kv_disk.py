"""The disk KV tier outlives a restart: an engine serves a prompt (its blocks
are written through to disk), stops; a fresh engine (a new, empty memory
tier) on the same folder loads the prompt's prefix from disk instead of
computing it, with the same greedy tokens, fewer prefill tokens than the
cold run, and disk hits in its statistics and metrics."""

from __future__ import annotations

import pytest

from engine_harness import BLOCK, BLOCK_BYTES, TEXTS, full_block_tokens, greedy
from kvserve.config import CacheConfig
from kvserve.observability.metrics import parse_metrics_text

pytestmark = pytest.mark.model

MAX_TOKENS = 6
CACHE_BLOCKS = 48


def disk_cache(path) -> CacheConfig:
    return CacheConfig(kv_cache_memory=CACHE_BLOCKS * BLOCK_BYTES,
                       kv_offloading_size=32 * BLOCK_BYTES / 2**30,
                       kv_offloading_backend="disk", kv_offloading_path=str(path),
                       kv_offloading_disk_size=64 * BLOCK_BYTES / 2**30)


def _metric(handle, name: str, tier: str) -> float:
    samples = parse_metrics_text(handle.engine.metrics.render().decode())
    return sum(value for labels, value in samples[f"kvserve:{name}_total"]
               if labels.get("tier") == tier)


def _serve(engine_loop, path, text):
    handle = engine_loop.start(engine_loop.config(cache=disk_cache(path)))
    try:  # the start-up check of the files found runs in the background
        assert handle.engine.core.runner.kv_connector.disk.wait_verified(timeout=120)
        prompt = handle.encode(text)
        assert 8 * BLOCK < len(prompt) < 20 * BLOCK
        with handle.record_steps() as steps:
            result = handle.generate(prompt, greedy(MAX_TOKENS)).only
            handle.wait_idle()
        stats = handle.kv.stats
        seen = (prompt, result, list(steps), stats.external_hits, stats.external_disk_hits,
                _metric(handle, "kv_offload_hits", "disk"),
                _metric(handle, "kv_offload_queries", "disk"))
        handle.assert_all_blocks_free()
    finally:
        engine_loop.stop(handle)
    return seen


def test_a_prefix_computed_before_a_restart_is_loaded_from_disk(engine_loop, tmp_path):
    text = "Disk tier. " + TEXTS["long_prefix"]
    prompt, cold, cold_steps, *_ = _serve(engine_loop, tmp_path, text)
    assert cold.num_cached_tokens[-1] == 0
    files = list(tmp_path.glob("*/*.kv"))
    assert len(files) >= full_block_tokens(len(prompt)) // BLOCK

    _, warm, warm_steps, memory_hits, disk_hits, metric_hits, metric_queries = _serve(
        engine_loop, tmp_path, text)
    reused = full_block_tokens(len(prompt))
    assert warm.token_ids == cold.token_ids
    assert warm.num_cached_tokens[-1] == reused
    assert (memory_hits, disk_hits) == (0, reused)
    assert (metric_hits, metric_queries) == (reused, reused)
    loading = [s for s in warm_steps if s.kv_loads]
    assert len(loading) == 1 and len(loading[0].kv_loads) == reused // BLOCK
    assert sum(s.num_prefill_tokens for s in cold_steps) == len(prompt)
    assert loading[0].num_prefill_tokens == len(prompt) - reused
    assert sum(s.num_prefill_tokens for s in warm_steps) == len(prompt) - reused



#: Enough room for a 2,000-token prompt in the cache, the memory tier and on disk.
LONG_CACHE_BLOCKS = 160


def long_disk_cache(path) -> CacheConfig:
    return CacheConfig(kv_cache_memory=LONG_CACHE_BLOCKS * BLOCK_BYTES,
                       kv_offloading_size=LONG_CACHE_BLOCKS * BLOCK_BYTES / 2**30,
                       kv_offloading_backend="disk", kv_offloading_path=str(path),
                       kv_offloading_disk_size=2 * LONG_CACHE_BLOCKS * BLOCK_BYTES / 2**30)


@pytest.mark.slow
def test_a_2000_token_prefix_survives_a_restart_and_a_corrupt_file_is_skipped(engine_loop,
                                                                               tmp_path):
    """Issue 31's acceptance: a server computes a 2,000-token prompt; one of
    its block files is corrupted while the server is down (a bit flipped in
    the payload, size and header intact); the restarted server's start-up
    check removes that file with a log line, and the same prompt then loads
    every block before it from disk (``cached_tokens`` counts them: only the
    tail from the corrupt block on is computed) with the same answer."""
    from structlog.testing import capture_logs

    from kvserve.core.block_hash import hash_request_blocks

    text = " ".join(f"Section {i}. {TEXTS['long_prefix']}" for i in range(12))
    handle = engine_loop.start(engine_loop.config(cache=long_disk_cache(tmp_path)))
    try:
        prompt = handle.encode(text)[:2000]
        assert len(prompt) == 2000
        cold = handle.generate(prompt, greedy(MAX_TOKENS)).only
        handle.wait_idle()
        assert cold.num_cached_tokens[-1] == 0
        disk = handle.engine.core.runner.kv_connector.disk
        disk.flush()
        hashes = hash_request_blocks(prompt, BLOCK)
        assert all(disk.path_of(block_hash).exists() for block_hash in hashes)
    finally:
        engine_loop.stop(handle)

    bad = 100  # block 100 of 125: tokens 1,600-1,615
    path = disk.path_of(hashes[bad])
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0x10
    path.write_bytes(bytes(raw))

    with capture_logs() as logs:
        handle = engine_loop.start(engine_loop.config(cache=long_disk_cache(tmp_path)))
        disk = handle.engine.core.runner.kv_connector.disk
        assert disk.wait_verified(timeout=120)
    try:
        with handle.record_steps() as steps:
            warm = handle.generate(prompt, greedy(MAX_TOKENS)).only
            handle.wait_idle()
        assert warm.token_ids == cold.token_ids
        assert warm.num_cached_tokens[-1] == bad * BLOCK
        assert handle.kv.stats.external_disk_hits == bad * BLOCK
        assert sum(s.num_prefill_tokens for s in steps) == len(prompt) - bad * BLOCK
        disk.flush()  # the recomputed block was written through again, intact
        assert path.read_bytes() != bytes(raw) and disk.read(hashes[bad]).size
        handle.assert_all_blocks_free()
    finally:
        engine_loop.stop(handle)
    verified = [e for e in logs if e["event"] == "kv_offload_disk_verified"]
    assert len(verified) == 1 and verified[0]["removed"] == {"checksum": 1}


def test_a_block_lost_between_look_up_and_load_is_recomputed_not_an_error(engine_loop,
                                                                         tmp_path):
    """Issue 47 item 10: a block file another process removes after the
    look-up found it (a smaller server's eviction, a person's ``rm``) fails
    the load; the request starts again from its prompt (a preemption,
    reason ``kv_load_lost``), the look-up now stops at the lost block, and
    the answer is the cold run's, with no error."""
    from structlog.testing import capture_logs

    from kvserve.core.block_hash import hash_request_blocks

    text = "Lost block. " + TEXTS["long_prefix"]
    prompt, cold, *_ = _serve(engine_loop, tmp_path, text)
    handle = engine_loop.start(engine_loop.config(cache=disk_cache(tmp_path)))
    try:
        disk = handle.engine.core.runner.kv_connector.disk
        assert disk.wait_verified(timeout=120)
        hashes = hash_request_blocks(prompt, BLOCK)
        lost = 3
        assert disk.lookup(hashes, lease_seconds=-1) == full_block_tokens(len(prompt)) // BLOCK
        disk.path_of(hashes[lost]).unlink()  # still indexed: the look-up will find it
        with capture_logs() as logs, handle.record_steps() as steps:
            warm = handle.generate(prompt, greedy(MAX_TOKENS)).only
            handle.wait_idle()
        assert warm.error is None and warm.token_ids == cold.token_ids
        preempted = [e for e in logs if e["event"] == "request_preempted"]
        assert [e["reason"] for e in preempted] == ["kv_load_lost"]
        loads = [len(s.kv_loads) for s in steps if s.kv_loads]
        assert loads == [full_block_tokens(len(prompt)) // BLOCK, lost]
        assert not [e for e in logs if e["event"] == "step_failed"]
        handle.assert_all_blocks_free()
    finally:
        engine_loop.stop(handle)
