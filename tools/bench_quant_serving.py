#!/usr/bin/env python3
"""The quantization schemes served side by side with llama.cpp: one run, one table.

For llama.cpp's ``llama-server`` on the default model's Q4_1 GGUF and for
``kvserve serve --quantization S`` with S in ``--schemes`` (default none,
int8, w8a8, q4), one server at a time on this machine, the same client
(``kvserve.bench.replay``, the workload of ``tools/bench_vs_llamacpp.py``:
~100-word prompts, ``--output-tokens`` streamed with EOS ignored, T = 0):

- weights bytes: kvserve's ``engine_loaded`` log event; llama.cpp: the GGUF's size;
- KV tokens at ``--kv-cache-memory`` (kvserve's ``kv_cache_size`` event; the
  CPU backend spends the flag on KV blocks alone, so it is the same for
  every scheme), and within a fixed total of float32 weights + that KV
  memory (what the weight bytes a scheme saves add, at kvserve's float32
  KV bytes per token); llama.cpp: the flag's bytes over its float16 KV
  bytes per token (2 x layers x KV heads x head_dim x 2 bytes);
- single-client decode: output tokens/s of a closed loop of 1 client
  (4 requests), and its ITL p50;
- 32-way throughput: output tokens/s of 32 clients (64 requests);
- perplexity of ``tests/data/public_domain_en.txt`` (``kvserve.testing.quality``,
  in-process) by kvserve's definition (all tokens, windows of 512) and by
  llama.cpp's (``llama-perplexity -c 512``: whole windows, second halves);
  llama.cpp's own figure comes from ``llama-perplexity`` itself.

llama.cpp is built as ``tools/bench_vs_llamacpp.py`` builds it (plus the
``llama-perplexity`` target). Usage::

    python tools/bench_quant_serving.py --out results/quant_serving/results.json
    python tools/bench_quant_serving.py --schemes int8 q4 --skip-llamacpp --quick

Prints the Markdown table last, with the load average before and after
each server's runs.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from bench_vs_llamacpp import (SLOT_TOKENS, _check, _loadavg, ensure_gguf, ensure_llamacpp,
                               llama_server, load_run, make_requests, send)

from kvserve.bench import replay
from kvserve.bench.server import ServerProcess, exit_on_sigterm
from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.model.default_model import cache_dir, ensure_default_model
from kvserve.testing.quality import perplexity, start_engine

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "tests" / "data" / "public_domain_en.txt"
WINDOW = 512
KV_MEMORY = 1 << 30
#: SmolLM2-135M: 30 layers, 3 KV heads of 64.
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


def kv_bytes_per_token(dtype_bytes: int) -> int:
    """K and V of one token in every layer."""
    return 2 * LAYERS * KV_HEADS * HEAD_DIM * dtype_bytes


def log_events(path: Path) -> dict[str, dict]:
    """The last JSON log event of each name in a server log."""
    events: dict[str, dict] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            events[event.get("event", "")] = event
    return events


def decode_runs(base_url: str, args: argparse.Namespace) -> dict:
    """Warm-up, then the single-client and 32-client closed loops at T = 0."""
    send(base_url, make_requests("warmup", 2, 100, 16), 2)
    single = load_run(base_url, 1, 2 if args.quick else 4, args.output_tokens, 0.0, None)
    many = load_run(base_url, args.clients, args.clients if args.quick else 2 * args.clients,
                    args.output_tokens, 0.0, None)
    return {"single": single, "many": many}


def measure_kvserve(scheme: str, args: argparse.Namespace, out_dir: Path) -> dict:
    """One ``kvserve serve --quantization scheme``: bytes, KV tokens, decode runs."""
    print(f"kvserve --quantization {scheme}:", file=sys.stderr, flush=True)
    log = out_dir / f"kvserve-{scheme}.log"
    flags = ["--quantization", scheme, "--max-num-seqs", str(max(64, args.clients)),
             "--kv-cache-memory", str(KV_MEMORY)]
    before = _loadavg()
    with ServerProcess(flags, log_path=log) as server:
        runs = decode_runs(server.base_url, args)
    events = log_events(log)
    return {"runs": runs, "loadavg": [before, _loadavg()],
            "weights_bytes": events["engine_loaded"]["weights_bytes"],
            "kv_tokens": events["kv_cache_size"]["num_tokens"],
            "kv_bytes_per_token": events["kv_cache_size"]["kv_bytes_per_token"]}


def kvserve_perplexity(scheme: str) -> dict:
    """Both conventions' perplexity of the shipped text, in-process."""
    config = EngineConfig(model=str(ensure_default_model()), quantization=scheme,
                          cache=CacheConfig(kv_cache_memory=256 << 20),
                          scheduler=SchedulerConfig(max_num_batched_tokens=512))

    async def run() -> dict:
        engine = await start_engine(config)
        try:
            ids = engine.tokenizer.encode(TEXT.read_text(encoding="utf-8"))
            own = await perplexity(engine, ids, WINDOW)
            llama = await perplexity(engine, ids, WINDOW, llamacpp_convention=True)
            return {"ppl": own.value, "ppl_llamacpp_convention": llama.value,
                    "tokens": own.num_tokens}
        finally:
            await engine.shutdown()

    return asyncio.run(run())


