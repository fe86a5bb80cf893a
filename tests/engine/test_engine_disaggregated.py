"""Disaggregated prefill/decode between two in-process engines: the prefill
engine exports a prompt's blocks, the decode engine adopts them and
decodes; the greedy output equals an engine that computed everything, and
both engines free every block. (The Ray path: tests/e2e.)"""

from __future__ import annotations

import pytest

from engine_harness import BLOCK, TEXTS, full_block_tokens, greedy
from kvserve.config import SchedulerConfig

pytestmark = pytest.mark.model

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def decode_engine(engine_loop):
    """The shared 16-token-budget engine: adopts the blocks, computes the
    prompt's last partial block in one chunk."""
    return engine_loop.get(scheduler=SchedulerConfig(max_num_batched_tokens=16))


def disaggregated(prefill, decode, prompt, max_tokens=MAX_TOKENS):
    """Prefill on one engine, decode on the other; returns (export, result)."""
    request_id = prefill.new_id("pd")

    async def go():
        future = prefill.engine.expect_kv_export(request_id)
        first = await prefill.agenerate(prompt, greedy(1, export_kv=True), request_id)
        assert first.only.finish_reason in ("length", "stop")
        exported = await future
        decode.engine.import_kv(request_id, exported.block_hashes, exported.data)
        return exported, await decode.agenerate(prompt, greedy(max_tokens), request_id)
    return prefill.run(go())


@pytest.mark.slow
def test_disaggregated_output_equals_aggregated_and_frees_both_sides(
        default_engine, decode_engine, no_prefix_engine):
    prompt = default_engine.encode("Disaggregated. " + TEXTS["long_prefix"])
    reference = no_prefix_engine.generate(prompt, greedy(MAX_TOKENS)).only.token_ids
    exported, result = disaggregated(default_engine, decode_engine, prompt)

    assert len(exported.block_hashes) == len(prompt) // BLOCK
    assert exported.data.shape[0] == len(prompt) // BLOCK
    assert result.only.token_ids == reference
    assert result.only.num_cached_tokens[-1] == full_block_tokens(len(prompt))
    decode_text = decode_engine.engine.metrics.render().decode()
    prefill_text = default_engine.engine.metrics.render().decode()
    assert 'kvserve:kv_transfer_blocks_total{direction="import",model_name=' in decode_text
    assert 'direction="export"' in prefill_text
    assert decode_engine.engine.core.runner.kv_connector.num_imports == 0
    default_engine.assert_all_blocks_free()
    decode_engine.assert_all_blocks_free()


def test_an_import_whose_blocks_are_cached_already_loads_nothing(default_engine, decode_engine):
    prompt = default_engine.encode("Disaggregated twice. " + TEXTS["repeat"] * 4)
    _, first = disaggregated(default_engine, decode_engine, prompt)
    _, second = disaggregated(default_engine, decode_engine, prompt)
    assert first.only.token_ids == second.only.token_ids
    assert second.only.num_cached_tokens[-1] == full_block_tokens(len(prompt))
    assert decode_engine.engine.core.runner.kv_connector.num_imports == 0
    default_engine.assert_all_blocks_free()
    decode_engine.assert_all_blocks_free()
