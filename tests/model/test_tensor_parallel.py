"""Tensor parallelism on the CPU: the Megatron-LM checkpoint split and the
shared-memory all-reduce (``kvserve.distributed.tensor_parallel``).

The reference is the unsharded ``LlamaModel`` on the same tiny checkpoint:
T workers (threads of this process, each with its own ops, KV cache of its
KV heads and all-reduce handle) must produce its logits, up to float32
rounding of the reordered sums. The tiny model has 6 query heads over 3 KV
heads, so T = 2 is the uneven split (KV heads [0] and [1, 2], SmolLM2's
9 / 3 heads over 2 workers in small), T = 3 the even one and T = 6 vLLM's
replication (each KV head on 2 workers), with q/k/v biases and an untied
LM head; its intermediate size 128 splits unevenly over 3 (43, 43, 42).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import uuid
from collections.abc import Callable
from queue import Empty

import numpy as np
import pytest
from deadlines import HANG_DEADLINE_S, hang_message
from tiny_llama import TinySpec, load_tiny

from kvserve.core.parallel import tp_column_split, tp_head_shards
from kvserve.cpu.ops import CpuOps
from kvserve.distributed.tensor_parallel import ShmAllReduce, shard_checkpoint
from kvserve.model.ggml_blocks import BlockQuantizedWeight
from kvserve.model.llama import AttentionMetadata, LlamaModel

SPEC = TinySpec("tp-6h-3kv", num_attention_heads=6, num_key_value_heads=3, hidden_size=72,
                intermediate_size=128, tied=False, bias=True, seed=7)
BLOCK_SIZE, NUM_BLOCKS = 4, 16
#: max |sharded - unsharded| / max |unsharded logit|: float32 reassociation
#: of the head and column sums only (a wrong slice is O(1)).
REL_TOL = 2e-5
#: (sequence, tokens) per step: two prompts prefilled together, then one
#: decode step of each.
PROMPTS = ([5, 17, 300, 42, 9, 77, 250], [3, 141, 59, 26, 53])
DECODE = (402, 11)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(ModelConfig, float32 weights) of the 6-head / 3-KV-head checkpoint."""
    return load_tiny(tmp_path_factory.mktemp(SPEC.name), SPEC)


def shm_name() -> str:
    return f"kvtp-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def batches(vocab: int) -> list[tuple[np.ndarray, np.ndarray, AttentionMetadata]]:
    """(input_ids, positions, metadata) of the prefill step and the decode
    step; sequence s owns blocks [8 s, 8 s + 8) of the cache."""
    tables = np.arange(2 * 8, dtype=np.int32).reshape(2, 8)[:, ::-1].copy()
    steps = [[(s, 0, len(p)) for s, p in enumerate(PROMPTS)],
             [(s, len(p), len(p) + 1) for s, p in enumerate(PROMPTS)]]
    seqs = [list(p) + [d] for p, d in zip(PROMPTS, DECODE)]
    out = []
    for step in steps:
        toks = np.array([t for s, a, b in step for t in seqs[s][a:b]], np.int64)
        positions = np.concatenate([np.arange(a, b) for _, a, b in step]).astype(np.int64)
        seq_of = np.repeat([s for s, _, _ in step], [b - a for _, a, b in step])
        slots = (tables[seq_of, positions // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE
                 + positions % BLOCK_SIZE)
        qsl = np.cumsum([0] + [b - a for _, a, b in step]).astype(np.int32)
        attn = AttentionMetadata(slot_mapping=slots, block_tables=tables,
                                 seq_lens=np.array([b for _, _, b in step], np.int32),
                                 query_start_loc=qsl)
        out.append((toks % vocab, positions, attn))
    return out


def caches(model: LlamaModel) -> list[np.ndarray]:
    """A KV cache per layer the model holds, of its own KV heads."""
    cfg = model.config
    return [model.ops.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE, cfg.num_key_value_heads,
                                        cfg.head_dim) for _ in model.layers]


def run(model: LlamaModel, intermediate: list | None = None) -> list:
    """Each step's output: logits of every token on a last stage, else the
    stage's (x, residual) (fed ``intermediate[step]``, copied, when given)."""
    kv, outs = caches(model), []
    for i, (toks, pos, attn) in enumerate(batches(model.config.vocab_size)):
        inter = None if intermediate is None else tuple(a.copy() for a in intermediate[i])
        h = model.hidden_states(toks, pos, attn, kv, np.arange(len(toks)), inter)
        outs.append(model.compute_logits(h) if model.is_last else h)
    return outs


