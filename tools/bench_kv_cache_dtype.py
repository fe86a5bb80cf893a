#!/usr/bin/env python3
"""The KV cache's dtype, measured in one run: float32 (``auto``) against ``int8``.

For each ``--kv-cache-dtype`` in turn, one ``kvserve serve`` with the same
flags (``--kv-cache-memory``, ``--server-args``) and the same closed-loop
load (``--concurrency`` clients, 100-word prompts, ``--output-tokens``
greedy tokens, EOS ignored, streaming; the client of
``tools/bench_vs_llamacpp.py``):

- from the server's own start-up log: KV bytes per token, the ``KV cache
  size`` in tokens and the ``Maximum concurrency`` line;
- output tokens/s, TTFT and ITL, and the step split (schedule / prepare /
  forward / sample / emit, ms per step) from ``/metrics``;

then (``--quality``, on by default) ``tools/quality.py``'s rows in this
process: perplexity of ``tests/data/public_domain_en.txt`` and greedy
agreement / decode match against float weights over the float cache, for
``none:int8`` and each ``--quality-schemes`` entry. The machine's load
average before and after each part and a calibration (NumPy GEMM, one
core's read and copy: ``kvserve.bench.calibration``) go with the JSON.

    python tools/bench_kv_cache_dtype.py --out docs/benchmarks/2026-12-02-kv-int8.json
    python tools/bench_kv_cache_dtype.py --server-args "--quantization w4a8" --no-quality
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import asyncio
import json
import os
import platform
import shlex
import sys
import tempfile
from pathlib import Path

from kvserve.bench.calibration import calibrate
from kvserve.bench.server import ServerProcess, exit_on_sigterm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vs_llamacpp as vs  # noqa: E402  (the same client, requests and step split)
import quality  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DTYPES = ("auto", "int8")
#: Start-up events read from the server's JSON log, and the fields kept.
STARTUP_EVENTS = {"kv_cache_size": ("num_tokens", "num_blocks", "kv_bytes_per_token",
                                    "kv_cache_dtype", "message"),
                  "max_concurrency": ("max_concurrency", "max_model_len", "message")}


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def startup_facts(log: Path) -> dict:
    """``{event: {field: value}}`` of ``STARTUP_EVENTS`` in kvserve's JSON log."""
    facts: dict = {}
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        fields = STARTUP_EVENTS.get(event.get("event"))
        if fields is not None:
            facts[event["event"]] = {f: event.get(f) for f in fields}
    return facts


def serve_and_load(kv_dtype: str, args: argparse.Namespace, out_dir: Path) -> dict:
    """One server with ``--kv-cache-dtype kv_dtype``: its start-up facts and
    one warm-up, then the load run."""
    flags = ["--max-num-seqs", str(max(64, args.concurrency)),
             "--kv-cache-memory", args.kv_cache_memory, "--kv-cache-dtype", kv_dtype,
             *shlex.split(args.server_args)]
    log = out_dir / f"kvserve-{kv_dtype}.log"
    before = _loadavg()
    print(f"kvserve --kv-cache-dtype {kv_dtype}:", file=sys.stderr, flush=True)
    with ServerProcess(flags, log_path=log) as server:
        vs.send(server.base_url, vs.make_requests("warmup", 2, vs.PROMPT_WORDS, 16), 2)
        n = args.requests or 2 * args.concurrency
        run = vs.load_run(server.base_url, args.concurrency, n, args.output_tokens, 0.0, None)
        command = server.args
    return {"command": command, "startup": startup_facts(log), "load": run,
            "loadavg": [before, _loadavg()]}


def quality_rows(args: argparse.Namespace) -> dict:
    """``tools/quality.py``'s rows for float, ``none:int8`` and ``--quality-schemes``."""
    from kvserve.model.default_model import ensure_default_model

    qargs = argparse.Namespace(
        model=str(ensure_default_model()), backend="cpu",
        schemes=["none:int8", *args.quality_schemes],
        text=str(REPO / "tests" / "data" / "public_domain_en.txt"), window=args.window,
        prompts=None, max_tokens=32)
    before = _loadavg()
    rows = asyncio.run(quality.evaluate(qargs))
    return {"rows": rows, "window": args.window, "loadavg": [before, _loadavg()]}


def report(result: dict) -> str:
    """The Markdown tables of ``result``."""
    runs = result["serving"]
    base = runs["auto"]
    lines = ["| KV cache | bytes per token | KV tokens | max concurrency | "
             f"tok/s at {result['config']['concurrency']} | vs float | forward ms/step | "
             "ITL p50 ms |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for dtype, run in runs.items():
        kv = run["startup"].get("kv_cache_size", {})
        conc = run["startup"].get("max_concurrency", {})
        load = run["load"]
        split = (load.get("step_split") or {}).get("ms_per_step", {})
        ratio = load["output_throughput"] / base["load"]["output_throughput"]
        lines.append(f"| {dtype} | {kv.get('kv_bytes_per_token', 0):,} | "
                     f"{kv.get('num_tokens', 0):,} | {conc.get('max_concurrency')}x | "
                     f"{load['output_throughput']:.1f} | {ratio:.2f}x | "
                     f"{split.get('forward', float('nan')):.1f} | "
                     f"{load['itl_ms']['median']:.1f} |")
    quality_result = result.get("quality")
    if quality_result:
        rows = quality_result["rows"]
        ref = rows[0]["perplexity"]
        lines += ["", "| weights:KV | perplexity | vs float | greedy agreement | decode match |",
                  "|---|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['scheme']} | {r['perplexity']:.3f} | "
                         f"{r['perplexity'] / ref - 1:+.2%} | {r['agreement']:.3f} | "
                         f"{r['decode_match']:.3f} |")
    cal = result["calibration"]
    lines += ["", f"load average {result['loadavg_before']} before, {result['loadavg_after']} "
                  f"after; calibration: GEMM {cal['gemm_gflops']} GFLOP/s, read "
                  f"{cal['read_gbs']} GB/s, copy {cal['copy_gbs']} GB/s"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=None, help="default: 2 x concurrency")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--server-args", default="", help="extra 'kvserve serve' flags, one string")
    p.add_argument("--no-quality", dest="quality", action="store_false")
    p.add_argument("--quality-schemes", nargs="*", default=["q4", "q4:int8", "w4a8", "w4a8:int8"],
                   help="tools/quality.py schemes after none:int8 (QUANT or QUANT:KV)")
    p.add_argument("--window", type=int, default=512, help="perplexity window, tokens")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    args = parse_args(argv)
    result: dict = {"config": vars(args), "machine": {
        "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "python": platform.python_version()}, "loadavg_before": _loadavg()}
    result["calibration"] = calibrate()
    with tempfile.TemporaryDirectory(prefix="kv-dtype-") as tmp:
        result["serving"] = {d: serve_and_load(d, args, Path(tmp)) for d in DTYPES}
    if args.quality:
        result["quality"] = quality_rows(args)
    result["loadavg_after"] = _loadavg()
    text = report(result)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
