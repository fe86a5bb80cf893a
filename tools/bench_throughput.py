"""In-process throughput benchmark: single-request decode speed and batched throughput.

Runs the engine in this process (no HTTP), so it measures the engine alone:

- single: one request (``--prompt-tokens`` in, ``--output-tokens`` out), reporting
  TTFT (seconds) and decode tokens/s = (output tokens - 1) / (E2E - TTFT);
- batch: ``--concurrency`` such requests submitted at once, reporting total
  output tokens/s = all output tokens / wall seconds, and mean TTFT.

Prompts are random token ids (distinct per request, so the prefix cache does
not help) and ``ignore_eos`` makes every request produce exactly
``--output-tokens`` tokens.

    python tools/bench_throughput.py --concurrency 32 --prompt-tokens 128 --output-tokens 128
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import asyncio
import json
import time

import numpy as np

from kvserve.actors.messages import GenerateRequest, RequestFailed, RequestOutput
from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig, parse_size
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine import AsyncEngine
from kvserve.observability.log import configure_logging


async def _one(engine: AsyncEngine, request_id: str, prompt: list[int], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    first = None
    tokens = 0
    async for event in engine.generate(GenerateRequest(
            request_id=request_id, sampling_params=params, arrival_time=time.monotonic(),
            prompt_token_ids=tuple(prompt))):
        if isinstance(event, RequestFailed):
            raise RuntimeError(event.message)
        if isinstance(event, RequestOutput):
            if first is None:
                first = time.perf_counter()
            tokens = event.num_output_tokens
    end = time.perf_counter()
    return {"ttft": first - start, "e2e": end - start, "output_tokens": tokens}


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab, size=length).tolist() for _ in range(n)]


async def run(args: argparse.Namespace) -> dict:
    """Run both phases; returns the figures as a dict."""
    from kvserve.model.default_model import ensure_default_model

    model = args.model or str(ensure_default_model())
    config = EngineConfig(model=model, cache=CacheConfig(kv_cache_memory=parse_size(args.kv_cache_memory)),
                          scheduler=SchedulerConfig(max_num_seqs=max(64, args.concurrency)),
                          num_threads=args.num_threads)
    t0 = time.perf_counter()
    engine = await AsyncEngine.start(config)
    load_seconds = time.perf_counter() - t0
    vocab = engine.tokenizer.vocab_size
    try:
        await _one(engine, "warmup", _prompts(1, 16, vocab, 0)[0], 4)
        single = await _one(engine, "single", _prompts(1, args.prompt_tokens, vocab, 1)[0],
                            args.output_tokens)
        prompts = _prompts(args.concurrency, args.prompt_tokens, vocab, 2)
        t1 = time.perf_counter()
        results = await asyncio.gather(*[_one(engine, f"b{i}", p, args.output_tokens)
                                         for i, p in enumerate(prompts)])
        wall = time.perf_counter() - t1
    finally:
        await engine.shutdown()
    out_tokens = sum(r["output_tokens"] for r in results)
    return {
        "engine_start_seconds": round(load_seconds, 2),
        "single": {"ttft_s": round(single["ttft"], 4),
                   "decode_tokens_per_s": round((single["output_tokens"] - 1)
                                                / (single["e2e"] - single["ttft"]), 2)},
        "batch": {"concurrency": args.concurrency, "prompt_tokens": args.prompt_tokens,
                  "output_tokens": args.output_tokens, "wall_s": round(wall, 2),
                  "output_tokens_per_s": round(out_tokens / wall, 2),
                  "total_tokens_per_s": round((out_tokens + args.concurrency * args.prompt_tokens)
                                              / wall, 2),
                  "mean_ttft_s": round(float(np.mean([r["ttft"] for r in results])), 3)},
    }


def main() -> None:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--num-threads", type=int, default=None,
                        help="CPU threads for BLAS and Numba (default: the engine's)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    configure_logging("console", "warning")
    figures = asyncio.run(run(args))
    print(json.dumps(figures, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