def on_ranks(world: int, work: Callable[[int, ShmAllReduce], object]) -> list:
    """``work(rank, all_reduce)`` on ``world`` threads sharing one
    ShmAllReduce segment; their results by rank (a rank's exception raised)."""
    name = shm_name()
    handles = [ShmAllReduce.create(name, world, 64 * 1024, timeout=HANG_DEADLINE_S)]
    handles += [ShmAllReduce.attach(name, r, timeout=HANG_DEADLINE_S) for r in range(1, world)]
    results: list = [None] * world

    def target(rank: int) -> None:
        try:
            results[rank] = work(rank, handles[rank])
        except BaseException as exc:  # re-raised below
            results[rank] = exc

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * HANG_DEADLINE_S)
    finally:
        for h in handles:
            h.close()
        handles[0].unlink()
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:  # the first cause rather than a peer's timeout waiting for it
        first = sorted(errors, key=lambda e: isinstance(e, TimeoutError))[0]
        if isinstance(first, TimeoutError):
            raise AssertionError(hang_message(f"a rank was not done ({first})",
                                              HANG_DEADLINE_S)) from first
        raise first
    assert not any(t.is_alive() for t in threads), hang_message("a rank did not end",
                                                                2 * HANG_DEADLINE_S)
    return results


def sharded_models(config, weights, world: int, layer_range: range):
    """The rank -> (shard config, shard weights) of a T-way split."""
    heads = tp_head_shards(config.num_attention_heads, config.num_key_value_heads, world)
    cols = tp_column_split(config.intermediate_size, world)
    return [shard_checkpoint(config, weights, heads[r], cols[r], layer_range)
            for r in range(world)]


def rel_err(out, ref) -> float:
    ref = np.asarray(ref, np.float64)
    return float(np.abs(np.asarray(out, np.float64) - ref).max() / np.abs(ref).max())


# --------------------------------------------------------------------------- #
# The sharded model against the unsharded one
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("world", [2, 3, 6])
def test_sharded_logits_equal_the_unsharded_model(tiny, world):
    """Prefill of two prompts then a decode step: every rank's logits equal
    the unsharded model's (T = 2: KV heads [0] and [1, 2]; T = 6: each KV
    head replicated on two workers), and the ranks agree bit for bit."""
    config, weights = tiny
    ref = run(LlamaModel(config, weights, CpuOps()))
    shards = sharded_models(config, weights, world, range(config.num_hidden_layers))
    if world == 2:
        assert [c.num_key_value_heads for c, _ in shards] == [1, 2]
        assert [c.num_attention_heads for c, _ in shards] == [2, 4]

    def work(rank, allreduce):
        cfg, w = shards[rank]
        return run(LlamaModel(cfg, w, CpuOps(), all_reduce=allreduce.all_reduce))

    results = on_ranks(world, work)
    for step, want in enumerate(ref):
        assert rel_err(results[0][step], want) < REL_TOL, step
        for rank in range(1, world):
            np.testing.assert_array_equal(results[rank][step], results[0][step])


def test_a_tensor_parallel_pipeline_stage(tiny):
    """Two pipeline stages of one layer, each split over 2 workers: a stage
    holds only its layer's shard, the first stage's (x, residual) are the
    same on both ranks, and the second stage's logits equal the model's."""
    config, weights = tiny
    ref = run(LlamaModel(config, weights, CpuOps()))
    first = sharded_models(config, weights, 2, range(0, 1))
    last = sharded_models(config, weights, 2, range(1, 2))
    assert not any(k.startswith("model.layers.1.") for k in first[0][1])
    assert not any(k.startswith("model.layers.0.") for k in last[1][1])

    def stage(shards, layers, intermediate=None):
        def work(rank, allreduce):
            cfg, w = shards[rank]
            model = LlamaModel(cfg, w, CpuOps(), layer_range=layers,
                               all_reduce=allreduce.all_reduce)
            return run(model, intermediate)
        return on_ranks(2, work)

    middle = stage(first, range(0, 1))
    for a, b in zip(middle[0], middle[1]):
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
    logits = stage(last, range(1, 2), middle[0])
    for step, want in enumerate(ref):
        assert rel_err(logits[1][step], want) < REL_TOL, step


