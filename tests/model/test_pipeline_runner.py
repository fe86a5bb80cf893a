"""Pipeline parallelism without Ray: the real ``PipelineStage`` objects and
``PipelineRunner``, driven by the real scheduler with
``pipeline_parallel_size`` 2, against the float64 reference.

The stages run in this process (an executor that calls them in turn), so
what is checked is the split itself: the layer ranges, the embedding on the
first stage and the LM head on the last, ``(x, residual)`` handed from stage
to stage (the fused decode path's ``add_first`` included), every stage's
own KV cache under the one scheduler's block tables, and the runner's
``begin`` / ``finish`` with a second step begun before the first finished.
Ray's part (processes, object store, restarts) is the e2e test's.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
from test_forward_reference import check_against_reference, greedy, rel_err, reference
from tiny_llama import SPECS, TinySpec, write_tiny_checkpoint

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request
from kvserve.core.scheduler import Scheduler
from kvserve.distributed.pipeline import PipelineRunner
from kvserve.distributed.pipeline_stage import PipelineStage, StageRestarted
from kvserve.model.loader import load_model_config, load_weights
from kvserve.model.runner import KVCacheLost

SPEC = TinySpec("pp-4-layers", num_key_value_heads=2, tied=False, bias=True,
                num_hidden_layers=4, seed=7)


class _Ref(Future):
    """A finished step, as a Ray ObjectRef looks to the runner."""

    def future(self) -> Future:
        return self


class InProcessStages:
    """``PipelineExecutor``'s interface over stages in this process."""

    down = frozenset()

    def __init__(self, stages: list[PipelineStage]) -> None:
        self.stages = stages
        self.incarnations = [s.incarnation for s in stages]
        self.restarted = False

    def wait_until_up(self) -> bool:
        restarted, self.restarted = self.restarted, False
        return restarted

    def submit(self, batch, num_logits: int) -> list:
        previous = None
        future = _Ref()
        try:
            for stage, incarnation in zip(self.stages, self.incarnations):
                previous = stage.forward(batch, previous, incarnation, num_logits)
            future.set_result(previous)
        except StageRestarted as exc:
            future.set_exception(exc)
        return [future]

    def result(self, refs: list):
        try:
            return refs[0].result()
        except StageRestarted as exc:
            raise KVCacheLost(str(exc)) from exc

    def compute_logits(self, hidden):
        return self.stages[-1].compute_logits(hidden, self.incarnations[-1])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("pp"), SPEC)


def make_pipeline(folder: Path, ranges, num_blocks: int = 64, block_size: int = 4,
                  budget: int = 7, max_num_seqs: int = 8):
    config = EngineConfig(model=str(folder), num_threads=1, cache=CacheConfig(block_size=4))
    stages = [PipelineStage(config, i, (r.start, r.stop), num_blocks, block_size,
                            own_process=False) for i, r in enumerate(ranges)]
    model_config = load_model_config(folder)
    executor = InProcessStages(stages)
    runner = PipelineRunner(model_config, executor, block_size, logprobs_mode="raw_logits")
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=budget,
                                          max_num_seqs=max_num_seqs,
                                          max_model_len=model_config.max_position_embeddings,
                                          pipeline_parallel_size=len(ranges)), kv)
    return runner, scheduler, executor


def serve_pipelined(runner: PipelineRunner, scheduler: Scheduler, requests: list[Request],
                    max_steps: int = 500) -> tuple[dict[str, list], list[list[str]]]:
    """schedule -> begin with two steps begun before the older one finishes
    (the worker actor's order); returns the logprob entries per request and
    each step's request ids. Asserts that no request is in a step while its
    sampled token is still in flight (a prompt's next chunk may follow the
    one in flight: every stage computes steps in order)."""
    entries: dict[str, list] = {r.request_id: [] for r in requests}
    for request in requests:
        scheduler.add_request(request)
    pending: deque = deque()
    steps: list[list[str]] = []
    for _ in range(max_steps):
        while len(pending) < 2 and scheduler.has_unfinished_requests():
            output = scheduler.schedule()
            if output.is_empty:
                break
            ids = [c.request_id for c in output.scheduled]
            for other, _ in pending:  # a token in flight: its request waits
                assert not set(ids) & {c.request_id for c in other.scheduled if c.sample}, ids
            steps.append(ids)
            pending.append((output, runner.begin(output)))
        if not pending:
            return entries, steps
        output, begun = pending.popleft()
        result = runner.finish(begun, output)
        assert len(result.stage_seconds) == len(runner.executor.stages)
        for request_id, got in result.logprobs.items():
            entries.setdefault(request_id, []).extend(got)
        scheduler.update_from_output(output, result.sampled)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


