#!/usr/bin/env python3
"""TTFT of a prompt whose prefix was evicted: loaded from the KV offload tier
against recomputed, one engine, one run.

For each configuration -- ``--kv-offloading-size GIB`` and none -- one
``kvserve serve`` with a KV cache of ``--kv-cache-memory`` (small enough
that one long prompt evicts another's blocks), then ``--trials`` times:

1. a ``--prefix-tokens`` prefix plus question A (1 output token): computed;
2. an unrelated prompt of ``--evict-tokens`` tokens (1 output token): its
   blocks evict the prefix's from the KV cache (into the tier, if any);
3. the same prefix plus question B, streamed: its TTFT is measured, with
   the tier's hits and load time from ``/metrics``.

The greedy texts of step 3 must be equal across the configurations (the
tier changes where K/V come from, never what the model answers). Prints a
Markdown table (TTFT p50 and mean, cached tokens, the tier's hits and
bytes) with the load average.

    python tools/bench_kv_offload.py
    python tools/bench_kv_offload.py --trials 3 --prefix-tokens 1000   # quicker
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import asyncio
import json
import os
import sys

import httpx
import numpy as np

from kvserve.bench.replay import send_request
from kvserve.bench.server import ServerProcess
from kvserve.bench.trace import TraceRequest
from kvserve.bench.workload import synth_text
from kvserve.model.default_model import ensure_default_model
from kvserve.observability.metrics import parse_metrics_text


def prompts(trial: int, args: argparse.Namespace) -> tuple[str, str, str]:
    """(prefix + question A, evictor, prefix + question B) of one trial."""
    rng = np.random.default_rng(args.seed + trial)
    prefix = f"Document {trial}: " + synth_text(args.prefix_tokens, rng)
    evictor = f"Unrelated {trial}: " + synth_text(args.evict_tokens, rng)
    return (prefix + "\nQuestion: what is the first word?\nAnswer:", evictor,
            prefix + "\nQuestion: what is the last word?\nAnswer:")


async def run_trials(base_url: str, args: argparse.Namespace) -> list[dict]:
    rows = []
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        for trial in range(args.trials):
            first, evictor, measured = prompts(trial, args)
            for prompt in (first, evictor):
                response = await client.post("/v1/completions", json={
                    "prompt": prompt, "max_tokens": 1, "temperature": 0})
                response.raise_for_status()
            url = f"{base_url}/v1/completions"
            result = await send_request(
                client, url, TraceRequest(id=f"b{trial}", arrival_s=0.0, prompt=measured,
                                          output_tokens=1),
                {"prompt": measured, "max_tokens": 1, "temperature": 0, "stream": True},
                {}, "completions", 0.0)
            check = await client.post("/v1/completions", json={
                "prompt": measured, "max_tokens": args.output_tokens, "temperature": 0})
            check.raise_for_status()
            rows.append({"ttft": result.ttft, "ok": result.success,
                         "text": check.json()["choices"][0]["text"]})
    return rows


def tier_counters(base_url: str) -> dict:
    """The tier's hits and copies, and the prefix-cache hits, from ``/metrics``."""
    samples = parse_metrics_text(httpx.get(f"{base_url}/metrics", timeout=30).text)

    def total(name: str, **labels) -> float:
        return sum(v for lab, v in samples.get(name, [])
                   if all(lab.get(k) == w for k, w in labels.items()))
    return {"offload_hits": total("kvserve:kv_offload_hits_total"),
            "offload_queries": total("kvserve:kv_offload_queries_total"),
            "onload_bytes": total("kvserve:kv_transfer_bytes_total", direction="onload"),
            "offload_bytes": total("kvserve:kv_transfer_bytes_total", direction="offload"),
            "onload_seconds": total("kvserve:kv_transfer_seconds_sum", direction="onload"),
            "prefix_hits": total("kvserve:prefix_cache_hits_total")}


def measure(tier_gib: float, args: argparse.Namespace) -> dict:
    flags = ["--model", str(ensure_default_model()), "--kv-cache-memory", args.kv_cache_memory,
             "--max-model-len", str(args.max_model_len), "--stats-interval", "0"]
    if tier_gib:
        flags += ["--kv-offloading-size", str(tier_gib)]
    server = ServerProcess(flags)
    try:
        load_before = os.getloadavg()[0]
        rows = asyncio.run(run_trials(server.base_url, args))
        counters = tier_counters(server.base_url)
    finally:
        server.stop()
    ttfts = [r["ttft"] for r in rows if r["ok"]]
    return {"tier_gib": tier_gib, "trials": len(rows), "failed": len(rows) - len(ttfts),
            "ttft_p50": float(np.median(ttfts)), "ttft_mean": float(np.mean(ttfts)),
            "texts": [r["text"] for r in rows], **counters,
            "load_before": load_before, "load_after": os.getloadavg()[0]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--evict-tokens", type=int, default=2450)
    parser.add_argument("--output-tokens", type=int, default=8,
                        help="tokens of the greedy text compared across configurations")
    parser.add_argument("--kv-cache-memory", default="112MiB",
                        help="2,548 tokens of the default model: the evictor's blocks take "
                             "(nearly) all of the prefix's")
    parser.add_argument("--max-model-len", type=int, default=2540)
    parser.add_argument("--tier-gib", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = [measure(args.tier_gib, args), measure(0.0, args)]
    for row in rows:
        print(json.dumps(row), file=sys.stderr)
    tier, none = rows
    same = tier["texts"] == none["texts"]
    print(f"\n{os.cpu_count()} CPUs; {args.trials} trials; a ~{args.prefix_tokens}-token prefix "
          f"evicted by a ~{args.evict_tokens}-token prompt; KV cache {args.kv_cache_memory}\n")
    print("| configuration | TTFT p50 (s) | TTFT mean (s) | tier hits (tokens) | "
          "tier load (MiB, s) | load avg |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        name = f"offload tier {row['tier_gib']:g} GiB" if row["tier_gib"] else "recompute"
        print(f"| {name} | {row['ttft_p50']:.3f} | {row['ttft_mean']:.3f} | "
              f"{row['offload_hits']:,.0f} | {row['onload_bytes'] / 2**20:,.1f}, "
              f"{row['onload_seconds']:.3f} | {row['load_before']:.1f} -> "
              f"{row['load_after']:.1f} |")
    print(f"\nTTFT p50 ratio tier / recompute: {tier['ttft_p50'] / none['ttft_p50']:.3f}; "
          f"greedy texts equal: {same}")
    return 0 if same and not tier["failed"] and not none["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
