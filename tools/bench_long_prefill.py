"""Do long prompts starve decodes? ITL of decoding streams while a long prompt prefills.

In-process (no HTTP), one engine per setting, side by side in one run: start
``--streams`` decoding requests (short prompts, EOS ignored), wait until each
has streamed a token, then submit one ``--long-prompt``-token prompt and
record every token event of the streams until the long prompt's first token.
Reports the streams' inter-token latency (ITL: gaps between consecutive
token events; p50 / p99 / max, seconds) during that prefill, the long
prompt's TTFT, and its prefill rate (prompt tokens / TTFT).

Each setting is a list of engine flags: ``--max-num-batched-tokens N`` (the
fixed token budget) or ``--max-step-ms MS`` (the step-time target), e.g.::

    python tools/bench_long_prefill.py --settings "mnbt=2048" "mnbt=512" "step_ms=500"
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import asyncio
import json
import os
import time

import numpy as np

from kvserve.actors.messages import GenerateRequest, RequestFailed, RequestOutput
from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig, parse_size
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine import AsyncEngine
from kvserve.observability.log import configure_logging


async def _stream(engine: AsyncEngine, rid: str, prompt: list[int], max_tokens: int,
                  stamps: list[float], started: asyncio.Event | None = None) -> None:
    """Run one request, appending the time of each token event to ``stamps``."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request = GenerateRequest(request_id=rid, sampling_params=params,
                              arrival_time=time.monotonic(), prompt_token_ids=tuple(prompt))
    async for event in engine.generate(request):
        if isinstance(event, RequestFailed):
            raise RuntimeError(event.message)
        if isinstance(event, RequestOutput) and event.token_ids:
            stamps.append(time.monotonic())
            if started is not None:
                started.set()


def _config(setting: str, model: str, args: argparse.Namespace) -> EngineConfig:
    """``mnbt=N`` or ``step_ms=MS`` -> the engine config of that setting."""
    key, _, value = setting.partition("=")
    scheduler = SchedulerConfig(max_num_batched_tokens=int(value) if key == "mnbt" else 2048,
                                max_step_seconds=float(value) / 1000 if key == "step_ms" else None,
                                max_num_seqs=64)
    if key not in ("mnbt", "step_ms"):
        raise SystemExit(f"unknown setting {setting!r}: use mnbt=N or step_ms=MS")
    return EngineConfig(model=model, cache=CacheConfig(kv_cache_memory=parse_size("512MiB")),
                        scheduler=scheduler, num_threads=args.num_threads)


async def run_setting(setting: str, model: str, args: argparse.Namespace) -> dict:
    """One engine, one measurement; returns its figures."""
    engine = await AsyncEngine.start(_config(setting, model, args))
    rng = np.random.default_rng(0)
    vocab = engine.tokenizer.vocab_size
    try:
        await _stream(engine, "warmup", rng.integers(100, vocab, 300).tolist(), 2, [])
        stamps = [[] for _ in range(args.streams)]
        events = [asyncio.Event() for _ in range(args.streams)]
        tasks = [asyncio.create_task(_stream(engine, f"s{i}", rng.integers(100, vocab, 32).tolist(),
                                             args.stream_tokens, stamps[i], events[i]))
                 for i in range(args.streams)]
        await asyncio.gather(*(e.wait() for e in events))
        long_stamps: list[float] = []
        t0 = time.monotonic()
        await _stream(engine, "long", rng.integers(100, vocab, args.long_prompt).tolist(), 1,
                      long_stamps)
        t1 = long_stamps[0]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await engine.shutdown()
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:]) if b > t0 and a < t1]
    return {"setting": setting, "long_ttft_s": round(t1 - t0, 3),
            "prefill_tokens_per_s": round(args.long_prompt / (t1 - t0), 1),
            "itl_p50_s": round(float(np.percentile(gaps, 50)), 3) if gaps else None,
            "itl_p99_s": round(float(np.percentile(gaps, 99)), 3) if gaps else None,
            "itl_max_s": round(max(gaps), 3) if gaps else None, "num_gaps": len(gaps)}


async def main_async(args: argparse.Namespace) -> list[dict]:
    from kvserve.model.default_model import ensure_default_model

    model = args.model or str(ensure_default_model())
    rows = []
    for setting in args.settings:
        rows.append(await run_setting(setting, model, args))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--settings", nargs="+",
                        default=["mnbt=2048", "mnbt=1024", "mnbt=512", "mnbt=256",
                                 "step_ms=500", "step_ms=250"])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-tokens", type=int, default=4096)
    parser.add_argument("--long-prompt", type=int, default=5000)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    configure_logging("console", "warning")
    load_before = os.getloadavg()
    rows = asyncio.run(main_async(args))
    print(f"\nload average before: {load_before[0]:.2f}, after: {os.getloadavg()[0]:.2f}")
    print(f"\n| setting | ITL p50 (s) | ITL p99 (s) | ITL max (s) | {args.long_prompt}-token "
          "TTFT (s) | prefill tok/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['itl_p50_s']} | {r['itl_p99_s']} | {r['itl_max_s']} | "
              f"{r['long_ttft_s']} | {r['prefill_tokens_per_s']} |")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"rows": rows, "load_before": load_before}, handle, indent=2)


if __name__ == "__main__":
    main()
