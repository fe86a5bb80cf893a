"""Model-parallel layouts (issue 32): pipeline stages' layers and tensor-
parallel workers' heads, against vLLM's split and by-hand head ranges.

Reference for the default split: vLLM's ``get_pp_indices``
(vllm-project/vllm, ``vllm/distributed/utils.py``, commit 5a6541db):
``partitions = [L // P] * P``; then ``for i in range(2, L % P + 2):
partitions[-i] += 1``. Worked by hand for SmolLM2-135M's 30 layers:
P=2: [15, 15]; P=3: [10, 10, 10]; P=4: 30 // 4 = 7, remainder 2 goes to
partitions[-2] and [-3]: [7, 8, 8, 7]; P=7: 4 each, remainder 2: [4, 4, 4,
4, 5, 5, 4]. 31 layers over 4: remainder 3: [8, 8, 8, 7].
"""

import pytest

from kvserve.core.parallel import (HeadShard, parse_partition, pp_layer_ranges,
                                   tp_column_split, tp_head_shards)


def sizes_to_ranges(sizes):
    """[15, 15] -> [range(0, 15), range(15, 30)] (written out, not the code under test)."""
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


@pytest.mark.parametrize("num_layers, stages, vllm_partitions", [
    (30, 1, [30]),
    (30, 2, [15, 15]),
    (30, 3, [10, 10, 10]),
    (30, 4, [7, 8, 8, 7]),
    (30, 7, [4, 4, 4, 4, 5, 5, 4]),
    (31, 4, [8, 8, 8, 7]),
    (30, 30, [1] * 30),
])
def test_default_split_is_vllms_get_pp_indices(num_layers, stages, vllm_partitions):
    assert pp_layer_ranges(num_layers, stages) == sizes_to_ranges(vllm_partitions)


def test_four_stages_of_thirty_layers_written_out():
    assert pp_layer_ranges(30, 4) == [range(0, 7), range(7, 15), range(15, 23), range(23, 30)]


def test_a_partition_replaces_the_split():
    assert pp_layer_ranges(30, 2, (16, 14)) == [range(0, 16), range(16, 30)]
    assert pp_layer_ranges(30, 3, [1, 28, 1]) == [range(0, 1), range(1, 29), range(29, 30)]
    assert parse_partition("16,14") == (16, 14)
    assert parse_partition("30") == (30,)


@pytest.mark.parametrize("layers, stages, partition, message", [
    (30, 0, None, "must be >= 1"),
    (30, 31, None, "31 is more stages than the model's 30 layers"),
    (30, 2, (16, 15), "16,15 must be 2 positive layer counts summing to 30"),
    (30, 2, (16, 14, 0), "must be 2 positive"),
    (30, 2, (31, -1), "must be 2 positive"),
    (30, 2, (30, 0), "must be 2 positive"),
    (30, 1, (16, 14), "must be 1 positive"),
])
def test_layout_errors(layers, stages, partition, message):
    with pytest.raises(ValueError, match=message):
        pp_layer_ranges(layers, stages, partition)


@pytest.mark.parametrize("text", ["16;14", "a,b", "16,,14", "", "16.0,14"])
def test_partition_text_errors(text):
    with pytest.raises(ValueError, match="comma-separated layer counts"):
        parse_partition(text)


def test_head_shards_of_nine_heads_over_three_kv_heads():
    """SmolLM2-135M: 9 query heads in 3 GQA groups of 3."""
    assert tp_head_shards(9, 3, 1) == [HeadShard(0, range(0, 9), range(0, 3))]
    # T=2: KV heads [0 * 3 // 2, 1 * 3 // 2) = [0, 1) and [1, 3); uneven, none stored twice.
    assert tp_head_shards(9, 3, 2) == [HeadShard(0, range(0, 3), range(0, 1)),
                                       HeadShard(1, range(3, 9), range(1, 3))]
    assert tp_head_shards(9, 3, 3) == [HeadShard(0, range(0, 3), range(0, 1)),
                                       HeadShard(1, range(3, 6), range(1, 2)),
                                       HeadShard(2, range(6, 9), range(2, 3))]


def test_more_workers_than_kv_heads_replicate_as_vllm():
    """8 heads / 2 KV heads at T=4: each KV head on 4 / 2 = 2 workers, each
    worker 4 / 2 = 2 of its group's query heads."""
    assert tp_head_shards(8, 2, 4) == [
        HeadShard(0, range(0, 2), range(0, 1), replicated=True),
        HeadShard(1, range(2, 4), range(0, 1), replicated=True),
        HeadShard(2, range(4, 6), range(1, 2), replicated=True),
        HeadShard(3, range(6, 8), range(1, 2), replicated=True)]


@pytest.mark.parametrize("heads, kv_heads, workers, message", [
    (9, 3, 0, "must be >= 1"),
    (9, 2, 1, "not groups of 2 KV heads"),
    (9, 3, 4, "4 with 3 KV heads"),       # 4 > 3 KV heads and 4 % 3 != 0
    (6, 2, 4, "4 with 2 KV heads"),       # 4 % 2 == 0 but a group of 3 does not split in 2
    (9, 3, 10, "10 is more workers than the model's 9 attention heads"),
])
def test_head_shard_errors(heads, kv_heads, workers, message):
    with pytest.raises(ValueError, match=message):
        tp_head_shards(heads, kv_heads, workers)


def test_column_split():
    assert tp_column_split(1536, 1) == [range(0, 1536)]
    assert tp_column_split(1536, 2) == [range(0, 768), range(768, 1536)]
    assert tp_column_split(10, 3) == [range(0, 4), range(4, 7), range(7, 10)]