# --------------------------------------------------------------------------- #
# shard_checkpoint's tensors
# --------------------------------------------------------------------------- #


def test_the_shards_put_back_together_are_the_checkpoint(tiny):
    """Concatenated over the ranks, the row-split tensors (along rows) and
    the column-split ones (along columns) are the originals; a row-parallel
    bias is whole on rank 0 and zero elsewhere, so the ranks' biases sum to
    it; the rest is the same array on every rank."""
    config, weights = tiny
    weights = dict(weights)
    p = "model.layers.1."
    weights[p + "self_attn.o_proj.bias"] = np.arange(1, config.hidden_size + 1,
                                                     dtype=np.float32)
    weights[p + "mlp.down_proj.bias"] = -weights[p + "self_attn.o_proj.bias"]
    shards = [w for _, w in sharded_models(config, weights, 3, range(2))]
    rows = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
            "mlp.gate_proj.weight", "mlp.up_proj.weight"]
    for name in rows:
        np.testing.assert_array_equal(np.concatenate([s[p + name] for s in shards]),
                                      weights[p + name])
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        parts = [s[p + name] for s in shards]
        assert all(part.flags.c_contiguous for part in parts)
        np.testing.assert_array_equal(np.concatenate(parts, axis=1), weights[p + name])
    for name in ("self_attn.o_proj.bias", "mlp.down_proj.bias"):
        np.testing.assert_array_equal(shards[0][p + name], weights[p + name])
        assert all(not s[p + name].any() for s in shards[1:])
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 p + "input_layernorm.weight", p + "post_attention_layernorm.weight"):
        assert all(s[name] is weights[name] for s in shards)


def test_the_shard_config_keeps_head_dim_and_the_attention_scale(tiny):
    config, weights = tiny
    cfg, _ = sharded_models(config, weights, 2, range(2))[1]
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (4, 2, 64)
    assert cfg.head_dim == config.head_dim == 12
    assert cfg.attention_scale == config.attention_scale == 12 ** -0.5
    assert cfg.hidden_size == config.hidden_size


def test_gguf_blocks_and_bad_shards_are_refused(tiny):
    config, weights = tiny
    heads = tp_head_shards(6, 3, 3)
    blocks = BlockQuantizedWeight("q8", np.zeros((72, 128), np.int8),
                                  np.zeros((72, 4), np.float32), None, "Q8_0")
    with pytest.raises(ValueError, match="not with tensor parallelism yet"):
        shard_checkpoint(config, {**weights, "model.layers.0.mlp.down_proj.weight": blocks},
                         heads[0], range(0, 43), range(2))
    wrong_group = type(heads[0])(0, range(2, 4), range(0, 1))
    with pytest.raises(ValueError, match="groups of KV heads"):
        shard_checkpoint(config, weights, wrong_group, range(0, 43), range(2))
    with pytest.raises(ValueError, match="MLP columns"):
        shard_checkpoint(config, weights, heads[0], range(100, 200), range(2))


# --------------------------------------------------------------------------- #
# ShmAllReduce
# --------------------------------------------------------------------------- #


def _sum_in_child(name: str, rank: int, queue) -> None:
    """Rank ``rank``: three all-reduces of integer-valued float32 arrays."""
    handle = ShmAllReduce.attach(name, rank, timeout=HANG_DEADLINE_S)
    got = []
    for shape in ((16, 576), (1, 576), (3, 5)):
        x = contribution(rank, shape)
        handle.all_reduce(x)
        got.append(x)
    handle.close()
    queue.put((rank, got))


def contribution(rank: int, shape: tuple[int, int]) -> np.ndarray:
    """Rank ``rank`` 's integers (exact in float32, so the sum is exact)."""
    return (np.arange(np.prod(shape)).reshape(shape) * (rank + 1) + 1000 * rank).astype(
        np.float32)


