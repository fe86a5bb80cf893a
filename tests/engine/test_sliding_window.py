"""Sliding-window layers in the paged KV cache (issue 30): a request far
longer than the window holds fewer blocks than it would with every layer
full, and freeing those blocks changes none of its output.

The tiny random Gemma 3 (``tests/model/tiny_gemma.py``: 4 layers, sliding,
sliding, full, sliding; window 8) behind a real scheduler and runner,
stepped by hand, with 4-token blocks and an 8-token step budget (chunked
prefill). A probe of 90 tokens runs beside companions that take the blocks
its sliding layers free. The control is the same engine whose block manager
frees nothing (every group treated as full), so each request keeps every
block: the "all-global" cost. Both run with ``--batch-invariant``, so that
the two runs' different batches cannot move a logit: the probe's tokens and
log-probabilities must be bit-identical.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from tiny_gemma import TinyGemmaSpec, write_tiny_gemma  # noqa: E402
from tiny_llama import write_byte_tokenizer  # noqa: E402

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from kvserve.core.kv_cache_manager import KVCacheManager  # noqa: E402
from kvserve.core.request import Request  # noqa: E402
from kvserve.core.sampling_params import SamplingParams  # noqa: E402
from kvserve.engine import build_engine_core  # noqa: E402
from kvserve.model.input_batch import InputBatch  # noqa: E402

BS = 4
PROMPT = [(11 * j + 7) % 250 + 2 for j in range(30)]
OUTPUT = 60


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-gemma-sw")
    return write_byte_tokenizer(write_tiny_gemma(folder, TinyGemmaSpec()))


#: Bytes of one block (one layer of 4, 4 tokens): 4 x 2 x 1 KV head x
#: (32 x 4 bytes) in float32 (1 KiB); x (32 + 4) bytes in int8 (codes and a
#: scale).
BLOCK_BYTES = {"auto": 4 * 2 * 1 * 32 * 4, "int8": 4 * 2 * 1 * (32 + 4)}


def _core(folder, free_behind_window: bool, kv_cache_dtype: str = "auto"):
    core = build_engine_core(EngineConfig(
        model=str(folder), num_threads=1, batch_invariant=True,
        # 120 blocks, so that freed blocks are soon taken by others
        cache=CacheConfig(block_size=BS, kv_cache_memory=120 * BLOCK_BYTES[kv_cache_dtype],
                          kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=8, max_model_len=96,
                                  async_scheduling=False)))
    manager = core.scheduler.kv_cache_manager
    assert manager.num_groups == 4 and manager.windows == (None, 8, 8, 8)
    assert manager.pool.num_blocks == 120
    if not free_behind_window:  # the control: the same groups, nothing ever freed
        core.scheduler.kv_cache_manager = KVCacheManager(
            manager.pool.num_blocks, BS, windows=(None,) * 4)
    return core


def _run(core):
    """The probe's tokens and log-probabilities, the most blocks it held at
    once, and whether a block its sliding layers freed was written by a
    companion while the probe still ran."""
    manager = core.scheduler.kv_cache_manager
    probe = Request("probe", list(PROMPT), SamplingParams(
        temperature=0.0, max_tokens=OUTPUT, ignore_eos=True, logprobs=0), eos_token_ids=(1,))
    others = [Request(f"o{i}", [(5 * i + 3 * j) % 250 + 2 for j in range(10 + 7 * i)],
                      SamplingParams(temperature=0.0, max_tokens=20 + 9 * i, ignore_eos=True),
                      eos_token_ids=(1,)) for i in range(5)]
    for request in [probe, *others[:2]]:
        core.scheduler.add_request(request)
    pending, logprobs, peak, once_probes, reused = others[2:], [], 0, set(), False
    for step in range(2000):
        if not core.scheduler.has_unfinished_requests():
            break
        if step % 6 == 5 and pending:  # companions keep arriving while the probe runs
            core.scheduler.add_request(pending.pop(0))
        out = core.scheduler.schedule()
        result = core.runner.execute(out)
        tables = {rid: [b for b in blocks if b is not manager.null_block]
                  for rid, blocks in manager.req_to_blocks.items()}
        mine = {b.block_id for b in tables.get("probe", ())}
        peak = max(peak, len(mine))
        if "probe" in tables:
            written = {b for chunk in out.scheduled if chunk.request_id != "probe"
                       for b in core.scheduler._written_blocks([chunk])}
            reused |= bool(written & (once_probes - mine))
            once_probes |= mine
        if "probe" in result.sampled:
            logprobs += [entry[0] for entry in result.logprobs["probe"]]
        core.scheduler.update_from_output(out, result.sampled, result.draft_token_ids)
    assert not core.scheduler.has_unfinished_requests()
    manager.check_consistency()
    return list(probe.output_token_ids), logprobs, peak, reused


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_long_request_frees_its_sliding_blocks_and_its_output_is_unchanged(gemma,
                                                                            kv_cache_dtype):
    """Also over an int8 cache (``--kv-cache-dtype int8``): a freed block
    taken by a companion holds its codes and scales, which the probe's
    windows never read."""
    tokens, logprobs, peak, reused = _run(_core(gemma, True, kv_cache_dtype))
    ref_tokens, ref_logprobs, ref_peak, _ = _run(_core(gemma, False, kv_cache_dtype))
    assert len(tokens) == OUTPUT
    assert tokens == ref_tokens and logprobs == ref_logprobs  # bit-identical
    # 90 tokens = 23 blocks. All layers full: 4 groups x 23 = 92 blocks.
    assert ref_peak == 4 * 23
    # Freeing: the full group 23; each sliding group at most the window
    # behind a step's first token (7) and the step (8 tokens): ceil(15 / 4)
    # + 1 = 5 blocks, so 23 + 3 x 5 = 38 at most.
    assert peak <= 23 + 3 * 5
    assert reused, "no companion wrote a block the probe's sliding layers had freed"


def test_the_runner_reads_each_group_from_its_interleaved_columns():
    """The flat table's logical block j of group g at entry j * G + g."""
    batch = InputBatch(BS, num_groups=2)
    batch.add("r", list(range(10)), [10, 20, 11, 21, 12, 22])  # (full, sliding) per block

    class Chunk:
        request_id, num_tokens, start_position, sample = "r", 10, 0, True

    built = batch.build([Chunk()])
    np.testing.assert_array_equal(built.block_tables, [[10, 11, 12]])
    (slots, table), = built.group_tables
    np.testing.assert_array_equal(table, [[20, 21, 22]])
    # position 5 is in logical block 1, offset 1
    assert built.slot_mapping[5] == 11 * BS + 1 and slots[5] == 21 * BS + 1


def test_what_does_not_take_sliding_layers_yet_is_refused_in_one_line(gemma):
    from kvserve.cli import _check_disaggregation
    from kvserve.config import SpeculativeConfig
    from kvserve.startup import check_before_load

    with pytest.raises(ValueError, match="--kv-offloading-size does not take such a model"):
        check_before_load(EngineConfig(model=str(gemma),
                                       cache=CacheConfig(kv_offloading_size=0.5)))
    with pytest.raises(ValueError, match="--speculative-config does not take such a model"):
        check_before_load(EngineConfig(model=str(gemma), scheduler=SchedulerConfig(
            speculative=SpeculativeConfig())))
    with pytest.raises(ValueError, match="--prefill-replicas does not take such a model"):
        _check_disaggregation(EngineConfig(model=str(gemma)))
    check_before_load(EngineConfig(model=str(gemma)))  # the model itself is fine
