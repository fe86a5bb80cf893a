#!/usr/bin/env python3
"""Short requests behind a long prompt: ``--long-prefill-token-threshold``
(the default, half the step budget) against 0 (no cap), one run.

For each setting, one ``kvserve serve`` (default model); a ``--long-tokens``
prompt is sent, and ``--delay`` seconds later ``--short`` short requests
(``--short-tokens`` prompt tokens, 8 output tokens, streamed), one after the
other. Reported: the short requests' TTFT p50 and max (client-measured), and
the long prompt's own TTFT (what the cap costs it). Prompts are token ids
(random, seeded, so nothing is shared through the prefix cache).

    python tools/bench_long_prompt_hol.py
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import asyncio
import os
import sys
import time

import httpx
import numpy as np

from kvserve.bench.server import ServerProcess
from kvserve.model.default_model import ensure_default_model


async def timed(client: httpx.AsyncClient, ids: list[int], max_tokens: int) -> float:
    """Seconds from sending to the first streamed token."""
    start = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json={
            "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}) as response:
        response.raise_for_status()
        first = None
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    return first


async def scenario(base_url: str, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    long_ids = rng.integers(100, 40000, args.long_tokens).tolist()
    async with httpx.AsyncClient(base_url=base_url, timeout=900) as client:
        long_task = asyncio.create_task(timed(client, long_ids, 4))
        await asyncio.sleep(args.delay)
        shorts = [await timed(client, rng.integers(100, 40000, args.short_tokens).tolist(), 8)
                  for _ in range(args.short)]
        long_ttft = await long_task
    return {"short_p50": float(np.median(shorts)), "short_max": max(shorts),
            "long_ttft": long_ttft}


def measure(threshold: str, args: argparse.Namespace) -> dict:
    extra = [] if threshold == "default" else ["--long-prefill-token-threshold", threshold]
    server = ServerProcess(["--model", str(ensure_default_model()), "--stats-interval", "0",
                            *extra])
    try:
        load = os.getloadavg()[0]
        result = asyncio.run(scenario(server.base_url, args))
    finally:
        server.stop()
    return {"threshold": threshold, "load_before": load, **result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--long-tokens", type=int, default=3000)
    parser.add_argument("--short-tokens", type=int, default=33)
    parser.add_argument("--short", type=int, default=4)
    parser.add_argument("--delay", type=float, default=1.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = [measure(t, args) for t in ("default", "0")]
    print(f"\n{os.cpu_count()} CPUs; a {args.long_tokens}-token prompt, then {args.short} "
          f"requests of {args.short_tokens} tokens, {args.delay} s later\n")
    print("| --long-prefill-token-threshold | short TTFT p50 (s) | short TTFT max (s) | "
          "long prompt TTFT (s) | load avg before |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['threshold']} | {r['short_p50']:.2f} | {r['short_max']:.2f} | "
              f"{r['long_ttft']:.2f} | {r['load_before']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
