"""Head-of-line blocking benchmark: interactive TTFT under a batch flood,
``--scheduling-policy fcfs`` vs ``priority``, measured in one run.

For each policy (fcfs first, then priority, the same traffic) a live
``kvserve serve`` is started (or ``--url POLICY=URL`` names a running one)
and sees:

* a batch flood: ``--flood`` requests of ``--batch-prompt-tokens`` prompt
  tokens and ``--batch-max-tokens`` output tokens, all sent at t = 0, with
  ``X-Priority: 10`` under priority (``0`` under fcfs, where non-zero is a 400);
* interactive traffic: from t = ``--interval`` on, one request every
  ``--interval`` seconds (``--interactive-prompt-tokens`` prompt tokens,
  ``--interactive-max-tokens`` output tokens, ``X-Priority: 0``) until the
  flood has finished or ``--duration`` seconds have passed.

Requests go to ``POST /v1/completions`` as token-id prompts (random ids from a
fixed seed, unique per request so the prefix cache shares nothing), greedy,
``ignore_eos`` (every request produces exactly its ``max_tokens``), streamed
with httpx. TTFT is measured by the client: send -> first chunk with text.

Reported per policy: interactive TTFT p50/p99/mean/max (and count), batch
throughput (batch output tokens / flood wall time), flood wall time, batch
TTFT p50, and -- for servers started here -- the preemptions the server logged.
A table goes to stdout; ``--out`` writes the same figures as JSON.

    python tools/bench_hol.py                                   # both policies, ~3-5 min on 2 cores
    python tools/bench_hol.py --flood 16 --duration 30 --out hol.json
    python tools/bench_hol.py --url priority=http://127.0.0.1:8000 --policies priority

The servers it starts use ``--max-num-seqs`` (default 16: the flood saturates
the slots, as a busy production server would) and ``--max-num-batched-tokens``
(default 512, so one step stays short on a CPU); both policies get the same.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

import numpy as np

from kvserve.bench.server import ServerProcess

BATCH_PRIORITY = 10
INTERACTIVE_PRIORITY = 0
TOKEN_RANGE = (1000, 40000)  # ordinary vocabulary ids of the default model


@dataclass
class Timing:
    kind: str  # "batch" or "interactive"
    sent: float
    first: float | None = None
    end: float | None = None
    status: int | None = None
    output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent


@dataclass
class PolicyResult:
    policy: str
    url: str
    interactive_count: int
    interactive_failed: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    ttft_mean_s: float | None
    ttft_max_s: float | None
    batch_count: int
    batch_failed: int
    batch_output_tokens: int
    flood_wall_s: float
    batch_throughput_tok_s: float
    batch_ttft_p50_s: float | None
    preemptions: int | None
    server_args: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- server


def start_server(policy: str, args: argparse.Namespace, log_dir: Path) -> ServerProcess:
    """``kvserve serve`` for one policy (``kvserve.bench.server``), healthy on return."""
    server_args = ["--scheduling-policy", policy, "--max-num-seqs", str(args.max_num_seqs),
                   "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                   "--kv-cache-memory", args.kv_cache_memory]
    if args.model:
        server_args += ["--model", args.model]
    print(f"[{policy}] starting kvserve serve {' '.join(server_args)}", flush=True)
    return ServerProcess(server_args, log_path=log_dir / f"kvserve-{policy}.log",
                         health_paths=("/health",))


def count_preemptions(server: ServerProcess) -> int:
    """``request_preempted`` events in the server's JSON log."""
    return server.log_path.read_text(encoding="utf-8", errors="replace").count(
        '"request_preempted"')


# --------------------------------------------------------------------------- traffic


def prompt_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


async def stream_one(client: httpx.AsyncClient, timing: Timing, prompt: list[int],
                     max_tokens: int, priority: int | None) -> Timing:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    headers = {} if priority is None else {"X-Priority": str(priority)}
    timing.sent = time.monotonic()
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers=headers) as response:
            timing.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                timing.error = response.text[:200]
                return timing
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    timing.error = chunk["error"].get("message")
                    break
                if chunk.get("usage"):
                    timing.output_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    if timing.first is None:
                        timing.first = time.monotonic()
    except httpx.HTTPError as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    finally:
        timing.end = time.monotonic()
    return timing


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


async def run_policy(policy: str, url: str, args: argparse.Namespace) -> tuple[
        list[Timing], list[Timing], float]:
    """Send the same traffic (fixed seed) to ``url``; (batch, interactive, flood wall)."""
    rng = random.Random(args.seed)
    batch_prio = BATCH_PRIORITY if policy == "priority" else None
    inter_prio = INTERACTIVE_PRIORITY if policy == "priority" else None
    limits = httpx.Limits(max_connections=args.flood + 256, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=url, limits=limits,
                                 timeout=httpx.Timeout(args.request_timeout, connect=30.0)) as c:
        # Warm-up (JIT, first shapes), not counted.
        await stream_one(c, Timing("warmup", 0.0), prompt_ids(rng, args.batch_prompt_tokens), 4,
                         None)
        await stream_one(c, Timing("warmup", 0.0),
                         prompt_ids(rng, args.interactive_prompt_tokens), 4, None)
        batch = [Timing("batch", 0.0) for _ in range(args.flood)]
        start = time.monotonic()
        batch_tasks = [asyncio.ensure_future(stream_one(
            c, t, prompt_ids(rng, args.batch_prompt_tokens), args.batch_max_tokens, batch_prio))
            for t in batch]
        flood = asyncio.gather(*batch_tasks)
        interactive: list[Timing] = []
        inter_tasks = []
        k = 1
        while True:
            next_at = start + k * args.interval
            if next_at - start > args.duration:
                break
            if not flood.done():
                await asyncio.wait({flood}, timeout=max(0.0, next_at - time.monotonic()))
            if flood.done():
                break
            t = Timing("interactive", 0.0)
            interactive.append(t)
            inter_tasks.append(asyncio.ensure_future(stream_one(
                c, t, prompt_ids(rng, args.interactive_prompt_tokens),
                args.interactive_max_tokens, inter_prio)))
            k += 1
        await flood
        flood_wall = max(t.end for t in batch) - start
        await asyncio.gather(*inter_tasks)
    return batch, interactive, flood_wall


