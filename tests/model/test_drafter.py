"""load_draft_model refuses a draft whose tokenizer is not the target's:
drafts are token ids, so the vocabularies must be the same."""

import shutil

import pytest
from tiny_llama import TinySpec, write_byte_tokenizer, write_tiny_checkpoint

from kvserve.config import SpeculativeConfig
from kvserve.cpu.ops import CpuOps
from kvserve.model.drafter import load_draft_model
from kvserve.model.loader import load_model_config
from kvserve.model.tokenizer import Tokenizer


def test_a_draft_model_of_another_tokenizer_is_refused(tmp_path):
    target = write_byte_tokenizer(write_tiny_checkpoint(tmp_path / "target", TinySpec("t")))
    draft = write_byte_tokenizer(write_tiny_checkpoint(tmp_path / "draft",
                                                       TinySpec("d", vocab_size=600)))
    spec = SpeculativeConfig(method="draft_model", model=str(draft))
    with pytest.raises(ValueError, match="another tokenizer"):
        load_draft_model(spec, load_model_config(target), Tokenizer(target),
                         CpuOps(num_threads=1))


def test_a_draft_model_of_the_same_tokenizer_loads(tmp_path):
    target = write_byte_tokenizer(write_tiny_checkpoint(tmp_path / "target", TinySpec("t")))
    draft = write_tiny_checkpoint(tmp_path / "draft", TinySpec("d", num_key_value_heads=4))
    shutil.copy(target / "tokenizer.json", draft / "tokenizer.json")
    spec = SpeculativeConfig(method="draft_model", model=str(draft), quantization="int8")
    model = load_draft_model(spec, load_model_config(target), Tokenizer(target),
                         CpuOps(num_threads=1))
    assert model.config.num_key_value_heads == 4 and model.quantization == "int8"


# ------------------------------------------- the engine core, stepped by hand


def build_core(folder, speculative=None, blocks=64, budget=64):
    """The tiny checkpoint's scheduler and runner (one step in flight), with
    the same checkpoint as its own draft model when ``speculative``."""
    from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from kvserve.engine import build_engine_core

    config = load_model_config(folder)
    block_bytes = 16 * config.kv_bytes_per_token(4) * (2 if speculative else 1)
    return build_engine_core(EngineConfig(
        model=str(folder), num_threads=1, cache=CacheConfig(kv_cache_memory=blocks * block_bytes),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, async_scheduling=False,
                                  speculative=speculative)))


def run(core, prompts, params):
    """Step the core until every request finished: their output token ids
    and the preemptions on the way."""
    from kvserve.core.request import Request

    requests = [Request(f"r{i}", list(p), params, eos_token_ids=(1,))
                for i, p in enumerate(prompts)]
    for request in requests:
        core.scheduler.add_request(request)
    preemptions = 0
    for _ in range(1000):
        if not core.scheduler.has_unfinished_requests():
            break
        out = core.scheduler.schedule()
        preemptions += len(out.preemptions)
        result = core.runner.execute(out)
        core.scheduler.update_from_output(out, result.sampled, result.draft_token_ids)
    return [r.output_token_ids for r in requests], preemptions


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_byte_tokenizer(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"),
                                                      TinySpec("t")))


def test_a_draft_model_that_is_the_target_keeps_greedy_output_and_is_accepted(tiny):
    """The same checkpoint as draft: every draft should be the target's argmax
    (up to float rounding between a verify chunk and single-token passes), so
    acceptance near 100% shows the draft's K/V cache follows the tokens --
    through chunked prefill (16-token steps) and preemption (12 blocks)."""
    from kvserve.core.sampling_params import SamplingParams

    prompts = [[(7 * i + 3 * j) % 500 + 2 for j in range(30 + 8 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected, _ = run(build_core(tiny, budget=16, blocks=12), prompts, params)
    spec = SpeculativeConfig(method="draft_model", model=str(tiny), num_speculative_tokens=3)
    core = build_core(tiny, spec, budget=16, blocks=12)
    outputs, preemptions = run(core, prompts, params)
    assert outputs == expected
    assert preemptions > 0, "test precondition: the small cache preempted"
    stats = core.scheduler.take_spec_stats()
    assert stats.num_draft_tokens > 30
    assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.9, stats
    core.scheduler.kv_cache_manager.check_consistency()
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.plan.num_blocks


def test_a_sampled_request_accepts_nearly_every_draft_of_the_target_itself(tiny):
    """Rejection sampling accepts a draft with probability 1 - TV(p, q): about
    1 when the draft model is the target and its K/V cache follows the
    tokens (greedy outputs of the random tiny model repeat one token, so
    they cannot show a draft that lost its place; sampled ones vary)."""
    from kvserve.core.sampling_params import SamplingParams

    prompts = [[(5 * i + 11 * j) % 500 + 2 for j in range(12 + 5 * i)] for i in range(3)]
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    spec = SpeculativeConfig(method="draft_model", model=str(tiny), num_speculative_tokens=3)
    core = build_core(tiny, spec)
    outputs, _ = run(core, prompts, params)
    assert all(len(set(o)) > 10 for o in outputs), outputs  # varied: not a repeated token
    stats = core.scheduler.take_spec_stats()
    assert stats.num_draft_tokens > 60
    assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.9, stats