def test_two_processes_sum_exactly():
    """Two spawned processes (as the Ray workers: no common parent's locks)
    sum known integer arrays of three sizes, both getting the exact sums."""
    name = shm_name()
    owner = ShmAllReduce.create(name, 2, 16 * 576, timeout=HANG_DEADLINE_S)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    children = [ctx.Process(target=_sum_in_child, args=(name, r, queue)) for r in range(2)]
    try:
        for child in children:
            child.start()
        try:  # a hang deadline (a spawned child imports kvserve first)
            results = dict(queue.get(timeout=2 * HANG_DEADLINE_S) for _ in children)
        except Empty:
            raise AssertionError(hang_message("a child did not sum", 2 * HANG_DEADLINE_S)) \
                from None
        for child in children:
            child.join(HANG_DEADLINE_S)
    finally:
        owner.close()
        owner.unlink()
    assert [child.exitcode for child in children] == [0, 0]
    for rank in range(2):
        for shape, x in zip(((16, 576), (1, 576), (3, 5)), results[rank]):
            np.testing.assert_array_equal(x, contribution(0, shape) + contribution(1, shape))


def test_a_missing_peer_times_out_naming_it():
    name = shm_name()
    with ShmAllReduce.create(name, 3, 8, timeout=0.2) as rank0:
        try:
            with pytest.raises(TimeoutError, match=r"ranks \[1, 2\] of 3"):
                rank0.all_reduce(np.ones(8, np.float32))
            with pytest.raises(RuntimeError, match="out of step"):
                rank0.all_reduce(np.ones(8, np.float32))
        finally:
            rank0.unlink()


def test_bad_inputs_are_refused():
    name = shm_name()
    with ShmAllReduce.create(name, 2, 8, timeout=0.2) as handle:
        try:
            with pytest.raises(ValueError, match="max_elems 8"):
                handle.all_reduce(np.ones(9, np.float32))
            with pytest.raises(ValueError, match="float32"):
                handle.all_reduce(np.ones(4, np.float64))
            with pytest.raises(ValueError, match="C-contiguous"):
                handle.all_reduce(np.ones((4, 4), np.float32)[:, :2])
            with pytest.raises(ValueError, match="world of 2"):
                ShmAllReduce.attach(name, 2)
        finally:
            handle.unlink()
    with pytest.raises(TimeoutError, match="not created"):
        ShmAllReduce.attach(shm_name(), 1, timeout=0.05)


def test_ranks_passing_different_sizes_are_told():
    sizes = (4, 6)

    def work(rank, allreduce):
        with pytest.raises(ValueError, match="different sizes"):
            allreduce.all_reduce(np.ones(sizes[rank], np.float32))

    on_ranks(2, work)


def test_a_rank_a_call_ahead_leaves_the_slow_rank_its_data():
    """Rank 1 is held between the barrier and its sum until rank 0 has
    entered the next call with other values of another size: rank 1 still
    sums call 1's values (the double buffer stands in for a second barrier)
    and sees equal sizes (the counts are kept per buffer)."""

    def work(rank, allreduce):
        if rank == 1:
            wait = allreduce._wait

            def held(g: int) -> None:
                wait(g)
                deadline = time.monotonic() + HANG_DEADLINE_S
                while g == 1 and allreduce._counters[allreduce._gen[0]] < 2:
                    assert time.monotonic() < deadline, hang_message(
                        "rank 0 did not enter call 2", HANG_DEADLINE_S)
                    time.sleep(1e-4)

            allreduce._wait = held
        first, second = np.full(4, rank + 1, np.float32), np.full(6, 10 * (rank + 1), np.float32)
        allreduce.all_reduce(first)
        allreduce.all_reduce(second)
        return first.tolist(), second.tolist()

    assert on_ranks(2, work) == [([3.0] * 4, [30.0] * 6)] * 2


def test_segments_of_a_killed_server_are_removed_at_the_next_start():
    """Issue 47, item 11: an all-reduce segment outlives a killed API process
    in /dev/shm; the next tensor-parallel start removes the segments whose
    forming process is gone, and leaves a live one's (and names it did not
    make) alone."""
    import subprocess
    import sys

    from kvserve.distributed.tensor_parallel import remove_stale_segments, segment_name

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this system")  # POSIX shm lives elsewhere
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    tag = uuid.uuid4().hex[:8]
    stale = f"kvserve-tp-{dead}-{tag}-0-1"
    live = segment_name(tag, 1, 1)
    other = f"kvserve-tp-notours-{tag}"
    groups = [ShmAllReduce.create(name, 1, 4) for name in (stale, live, other)]
    try:
        assert stale in remove_stale_segments()
        names = os.listdir("/dev/shm")
        assert stale not in names and live in names and other in names
    finally:
        for group in groups:
            group.unlink()  # idempotent; the stale one is gone already
            group.close()