def summarize(policy: str, url: str, batch: list[Timing], interactive: list[Timing],
              flood_wall: float, preemptions: int | None, server_args: list[str]
              ) -> PolicyResult:
    ok_i = [t for t in interactive if t.error is None and t.ttft is not None]
    ok_b = [t for t in batch if t.error is None and t.ttft is not None]
    ttfts = [t.ttft for t in ok_i]
    out_tokens = sum(t.output_tokens for t in ok_b)
    return PolicyResult(
        policy=policy, url=url, interactive_count=len(interactive),
        interactive_failed=len(interactive) - len(ok_i), ttft_p50_s=pct(ttfts, 50),
        ttft_p99_s=pct(ttfts, 99), ttft_mean_s=float(np.mean(ttfts)) if ttfts else None,
        ttft_max_s=max(ttfts) if ttfts else None, batch_count=len(batch),
        batch_failed=len(batch) - len(ok_b), batch_output_tokens=out_tokens,
        flood_wall_s=flood_wall, batch_throughput_tok_s=out_tokens / flood_wall,
        batch_ttft_p50_s=pct([t.ttft for t in ok_b], 50), preemptions=preemptions,
        server_args=server_args)


def fmt(value: float | None, unit: str = "s") -> str:
    return "-" if value is None else f"{value:.3f} {unit}"


def format_table(results: list[PolicyResult]) -> str:
    rows = [("policy", "interactive n", "TTFT p50", "TTFT p99", "TTFT mean", "TTFT max",
             "batch tok/s", "flood wall", "batch TTFT p50", "preemptions")]
    for r in results:
        rows.append((r.policy, f"{r.interactive_count - r.interactive_failed}/"
                     f"{r.interactive_count}", fmt(r.ttft_p50_s), fmt(r.ttft_p99_s),
                     fmt(r.ttft_mean_s), fmt(r.ttft_max_s),
                     f"{r.batch_throughput_tok_s:.1f}", fmt(r.flood_wall_s),
                     fmt(r.batch_ttft_p50_s),
                     "-" if r.preemptions is None else str(r.preemptions)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="fcfs,priority",
                   help="comma-separated, run in this order (default fcfs,priority)")
    p.add_argument("--url", action="append", default=[], metavar="POLICY=URL",
                   help="use a running server for POLICY instead of starting one")
    p.add_argument("--model", default=None, help="checkpoint folder (default: default model)")
    p.add_argument("--flood", type=int, default=64, help="batch requests, all sent at t=0")
    p.add_argument("--batch-prompt-tokens", type=int, default=128)
    p.add_argument("--batch-max-tokens", type=int, default=16)
    p.add_argument("--interactive-prompt-tokens", type=int, default=16)
    p.add_argument("--interactive-max-tokens", type=int, default=32)
    p.add_argument("--interval", type=float, default=0.5,
                   help="seconds between interactive requests")
    p.add_argument("--duration", type=float, default=60.0,
                   help="stop sending interactive requests after this many seconds "
                        "(they also stop when the flood is done)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--request-timeout", type=float, default=900.0,
                   help="client-side timeout of one request, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--log-dir", default=None, help="server logs (default: a temp folder)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for policy in policies:
        if policy not in ("fcfs", "priority"):
            raise SystemExit(f"unknown policy {policy!r}")
    urls = dict(item.split("=", 1) for item in args.url)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench-hol-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    results = []
    t0 = time.monotonic()
    for policy in policies:
        server = None
        url = urls.get(policy)
        if url is None:
            server = start_server(policy, args, log_dir)
            url = server.base_url
        try:
            batch, interactive, wall = asyncio.run(run_policy(policy, url, args))
            preemptions = count_preemptions(server) if server is not None else None
        finally:
            if server is not None:
                server.stop()
        result = summarize(policy, url, batch, interactive, wall, preemptions,
                           server.args[3:] if server is not None else [])
        results.append(result)
        print(f"[{policy}] interactive TTFT p50 {fmt(result.ttft_p50_s)}, p99 "
              f"{fmt(result.ttft_p99_s)}; batch {result.batch_throughput_tok_s:.1f} tok/s "
              f"over {result.flood_wall_s:.1f} s", flush=True)
    print()
    print(format_table(results))
    print(f"\ntotal {time.monotonic() - t0:.0f} s; flood {args.flood} x "
          f"({args.batch_prompt_tokens} prompt + {args.batch_max_tokens} out), interactive "
          f"every {args.interval} s ({args.interactive_prompt_tokens} prompt + "
          f"{args.interactive_max_tokens} out); server logs in {log_dir}")
    if args.out:
        doc = {"params": {k: v for k, v in vars(args).items() if k != "url"},
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                           "python": platform.python_version()},
               "results": [asdict(r) for r in results]}
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
