#!/usr/bin/env python3
"""Prefix-aware routing against round robin, two replicas, one run.

For each ``--data-parallel-routing`` policy (``prefix``, ``round_robin``),
one ``kvserve serve --data-parallel-size 2`` (one CPU thread per replica on
a 2-core machine), then an agent-style workload: ``--groups`` long shared
prefixes (a system prompt of about ``--prefix-words`` words each), each
sent ``--per-group`` times with a short different question, arriving
interleaved (each round every group once, in a seeded random order),
``--concurrency`` at a time.
Reported per policy: the prefix-cache hit rate (``prefix_cache_hits_total``
/ ``prefix_cache_queries_total``, summed over the replicas' ``/metrics``),
and TTFT p50/p90 measured by the client (time to the first streamed token).
Prints a Markdown table with the load average.

    python tools/bench_dp_routing.py
    python tools/bench_dp_routing.py --groups 4 --per-group 4   # quicker
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import asyncio
import json
import os
import sys
import time

import httpx
import numpy as np

from kvserve.bench.server import ServerProcess
from kvserve.model.default_model import ensure_default_model
from kvserve.observability.metrics import parse_metrics_text

TOPICS = ["a library", "a bakery", "a train station", "a museum", "a bank", "a hospital",
          "a hotel", "a garden centre"]
QUESTIONS = ["When do you open?", "Where can I park?", "Do you take cards?",
             "Is there a toilet?", "Can I bring my dog?", "Who is in charge?"]


def system_prompt(group: int, words: int) -> str:
    """A long instruction block unique to ``group`` (about ``words`` words)."""
    topic = TOPICS[group % len(TOPICS)]
    base = (f"You are agent {group}, the assistant of {topic}. Answer visitors politely, "
            "in one short sentence, with facts only, and point them to the front desk "
            "when unsure. ")
    filler = " ".join(f"Rule {i}: stay calm, be kind and keep it short." for i in range(words))
    return base + " ".join(filler.split()[:words])


def workload(args: argparse.Namespace) -> list[dict]:
    """Requests in arrival order: groups interleaved, in a shuffled order each
    round (seeded; with a fixed order and an even group count, round robin
    would send each group to one replica by accident)."""
    rng, out = np.random.default_rng(args.seed), []
    for k in range(args.per_group):
        for group in rng.permutation(args.groups):
            out.append({"messages": [
                {"role": "system", "content": system_prompt(int(group), args.prefix_words)},
                {"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}],
                "max_tokens": args.output_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True})
    return out


async def ttft(client: httpx.AsyncClient, body: dict) -> float:
    start = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        first = None
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {") and '"content":"' in \
                    line.replace(" ", "") and '"content":""' not in line.replace(" ", ""):
                first = time.perf_counter() - start
    return first if first is not None else float("nan")


async def replay(base_url: str, requests: list[dict], concurrency: int) -> list[float]:
    gate = asyncio.Semaphore(concurrency)

    async def one(body):
        async with gate:
            return await ttft(client, body)

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        tasks = []
        for body in requests:  # arrivals in order
            tasks.append(asyncio.create_task(one(body)))
            await asyncio.sleep(0)
        return await asyncio.gather(*tasks)


def hit_rate(base_url: str) -> tuple[float, float]:
    samples = parse_metrics_text(httpx.get(f"{base_url}/metrics", timeout=30).text)
    hits = sum(v for _, v in samples.get("kvserve:prefix_cache_hits_total", []))
    queries = sum(v for _, v in samples.get("kvserve:prefix_cache_queries_total", []))
    return hits, queries


def measure(policy: str, args: argparse.Namespace) -> dict:
    server = ServerProcess(["--model", str(ensure_default_model()), "--data-parallel-size", "2",
                            "--data-parallel-routing", policy, "--max-model-len", "1024",
                            "--kv-cache-memory", args.kv_cache_memory, "--stats-interval", "0"])
    try:
        load_before = os.getloadavg()[0]
        times = asyncio.run(replay(server.base_url, workload(args), args.concurrency))
        hits, queries = hit_rate(server.base_url)
    finally:
        server.stop()
    return {"policy": policy, "requests": len(times), "hit_rate": hits / max(queries, 1),
            "hits": hits, "queries": queries,
            "ttft_p50": float(np.nanpercentile(times, 50)),
            "ttft_p90": float(np.nanpercentile(times, 90)), "load_before": load_before,
            "load_after": os.getloadavg()[0]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=6)
    parser.add_argument("--prefix-words", type=int, default=300)
    parser.add_argument("--output-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-memory", default="128MiB",
                        help="per replica: small enough that round robin's duplicated "
                             "prefixes compete for it")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = [measure(policy, args) for policy in ("prefix", "round_robin")]
    for row in rows:
        print(json.dumps(row), file=sys.stderr)
    print(f"\n{os.cpu_count()} CPUs; {rows[0]['requests']} requests, {args.groups} prefixes of "
          f"~{args.prefix_words} words, concurrency {args.concurrency}\n")
    print("| routing | prefix-cache hit rate | TTFT p50 (s) | TTFT p90 (s) | load avg |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['policy']} | {row['hit_rate']:.1%} | {row['ttft_p50']:.3f} | "
              f"{row['ttft_p90']:.3f} | {row['load_before']:.1f} -> {row['load_after']:.1f} |")
    prefix, rr = rows
    print(f"\nhit rate ratio prefix / round robin: "
          f"{prefix['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f}x; "
          f"TTFT p50 ratio: {prefix['ttft_p50'] / rr['ttft_p50']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
