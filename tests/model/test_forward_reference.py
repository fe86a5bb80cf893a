"""The production forward pass against the independent float64 reference.

``LlamaModel.forward`` and ``ModelRunner.execute`` (driven by the real
scheduler and KV cache manager) run a tiny random-weight Llama checkpoint
(``tiny_llama``) through the real ``Ops`` of every backend, and their logits
are compared with ``kvserve.testing.reference.reference_forward`` (dense
attention, no paging, float64). This is what catches a systematic error that
comparing the engine with itself cannot: a wrong attention scale, RoPE, norm,
residual, slot mapping or prefix-cache hit changes these logits.

Tolerance: the backends compute in float32, so logits may differ from the
float64 reference by rounding only: ``max |logit - ref| <= 2e-5 * max |ref|``
(the largest error seen on the CPU backend is about 10x below that; every
fault of ``tools/mutation_check.py`` is above 1e-3).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np
import pytest
from tiny_llama import SPECS, TinySpec, load_tiny

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.cpu.ops import CpuOps
from kvserve.model.llama import AttentionMetadata, LlamaModel
from kvserve.model.ops import Ops
from kvserve.model.runner import ModelRunner
from kvserve.testing.reference import reference_forward

#: Every backend that exists (the CPU one with each attention route: the
#: default split, and every sequence through the Numba kernel); each one runs
#: the whole file.
BACKENDS: dict[str, Callable[[], Ops]] = {
    "cpu": CpuOps, "cpu-numba-attention": lambda: CpuOps(prefill_min_queries=10**9)}
REL_TOL = 2e-5
#: Greedy tokens may differ from the reference's argmax only where the
#: reference's top two logits are closer than this (a float32 near-tie).
NEAR_TIE = 1e-3
TOP_K = 20  # logprobs entries per sampled token (raw logits mode)


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    """max |out - ref| / max |ref|."""
    ref = np.asarray(ref, np.float64)
    return float(np.abs(np.asarray(out, np.float64) - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module", params=SPECS, ids=[s.name for s in SPECS])
def tiny(request, tmp_path_factory):
    """(spec, ModelConfig, float32 weights) of one tiny checkpoint."""
    spec: TinySpec = request.param
    config, weights = load_tiny(tmp_path_factory.mktemp(spec.name), spec)
    return spec, config, weights


@pytest.fixture(params=sorted(BACKENDS))
def ops(request) -> Ops:
    return BACKENDS[request.param]()


def reference(weights, config, token_ids) -> np.ndarray:
    """float32[L, V] reference logits of every position of ``token_ids``."""
    return reference_forward(weights, config, list(token_ids))


# --------------------------------------------------------------------------- #
# LlamaModel.forward on hand-built paged batches
# --------------------------------------------------------------------------- #


def run_steps(model: LlamaModel, ops: Ops, seqs, steps, block_size: int, num_blocks: int,
              rng, kv_cache_dtype: str = "auto") -> list[np.ndarray]:
    """Run ``steps`` (lists of (seq, start, end) chunks) through ``model.forward``.

    Each sequence gets shuffled, non-contiguous physical blocks; every token's
    logits are computed (teacher forcing), so each row can be checked.
    """
    cfg = model.config
    caches = [ops.allocate_kv_cache(num_blocks, block_size, cfg.num_key_value_heads,
                                    cfg.head_dim, kv_cache_dtype=kv_cache_dtype)
              for _ in range(cfg.num_hidden_layers)]
    per_seq = num_blocks // len(seqs)
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = perm[: per_seq * len(seqs)].reshape(len(seqs), per_seq)
    logits = [np.full((len(s), cfg.vocab_size), np.nan, np.float32) for s in seqs]
    for step in steps:
        toks, pos, qsl = [], [], [0]
        for s, a, b in step:
            toks += seqs[s][a:b]
            pos.append(np.arange(a, b))
            qsl.append(qsl[-1] + b - a)
        positions = np.concatenate(pos)
        seq_of_token = np.repeat([s for s, _, _ in step], [b - a for _, a, b in step])
        slots = (tables[seq_of_token, positions // block_size].astype(np.int64) * block_size
                 + positions % block_size)
        to = ops.to_device
        attn = AttentionMetadata(slot_mapping=to(slots),
                                 block_tables=to(tables[[s for s, _, _ in step]]),
                                 seq_lens=to(np.array([b for _, _, b in step], np.int32)),
                                 query_start_loc=to(np.array(qsl, np.int32)))
        out = ops.to_numpy(model.forward(to(np.array(toks, np.int64)), to(positions), attn,
                                         caches, to(np.arange(len(toks), dtype=np.int64))))
        for j, (s, a, b) in enumerate(step):
            logits[s][a:b] = out[qsl[j]:qsl[j + 1]]
    return logits


def test_llama_forward_matches_reference(tiny, ops):
    """Chunked prefill mixed with decodes; sequence 2 is prefilled one token per
    step (as decodes), sequence 0 ends at the last position the RoPE table has."""
    spec, config, weights = tiny
    model = LlamaModel(config, weights, ops)
    rng = np.random.default_rng(spec.seed)
    max_pos = config.max_position_embeddings
    seqs = [rng.integers(0, config.vocab_size, n).tolist() for n in (max_pos, 6, 9)]
    steps = [
        [(0, 0, 40), (1, 0, 6), (2, 0, 1)],
        [(1, 6, 6), (0, 40, 81), (2, 1, 2)],
        [(0, 81, max_pos - 1), (2, 2, 3)],
        [(2, 3, 9), (0, max_pos - 1, max_pos)],
    ]
    steps = [[c for c in step if c[2] > c[1]] for step in steps]
    logits = run_steps(model, ops, seqs, steps, block_size=4, num_blocks=3 * 24, rng=rng)
    for s, toks in enumerate(seqs):
        assert rel_err(logits[s], reference(weights, config, toks)) < REL_TOL, s


# --------------------------------------------------------------------------- #
# ModelRunner.execute, driven by the real scheduler (prefix cache, chunked
# prefill, preemption by recompute)
# --------------------------------------------------------------------------- #


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=TOP_K)


def serve(runner: ModelRunner, scheduler, requests: list[Request],
          max_steps: int = 500, in_flight: int = 2) -> dict[str, list]:
    """Drive schedule -> execute -> update until every request finished, with
    up to ``in_flight`` steps scheduled ahead of the one executing (2: async
    scheduling, the engine's default).

    Returns request id -> the logprob entries of its sampled tokens, in order.
    """
    entries: dict[str, list] = {r.request_id: [] for r in requests}
    for request in requests:
        scheduler.add_request(request)
    pending = deque()
    for _ in range(max_steps):
        while len(pending) < in_flight and scheduler.has_unfinished_requests():
            output = scheduler.schedule()
            if output.is_empty:
                break
            pending.append(output)
        if not pending:
            return entries
        output = pending.popleft()
        result = runner.execute(output)
        for request_id, got in result.logprobs.items():
            entries.setdefault(request_id, []).extend(got)
        scheduler.update_from_output(output, result.sampled)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def check_against_reference(weights, config, request: Request, entries: list) -> None:
    """Each sampled token's raw top-k logits equal the reference's at its
    position, and the greedy token is the reference's argmax (or a near-tie)."""
    prompt, output = list(request.prompt_token_ids), request.output_token_ids
    assert len(entries) == len(output) == request.sampling_params.max_tokens
    ref = reference(weights, config, prompt + output[:-1])[len(prompt) - 1:]
    for i, (token, (value, top)) in enumerate(zip(output, entries)):
        row = ref[i].astype(np.float64)
        scale = np.abs(row).max()
        assert abs(value - row[token]) <= REL_TOL * scale, (request.request_id, i)
        ids = np.array([t for t, _ in top])
        values = np.array([v for _, v in top])
        assert np.abs(values - row[ids]).max() <= REL_TOL * scale, (request.request_id, i)
        best = row.argmax()
        if token != best:
            assert row[best] - row[token] < NEAR_TIE, (request.request_id, i, token, best)


def make_runner(config, weights, ops, num_blocks: int, block_size: int,
                budget: int, max_num_seqs: int = 8, kv_cache_dtype: str = "auto"):
    from kvserve.core.scheduler import Scheduler

    model = LlamaModel(config, weights, ops)
    runner = ModelRunner(config, model, ops, num_blocks, block_size,
                         logprobs_mode="raw_logits", kv_cache_dtype=kv_cache_dtype)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=budget,
                                          max_num_seqs=max_num_seqs,
                                          max_model_len=config.max_position_embeddings), kv)
    return runner, scheduler