def measure_llamacpp(args: argparse.Namespace, out_dir: Path) -> dict:
    """``llama-server`` decode runs, and ``llama-perplexity`` on the same text."""
    root = Path(args.llamacpp_dir)
    binaries, gguf = ensure_llamacpp(root), ensure_gguf(root)
    print("llama.cpp:", file=sys.stderr, flush=True)
    before = _loadavg()
    with llama_server(binaries["llama-server"], gguf, args.clients, args.clients * SLOT_TOKENS,
                      out_dir / "llama-server.log") as server:
        runs = decode_runs(server.base_url, args)
    result = {"runs": runs, "loadavg": [before, _loadavg()], "weights_bytes": gguf.stat().st_size,
              "kv_tokens": KV_MEMORY // kv_bytes_per_token(2), "gguf": str(gguf)}
    result["ppl_llamacpp_convention"] = llama_perplexity(root, gguf)
    return result


def llama_perplexity(root: Path, gguf: Path) -> float | None:
    """``llama-perplexity -c 512 -t 2`` on the shipped text (built if missing)."""
    binary = root / "build" / "bin" / "llama-perplexity"
    if not binary.is_file():
        _check(["cmake", "--build", str(root / "build"), "-j2", "--target", "llama-perplexity"])
    proc = subprocess.run([str(binary), "-m", str(gguf), "-f", str(TEXT), "-c", str(WINDOW),
                           "-t", "2"], capture_output=True, text=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", proc.stdout + proc.stderr)
    return float(found.group(1)) if found else None


# --------------------------------------------------------------------------- report


def table(result: dict) -> str:
    """Markdown: one row per server, the figures of the module docstring."""
    rows = ["| server | weights MiB | KV tokens at --kv-cache-memory 1 GiB | KV tokens, "
            "same total as float32 | 1 client tok/s | 1 client ITL p50 ms | "
            f"{result['config']['clients']} clients tok/s | perplexity | perplexity "
            "(llama.cpp's convention) |", "|---|" + "---:|" * 8]
    base = result.get("kvserve", {}).get("none")
    for name, r in _servers(result):
        total = None
        if base is not None and "kv_bytes_per_token" in r:
            total = r["kv_tokens"] + (base["weights_bytes"] - r["weights_bytes"]) \
                // r["kv_bytes_per_token"]
        elif "kv_bytes_per_token" not in r:
            total = r["kv_tokens"]
        cells = [r["weights_bytes"] / 2**20, r["kv_tokens"], total,
                 _get(r, "runs", "single", "output_throughput"),
                 _get(r, "runs", "single", "itl_ms", "median"),
                 _get(r, "runs", "many", "output_throughput"),
                 r.get("ppl"), r.get("ppl_llamacpp_convention")]
        rows.append(f"| {name} | " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(rows)


def _servers(result: dict):
    if "llamacpp" in result:
        yield "llama.cpp (Q4_1 GGUF)", result["llamacpp"]
    for scheme, r in result.get("kvserve", {}).items():
        yield f"kvserve {scheme}", r


def _get(data, *keys):
    for key in keys:
        if not isinstance(data, dict) or data.get(key) is None:
            return None
        data = data[key]
    return data


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.3f}" if value < 100 else f"{value:,.1f}"


def ratios(result: dict) -> str:
    """The issue's goal ratios, from this run."""
    kv = result.get("kvserve", {})
    llama = result.get("llamacpp")
    lines = []

    def tps(r, run):
        return _get(r, "runs", run, "output_throughput")

    for scheme in ("q4", "int8"):
        if scheme in kv and tps(kv[scheme], "single"):
            mine = tps(kv[scheme], "single")
            if llama and tps(llama, "single"):
                lines.append(f"- 1 client, {scheme} / llama.cpp: {mine / tps(llama, 'single'):.2f}x")
            if "none" in kv and tps(kv["none"], "single"):
                lines.append(f"- 1 client, {scheme} / kvserve float32: "
                             f"{mine / tps(kv['none'], 'single'):.2f}x")
    if "w8a8" in kv and "none" in kv and tps(kv["none"], "many"):
        lines.append(f"- {result['config']['clients']} clients, w8a8 / float32: "
                     f"{tps(kv['w8a8'], 'many') / tps(kv['none'], 'many'):.2f}x")
    return "\n".join(lines)


def report(result: dict) -> str:
    loads = "; ".join(f"{name}: {' -> '.join(map(str, r['loadavg']))}"
                      for name, r in _servers(result))
    git = result["kvserve_git"]
    return "\n".join([table(result), "", ratios(result), "",
                      f"load average (1/5/15 min, {os.cpu_count()} cores) over each server's "
                      f"runs: {loads}",
                      f"kvserve: git {git['commit']}{' (dirty)' if git['dirty'] else ''}",
                      f"results: {result['out']}"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", nargs="+", default=["none", "int8", "w8a8", "q4"])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=None,
                   help="tokens per request (default 128; 32 with --quick)")
    p.add_argument("--quick", action="store_true", help="smoke run: fewer, shorter requests")
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument("--skip-perplexity", action="store_true")
    p.add_argument("--llamacpp-dir", default=str(cache_dir() / "llama.cpp"))
    p.add_argument("--out", default="results/quant_serving/results.json")
    args = p.parse_args(argv)
    if args.output_tokens is None:
        args.output_tokens = 32 if args.quick else 128
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"config": vars(args), "out": str(out), "kvserve_git": replay.git_info(),
                    "machine": replay.machine_info(), "loadavg_before": _loadavg()}
    if not args.skip_llamacpp:
        result["llamacpp"] = measure_llamacpp(args, out.parent)
    result["kvserve"] = {}
    for scheme in args.schemes:
        r = measure_kvserve(scheme, args, out.parent)
        if not args.skip_perplexity:
            r.update(kvserve_perplexity(scheme))
        result["kvserve"][scheme] = r
        out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    result["loadavg_after"] = _loadavg()
    out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
