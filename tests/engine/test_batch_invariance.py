"""``--batch-invariant``: a request's tokens and log-probabilities do not
depend on what else is in its batch.

The tiny random checkpoint (``tests/model/tiny_llama.py``; its logits spread
over several units) behind a real scheduler and runner, stepped by hand: a
seeded, sampled probe request runs alone, then with 1 to 63 other requests
of other lengths arriving beside it, under a small token budget, so that the
probe's prompt is prefilled in other chunk splits, next to other prefills,
and its decode steps run in batches of 1 to 64 rows, decode-only (the fused
step) and mixed with prefill chunks (the op path). Its sampled tokens and
their log-probabilities must be bit-identical every time. The same runs
without the flag are the control: there, BLAS products and the BLAS prefill
attention make the log-probabilities move with the batch, which is what the
flag exists to prevent (and what shows this test can see a difference).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from tiny_llama import TinySpec, write_byte_tokenizer, write_tiny_checkpoint  # noqa: E402

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from kvserve.core.request import Request  # noqa: E402
from kvserve.core.sampling_params import SamplingParams  # noqa: E402
from kvserve.engine import build_engine_core  # noqa: E402
from kvserve.model.loader import load_model_config  # noqa: E402

#: Companions beside the probe: 0 (alone) to 63 (a 64-row decode batch).
COMPANIONS = (0, 1, 3, 11, 12, 13, 31, 63)
PROBE = [(13 * j + 5) % 500 + 2 for j in range(90)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # wider than the default spec, so that a product has enough input
    # channels for BLAS's blocking to matter in the control
    return write_byte_tokenizer(write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-bi"),
        TinySpec("bi", hidden_size=128, intermediate_size=384, max_position_embeddings=192)))


def _core(folder, batch_invariant):
    config = load_model_config(folder)
    return build_engine_core(EngineConfig(
        model=str(folder), num_threads=2, batch_invariant=batch_invariant,
        cache=CacheConfig(kv_cache_memory=2048 * 16 * config.kv_bytes_per_token(4)),
        scheduler=SchedulerConfig(max_num_batched_tokens=72, max_num_seqs=64,
                                  async_scheduling=False)))


def _probe_alongside(core, companions):
    """The probe's (token ids, log-probabilities) when it runs beside
    ``companions`` other sampled requests (different prompts, lengths and
    seeds), all added at once."""
    probe_params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=48,
                                  ignore_eos=True, logprobs=0)
    probe = Request("probe", list(PROBE), probe_params, eos_token_ids=(1,))
    others = [Request(f"o{i}", [(7 * i + 3 * j) % 500 + 2 for j in range(3 + (17 * i) % 37)],
                      SamplingParams(temperature=0.8, seed=i, max_tokens=60 + i % 16,
                                     ignore_eos=True), eos_token_ids=(1,))
              for i in range(companions)]
    # the probe arrives in the middle: its prompt is chunked by what the
    # first half leaves of the budget, and the second half's prefills run
    # beside its decodes
    requests = others[:companions // 2] + [probe] + others[companions // 2:]
    for request in requests:
        core.scheduler.add_request(request)
    logprobs = []
    shape = {"rows": set(), "prefill_chunks": 0, "mixed_decodes": 0}
    for _ in range(2000):
        if not core.scheduler.has_unfinished_requests():
            break
        out = core.scheduler.schedule()
        result = core.runner.execute(out)
        mine = [s.num_tokens for s in out.scheduled if s.request_id == "probe"]
        if mine and not logprobs:
            shape["prefill_chunks"] += 1
        elif mine and any(s.num_tokens > 1 for s in out.scheduled):
            shape["mixed_decodes"] += 1
        if "probe" in result.sampled:
            shape["rows"].add(len(result.sampled))
            logprobs += [entry[0] for entry in result.logprobs["probe"]]
        core.scheduler.update_from_output(out, result.sampled, result.draft_token_ids)
    assert not core.scheduler.has_unfinished_requests()
    return list(probe.output_token_ids), logprobs, shape


def test_a_seeded_request_is_the_same_alone_and_in_batches_of_1_to_64(tiny):
    core = _core(tiny, batch_invariant=True)
    tokens, logprobs, alone = _probe_alongside(core, 0)
    assert len(tokens) == 48 and len(logprobs) == 48
    rows, chunked, mixed = set(alone["rows"]), 0, 0
    for n in COMPANIONS[1:]:
        got_tokens, got_logprobs, shape = _probe_alongside(core, n)
        rows |= shape["rows"]
        chunked += shape["prefill_chunks"] > 1
        mixed += shape["mixed_decodes"]
        assert got_tokens == tokens, n
        assert got_logprobs == logprobs, n  # bit-identical floats
    # test preconditions: the batches were what the docstring says
    assert {1, 64} <= rows and len(rows) >= 6, rows
    assert chunked and mixed, (chunked, mixed)


def test_without_the_flag_the_batch_moves_the_logprobs(tiny):
    """The control: the default kernels are not batch-invariant (BLAS above
    a few rows, the BLAS prefill attention for long chunks)."""
    core = _core(tiny, batch_invariant=False)
    _, logprobs, _ = _probe_alongside(core, 0)
    moved = [n for n in COMPANIONS[1:] if _probe_alongside(core, n)[1] != logprobs]
    assert moved, "every batch gave bit-identical log-probabilities without --batch-invariant"