@pytest.mark.parametrize("in_flight", [1, 2], ids=["sync", "async"])
def test_runner_chunked_prefill_and_mixed_batch(tiny, ops, in_flight):
    """A token budget of 7 splits every prompt into chunks that share steps
    with other requests' decodes; one request runs to the last position."""
    spec, config, weights = tiny
    runner, scheduler = make_runner(config, weights, ops, num_blocks=64, block_size=4, budget=7)
    rng = np.random.default_rng(100 + spec.seed)
    max_pos = config.max_position_embeddings
    lengths = [(3, 6), (19, 4), (max_pos - 5, 5), (1, 3)]
    requests = [Request(f"r{i}", rng.integers(0, config.vocab_size, p).tolist(), greedy(n))
                for i, (p, n) in enumerate(lengths)]
    entries = serve(runner, scheduler, requests, in_flight=in_flight)
    for request in requests:
        check_against_reference(weights, config, request, entries[request.request_id])


def test_runner_decode_after_prefix_cache_hit(tiny, ops):
    """A second wave of requests shares the first one's prompt prefix: it hits
    the prefix cache (cached tokens > 0) and still equals the reference."""
    spec, config, weights = tiny
    runner, scheduler = make_runner(config, weights, ops, num_blocks=64, block_size=4, budget=64)
    rng = np.random.default_rng(200 + spec.seed)
    prefix = rng.integers(0, config.vocab_size, 18).tolist()
    first = Request("first", prefix + [7, 8], greedy(5))
    serve(runner, scheduler, [first])
    second = [Request(f"hit{i}", prefix + rng.integers(0, config.vocab_size, 3 + i).tolist(),
                      greedy(6)) for i in range(2)]
    entries = serve(runner, scheduler, second)
    for request in second:
        assert request.num_cached_tokens == 16  # four full blocks of the shared prefix
        check_against_reference(weights, config, request, entries[request.request_id])
    # Starts with the cached prompt's second block: same tokens, other positions.
    shifted = Request("shifted", prefix[4:] + [9, 10], greedy(4))
    check_against_reference(weights, config, shifted,
                            serve(runner, scheduler, [shifted])["shifted"])
    assert shifted.num_cached_tokens == 0