@pytest.mark.parametrize("ranges", [(range(0, 2), range(2, 4)),
                                    (range(0, 1), range(1, 3), range(3, 4))],
                         ids=["2-stages", "3-stages-uneven"])
def test_pipelined_requests_match_the_reference(checkpoint, ranges):
    """Chunked prompts, decodes and a request to the last position through
    the stages equal the float64 reference (logits of every sampled token)."""
    runner, scheduler, _ = make_pipeline(checkpoint, ranges)
    config = load_model_config(checkpoint)
    weights = load_weights(checkpoint, config)
    rng = np.random.default_rng(11)
    max_pos = config.max_position_embeddings
    lengths = [(3, 6), (19, 4), (max_pos - 5, 5), (1, 3), (5, 7)]
    requests = [Request(f"r{i}", rng.integers(0, config.vocab_size, p).tolist(), greedy(n))
                for i, (p, n) in enumerate(lengths)]
    entries, _ = serve_pipelined(runner, scheduler, requests)
    for request in requests:
        check_against_reference(weights, config, request, entries[request.request_id])


def test_stage_holds_only_its_layers_and_tables(checkpoint):
    """The first stage has the embedding and no LM head, the last the final
    norm and the LM head; KV buffers only for the stage's layers."""
    runner, _, executor = make_pipeline(checkpoint, (range(0, 1), range(1, 4)))
    first, last = executor.stages
    assert [len(first.model.layers), len(last.model.layers)] == [1, 3]
    assert len(first.kv_caches) == 1 and len(last.kv_caches) == 3
    assert first.model.embed_tokens is not None and first.model.lm_head is None
    assert last.model.lm_head is not None and last.model.final_norm is not None
    assert last.model.embed_tokens is None  # untied: the last stage needs no embedding
    assert runner.kv_caches == []


def test_micro_batches_are_disjoint_and_split_the_decodes(checkpoint):
    """With two stages no request's token is in two steps in flight
    (``serve_pipelined`` checks), and once all decode, each step carries
    half of them, alternately (the micro-batches)."""
    runner, scheduler, _ = make_pipeline(checkpoint, (range(0, 2), range(2, 4)), budget=64)
    rng = np.random.default_rng(5)
    requests = [Request(f"d{i}", rng.integers(0, 500, 4).tolist(), greedy(12)) for i in range(4)]
    _, steps = serve_pipelined(runner, scheduler, requests)
    assert steps[0] == ["d0", "d1", "d2", "d3"]  # the prompts, in one step
    assert steps[1:9] == [["d0", "d1"], ["d2", "d3"]] * 4


def test_prompt_logprobs_are_scored_on_the_last_stage(checkpoint):
    """Prompt logprobs (raw logits) through ``compute_logits`` of the last
    stage equal the reference at every prompt position."""
    from kvserve.core.sampling_params import SamplingParams

    runner, scheduler, _ = make_pipeline(checkpoint, (range(0, 2), range(2, 4)))
    config = load_model_config(checkpoint)
    weights = load_weights(checkpoint, config)
    prompt = np.random.default_rng(3).integers(0, config.vocab_size, 12).tolist()
    request = Request("pl", prompt, SamplingParams(temperature=0.0, max_tokens=1,
                                                   ignore_eos=True, prompt_logprobs=3))
    scheduler.add_request(request)
    got = None
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        result = runner.finish(runner.begin(output), output)
        got = result.prompt_logprobs.get("pl", got)
        scheduler.update_from_output(output, result.sampled)
    ref = reference(weights, config, prompt)
    assert got[0] is None and len(got) == len(prompt)
    values = np.array([entry[0] for entry in got[1:]])  # the prompt token's raw logit
    expected = ref[np.arange(len(prompt) - 1), prompt[1:]]
    assert rel_err(values, expected) < 2e-5 * np.abs(ref).max() / np.abs(expected).max() + 1e-6


