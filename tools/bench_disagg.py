#!/usr/bin/env python3
"""Disaggregated prefill/decode against aggregated replicas, one run.

Two configurations of two replicas (one CPU thread each on a 2-core
machine): ``--data-parallel-size 2`` (each replica prefills and decodes)
and ``--prefill-replicas 1 --decode-replicas 1``. The same trace for both:
``--short`` short streamed requests (``--short-output`` tokens each,
``ignore_eos``) arriving over the run, and ``--long`` long prompts of
``--long-tokens`` tokens (``--long-output`` tokens) arriving every
``--long-every`` seconds while the short ones decode. Reported per
configuration: the short requests' inter-token latency p50/p99 (client
side: the gap between two streamed tokens), TTFT p50 of both classes, and
the output throughput of the whole run (its cost).

    python tools/bench_disagg.py
    python tools/bench_disagg.py --short 8 --long 3   # quicker
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

from kvserve.bench.replay import run_replay, summarize_all
from kvserve.bench.server import ServerProcess
from kvserve.bench.trace import TraceRequest
from kvserve.bench.workload import synth_text
from kvserve.model.default_model import ensure_default_model
from kvserve.observability.metrics import parse_metrics_text

CONFIGS = {"aggregated": ["--data-parallel-size", "2"],
           "disaggregated": ["--prefill-replicas", "1", "--decode-replicas", "1"]}


def trace(args: argparse.Namespace) -> list[TraceRequest]:
    """Short requests every ``--short-every`` s from 0; long ones every
    ``--long-every`` s from ``--long-start`` s. Texts are seeded and unique
    (no prefix-cache hits between requests)."""
    rng = np.random.default_rng(args.seed)
    requests = [TraceRequest(id=f"short-{i}", cls="short", arrival_s=i * args.short_every,
                             prompt=f"Note {i}: " + synth_text(24, rng),
                             output_tokens=args.short_output) for i in range(args.short)]
    requests += [TraceRequest(id=f"long-{i}", cls="long",
                              arrival_s=args.long_start + i * args.long_every,
                              prompt=f"Report {i}: " + synth_text(args.long_tokens, rng),
                              output_tokens=args.long_output) for i in range(args.long)]
    return sorted(requests, key=lambda r: r.arrival_s)


def transfers(base_url: str) -> dict[str, tuple[float, float]]:
    """``{direction: (MiB, seconds)}`` of the replicas' KV transfers (``/metrics``)."""
    samples = parse_metrics_text(httpx.get(f"{base_url}/metrics", timeout=30).text)
    out: dict[str, list[float]] = {}
    for name, index, scale in (("kvserve:kv_transfer_bytes_total", 0, 2**20),
                               ("kvserve:kv_transfer_seconds_sum", 1, 1)):
        for labels, value in samples.get(name, []):
            out.setdefault(labels["direction"], [0.0, 0.0])[index] += value / scale
    return {d: (round(mib, 1), round(sec, 3)) for d, (mib, sec) in out.items() if mib}


def measure(name: str, args: argparse.Namespace) -> dict:
    server = ServerProcess(["--model", str(ensure_default_model()), *CONFIGS[name],
                            "--max-model-len", str(args.long_tokens + 256),
                            "--stats-interval", "0"])
    try:
        load_before = os.getloadavg()[0]
        results, duration = asyncio.run(run_replay(trace(args), server.base_url,
                                                   endpoint="completions", progress=False))
        moved = transfers(server.base_url)
    finally:
        server.stop()
    summary = summarize_all(results, duration)
    short, long_ = summary["by_class"]["short"], summary["by_class"]["long"]
    return {"config": name, "failed": summary["overall"]["failed"],
            "short_itl_p50_ms": short["itl_ms"]["median"], "short_itl_p99_ms": short["itl_ms"]["p99"],
            "short_ttft_p50_ms": short["ttft_ms"]["median"],
            "long_ttft_p50_ms": long_["ttft_ms"]["median"],
            "output_throughput": summary["overall"]["output_throughput"],
            "duration_s": duration, "kv_transfers_mib_s": moved, "load_before": load_before,
            "load_after": os.getloadavg()[0]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--short-every", type=float, default=1.0)
    parser.add_argument("--short-output", type=int, default=64)
    parser.add_argument("--long", type=int, default=5)
    parser.add_argument("--long-tokens", type=int, default=1500)
    parser.add_argument("--long-output", type=int, default=8)
    parser.add_argument("--long-start", type=float, default=3.0)
    parser.add_argument("--long-every", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = [measure(name, args) for name in CONFIGS]
    for row in rows:
        print(json.dumps(row), file=sys.stderr)
    print(f"\n{os.cpu_count()} CPUs, two replicas of one thread; {args.short} short requests "
          f"({args.short_output} tokens), {args.long} prompts of ~{args.long_tokens} tokens "
          f"every {args.long_every:g} s\n")
    print("| configuration | short ITL p50 (ms) | short ITL p99 (ms) | short TTFT p50 (ms) | "
          "long TTFT p50 (ms) | output tok/s | failed | load avg |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['short_itl_p50_ms']:.0f} | {r['short_itl_p99_ms']:.0f} | "
              f"{r['short_ttft_p50_ms']:.0f} | {r['long_ttft_p50_ms']:.0f} | "
              f"{r['output_throughput']:.1f} | {r['failed']} | "
              f"{r['load_before']:.1f} -> {r['load_after']:.1f} |")
    agg, dis = rows
    print("\nKV moved (MiB, seconds) by direction, disaggregated: "
          + ", ".join(f"{d} {m:,.1f} MiB in {t:.3f} s"
                      for d, (m, t) in dis["kv_transfers_mib_s"].items()))
    print(f"short ITL p99 disaggregated / aggregated: "
          f"{dis['short_itl_p99_ms'] / agg['short_itl_p99_ms']:.2f}; output throughput: "
          f"{dis['output_throughput'] / agg['output_throughput']:.2f}x")
    return 0 if not (agg["failed"] or dis["failed"]) else 1


if __name__ == "__main__":
    sys.exit(main())