def test_runner_after_preemption_by_recompute(tiny, ops):
    """Too few blocks for three requests: some are preempted, recomputed and
    resumed; their logits still equal the reference's."""
    spec, config, weights = tiny
    runner, scheduler = make_runner(config, weights, ops, num_blocks=12, block_size=4, budget=32)
    rng = np.random.default_rng(300 + spec.seed)
    requests = [Request(f"p{i}", rng.integers(0, config.vocab_size, 10).tolist(), greedy(8))
                for i in range(3)]
    entries = serve(runner, scheduler, requests)
    assert sum(r.num_preemptions for r in requests) > 0
    for request in requests:
        check_against_reference(weights, config, request, entries[request.request_id])


def test_runner_prompt_logprobs_in_bounded_blocks(tiny, ops, monkeypatch):
    """Prompt logprobs (raw logits mode) of a chunked prompt, scored 8 rows per
    LM-head call, equal the reference logits of every prompt position."""
    import kvserve.model.runner as runner_module

    monkeypatch.setattr(runner_module, "PROMPT_LOGITS_ROWS", 8)
    spec, config, weights = tiny
    runner, scheduler = make_runner(config, weights, ops, num_blocks=64, block_size=4, budget=16)
    rng = np.random.default_rng(400 + spec.seed)
    prompt = rng.integers(0, config.vocab_size, 45).tolist()
    request = Request("echo", prompt, SamplingParams(temperature=0.0, max_tokens=1,
                                                     ignore_eos=True, prompt_logprobs=3))
    scheduler.add_request(request)
    entries = None
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        result = runner.execute(output)
        entries = result.prompt_logprobs.get("echo", entries)
        scheduler.update_from_output(output, result.sampled)
    ref = reference(weights, config, prompt).astype(np.float64)
    assert entries[0] is None and len(entries) == len(prompt)
    for j, (value, top) in enumerate(entries[1:]):  # position j scores token j + 1
        scale = np.abs(ref[j]).max()
        assert abs(value - ref[j, prompt[j + 1]]) <= REL_TOL * scale, j
        assert [t for t, _ in top] == list(np.argsort(-ref[j], kind="stable")[:3]), j


def test_runner_skips_a_failed_steps_requests_in_the_step_behind_it(tiny, ops, monkeypatch):
    """Step N raises while step N+1 (async scheduling) already holds its
    requests: the runner drops their state and runs N+1 for the others,
    whose logits still equal the reference's."""
    from kvserve.core.request import RequestStatus

    spec, config, weights = tiny
    runner, scheduler = make_runner(config, weights, ops, num_blocks=64, block_size=4, budget=64)
    rng = np.random.default_rng(400 + spec.seed)
    doomed = Request("doomed", rng.integers(0, config.vocab_size, 9).tolist(), greedy(4))
    scheduler.add_request(doomed)
    failing = scheduler.schedule()
    survivor = Request("survivor", rng.integers(0, config.vocab_size, 7).tolist(), greedy(4))
    scheduler.add_request(survivor)
    behind = scheduler.schedule()  # holds doomed's decode and survivor's prompt
    assert {s.request_id for s in behind.scheduled} == {"doomed", "survivor"}

    forward = runner._forward
    monkeypatch.setattr(runner, "_forward", lambda batch: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        runner.execute(failing)
    monkeypatch.setattr(runner, "_forward", forward)
    scheduler.finish_requests([s.request_id for s in failing.scheduled],
                              RequestStatus.FINISHED_ERROR)  # as the scheduler actor does
    result = runner.execute(behind)
    assert set(result.sampled) == {"survivor"}
    scheduler.update_from_output(behind, result.sampled)
    entries = result.logprobs["survivor"] + serve(runner, scheduler, [])["survivor"]
    check_against_reference(weights, config, survivor, entries)
    assert "doomed" not in runner.states and "doomed" not in runner.input_batch