def test_a_restarted_stage_fails_the_step_that_reads_its_cache(checkpoint):
    """A stage's new process (another incarnation, an empty cache): the
    step in flight for it fails with ``KVCacheLost``; after the restart is
    adopted, a step of fresh prompts runs and reports the loss, one that
    reads earlier K/V fails."""
    runner, scheduler, executor = make_pipeline(checkpoint, (range(0, 2), range(2, 4)))
    config = EngineConfig(model=str(checkpoint), num_threads=1)
    scheduler.add_request(Request("a", [5, 6, 7, 8, 9], greedy(4)))
    output = scheduler.schedule()
    executor.stages[1] = PipelineStage(config, 1, (2, 4), 64, 4, own_process=False)
    with pytest.raises(KVCacheLost, match="restarted"):
        runner.finish(runner.begin(output), output)
    executor.incarnations[1] = executor.stages[1].incarnation
    executor.restarted = True
    fresh = Scheduler(scheduler.config, KVCacheManager(64, 4, enable_prefix_caching=True))
    fresh.add_request(Request("b", [5, 6, 7], greedy(2)))
    out = fresh.schedule()
    result = runner.finish(runner.begin(out), out)
    assert result.kv_lost and list(result.sampled) == ["b"]
    fresh.update_from_output(out, result.sampled)
    executor.restarted = True
    out = fresh.schedule()  # b's decode reads the K/V of its prompt
    with pytest.raises(KVCacheLost):
        runner.begin(out)


def test_pipelined_prefix_cache_hits_and_preemption_match_the_reference(checkpoint):
    """A second wave sharing the first one's prefix hits the prefix cache
    (every stage reads the cached blocks of its own layers); too few blocks
    for three requests preempt and recompute some. Both equal the reference."""
    config = load_model_config(checkpoint)
    weights = load_weights(checkpoint, config)
    rng = np.random.default_rng(21)
    runner, scheduler, _ = make_pipeline(checkpoint, (range(0, 2), range(2, 4)), budget=64)
    prefix = rng.integers(0, config.vocab_size, 18).tolist()
    serve_pipelined(runner, scheduler, [Request("first", prefix + [7, 8], greedy(5))])
    second = [Request(f"hit{i}", prefix + rng.integers(0, config.vocab_size, 3 + i).tolist(),
                      greedy(6)) for i in range(2)]
    entries, _ = serve_pipelined(runner, scheduler, second)
    for request in second:
        assert request.num_cached_tokens == 16  # four full blocks of the shared prefix
        check_against_reference(weights, config, request, entries[request.request_id])
    runner, scheduler, _ = make_pipeline(checkpoint, (range(0, 2), range(2, 4)), num_blocks=12,
                                         budget=32)
    tight = [Request(f"p{i}", rng.integers(0, config.vocab_size, 10).tolist(), greedy(8))
             for i in range(3)]
    entries, _ = serve_pipelined(runner, scheduler, tight)
    assert sum(r.num_preemptions for r in tight) > 0
    for request in tight:
        check_against_reference(weights, config, request, entries[request.request_id])


def test_the_runner_says_which_stages_are_down_and_closes_them(checkpoint):
    """Issue 49 item 4: the engine's ``/health`` and ``shutdown`` ask the
    runner through declared members (``stages_down``, ``close``) instead of
    reaching for its executor."""
    from kvserve.model.runner import ModelRunner

    runner, _, executor = make_pipeline(checkpoint, [range(0, 1), range(1, 2)])
    assert runner.stages_down() == []
    executor.down = frozenset({1, 0})
    assert runner.stages_down() == [0, 1]
    closed = []
    executor.shutdown = lambda: closed.append(True)
    runner.close()
    assert closed == [True]
    one_process = object.__new__(ModelRunner)  # its defaults need no model
    assert one_process.stages_down() == [] and one_process.close() is None
