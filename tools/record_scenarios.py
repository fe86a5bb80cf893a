"""Record kvserve JSON logs of small real engine runs under four scenarios.

Each scenario starts a real in-process ``AsyncEngine`` (the default model,
SmolLM2-135M, on the CPU), runs a warm-up request with logging off, then
logs at info level (``engine_stats`` every ``--stats-interval`` seconds) into
``OUT/<scenario>.jsonl`` while it serves the scenario's workload:

- ``light``: 8 short requests, one at a time -- no bottleneck;
- ``overload``: 12 short requests in a burst, at most 2 sequences in a step
  (``max_num_seqs=2``) -- queueing;
- ``long_prompts``: prompts of 150..1600 tokens, one at a time, 4 output
  tokens -- prefill dominates;
- ``tiny_kv``: 8 concurrent requests of ~100 prompt + 48 output tokens in a
  KV cache of 24 blocks (384 tokens) -- KV capacity, preemptions.

Prompts are random token ids (seeded; distinct, so the prefix cache does not
help) and ``ignore_eos`` fixes every output length. The files are the
fixtures of ``tests/observability/test_obs_analyzer.py``; after each
scenario the analyser's verdict is printed. On a shared, busy machine CPU
contention shows up in the logs as it would in production (slow, uneven
decode steps); record on a quiet machine, e.g. with ``NUMBA_NUM_THREADS=1``:

    python tools/record_scenarios.py [--out tests/observability/data] [SCENARIO ...]
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import asyncio
import io
import random
import time
from pathlib import Path

from kvserve.actors.messages import GenerateRequest, RequestOutput
from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine import AsyncEngine
from kvserve.observability.log import configure_logging

BLOCK_BYTES = 16 * 46080  # SmolLM2-135M float32 KV bytes per 16-token block

SCENARIOS = {
    "light": dict(kv_blocks=182, max_num_seqs=64, prompts=[24, 40, 32, 56, 28, 48, 36, 44],
                  max_tokens=16, concurrency=1, request_class="chat"),
    "overload": dict(kv_blocks=182, max_num_seqs=2, prompts=[40] * 12, max_tokens=16,
                     concurrency=12, request_class="chat"),
    "long_prompts": dict(kv_blocks=182, max_num_seqs=64,
                         prompts=[150, 1600, 400, 1300, 700, 1000], max_tokens=4,
                         concurrency=1, request_class="rag"),
    "tiny_kv": dict(kv_blocks=24, max_num_seqs=64, prompts=[100, 96, 104, 100, 98, 102, 100, 97],
                    max_tokens=48, concurrency=8, request_class="chat"),
}


def _request(rid: str, prompt_len: int, max_tokens: int, rng: random.Random,
             request_class: str | None) -> GenerateRequest:
    ids = tuple(rng.randrange(1000, 40000) for _ in range(prompt_len))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return GenerateRequest(rid, params, time.monotonic(), prompt_token_ids=ids,
                           request_class=request_class)


async def _consume(engine: AsyncEngine, request: GenerateRequest) -> int:
    tokens = 0
    async for event in engine.generate(request):
        if isinstance(event, RequestOutput):
            tokens += len(event.token_ids)
    return tokens


async def run_scenario(name: str, model: str, out: Path, stats_interval: float,
                       seed: int = 0) -> float:
    """Run one scenario; returns the seconds the workload took."""
    spec = SCENARIOS[name]
    config = EngineConfig(
        model=model, cache=CacheConfig(kv_cache_memory=spec["kv_blocks"] * BLOCK_BYTES),
        scheduler=SchedulerConfig(max_num_seqs=spec["max_num_seqs"]))
    configure_logging("json", "info", stream=io.StringIO())  # start-up and warm-up: not recorded
    engine = await AsyncEngine.start(config, stats_interval=stats_interval)
    rng = random.Random(seed)
    try:
        await _consume(engine, _request("warmup", 32, 4, rng, None))
        await engine.log_stats(force=True)  # start a fresh interval
        with open(out, "w", encoding="utf-8") as handle:
            configure_logging("json", "info", stream=handle)
            t0 = time.monotonic()
            semaphore = asyncio.Semaphore(spec["concurrency"])

            async def one(i: int, n: int) -> int:
                async with semaphore:
                    request = _request(f"{name}-{i}", n, spec["max_tokens"], rng,
                                       spec["request_class"])
                    return await _consume(engine, request)

            await asyncio.gather(*(one(i, n) for i, n in enumerate(spec["prompts"])))
            elapsed = time.monotonic() - t0
            await engine.log_stats(force=True)
            await engine.shutdown()
            engine = None
    finally:
        if engine is not None:
            await engine.shutdown()
        configure_logging("json", "info")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scenarios", nargs="*", default=list(SCENARIOS))
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests"
                                             / "observability" / "data"))
    parser.add_argument("--model", default=None)
    parser.add_argument("--stats-interval", type=float, default=0.5)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from kvserve.model.default_model import ensure_default_model
        model = str(ensure_default_model())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.scenarios:
        seconds = asyncio.run(run_scenario(name, model, out / f"{name}.jsonl",
                                           args.stats_interval))
        from kvserve.observability.analysis import analyze, load_log

        result = analyze(load_log(out / f"{name}.jsonl"))
        print(f"{name}: {seconds:.1f} s of engine time -> {out / f'{name}.jsonl'}; "
              f"bottleneck: {result.bottleneck} "
              f"{[(v.kind, v.evidence) for v in result.verdicts]}", flush=True)


if __name__ == "__main__":
    main()
