"""Replay a JSONL trace against any OpenAI-compatible server and measure it.

Open loop by default: request *i* is sent at its ``arrival_s`` offset, whether
or not earlier ones have finished. ``--max-concurrency C`` caps the requests
in flight (a request that arrives when C are in flight waits for a slot; with
every arrival at 0 this is a closed loop of C users). Per request it records
TTFT, every inter-token (ITL) gap, TPOT, E2E latency, output tokens from the
server's usage, status codes and errors. Definitions follow vLLM's
``benchmark_serving``:

- TTFT: send -> first chunk with content;
- ITL: the gaps between consecutive content chunks (events - 1 gaps);
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with > 1 output token;
- E2E latency (``e2el``): send -> end of the stream;
- goodput: completed requests meeting *every* given SLO (``--goodput
  ttft:MS tpot:MS e2el:MS``), per second of benchmark.

Usage::

    python tools/replay.py --trace trace.jsonl --base-url http://127.0.0.1:8000 \
        --goodput ttft:500 tpot:100 --out result.json
    kvserve bench --trace trace.jsonl ...        # the same
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from kvserve.bench import BENCH_VERSION
from kvserve.bench.trace import TraceRequest, read_trace, trace_sha256
from kvserve.bench.workload import arrival_offsets, synth_text

METRICS = ("ttft", "tpot", "itl", "e2el")
#: Prompt-length buckets (tokens): [lo, hi) and their labels.
PROMPT_BUCKETS = ((0, 128, "<128"), (128, 512, "128-511"), (512, 2048, "512-2047"),
                  (2048, 1 << 62, ">=2048"))


@dataclass
class RequestResult:
    """What one request measured (times in seconds)."""

    id: str
    cls: str
    success: bool = False
    status: int | None = None
    error: str | None = None
    scheduled_s: float = 0.0  # the trace's arrival offset
    sent_s: float = 0.0  # when it was actually sent, from the benchmark start
    ttft: float | None = None
    e2el: float | None = None
    tpot: float | None = None
    itl: list[float] = field(default_factory=list)
    content_events: int = 0
    output_tokens: int | None = None
    output_tokens_source: str = "usage"  # "usage" or "events" (no usage chunk)
    prompt_tokens: int | None = None
    prompt_tokens_source: str = "usage"  # "usage" or "trace"
    finish_reason: str | None = None
    request_id: str | None = None  # the server's X-Request-Id, if it answered one

    def to_json(self) -> dict:
        data = asdict(self)
        data["class"] = data.pop("cls")
        return data


# --------------------------------------------------------------------------- client


def build_body(req: TraceRequest, endpoint: str, model: str | None, ignore_eos: bool,
               temperature: float, priority_via: str) -> dict:
    """The JSON body of ``req`` for ``/v1/chat/completions`` or ``/v1/completions``."""
    prompt = req.prompt
    if prompt is None and req.messages is None:
        seed = int.from_bytes(hashlib.sha256(req.id.encode()).digest()[:8], "little")
        prompt = synth_text(int(req.prompt_tokens or 16), np.random.default_rng(seed))
    body: dict = {"max_tokens": req.output_tokens, "temperature": temperature,
                  "stream": req.stream}
    if model:
        body["model"] = model
    if endpoint == "chat":
        body["messages"] = req.messages or [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt if prompt is not None else "\n".join(
            str(m.get("content", "")) for m in req.messages or [])
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True
    if req.priority is not None and priority_via in ("body", "both"):
        body["priority"] = req.priority
    return body


def build_headers(req: TraceRequest, priority_via: str, api_key: str | None,
                  run_id: str) -> dict:
    headers = {"X-Request-Class": req.cls, "X-Request-Id": f"{run_id}-{req.id}"[:128]}
    if req.priority is not None and priority_via in ("header", "both"):
        headers["X-Priority"] = str(req.priority)
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _content_of(chunk: dict, endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


def _finish_reason(chunk: dict) -> str | None:
    for choice in chunk.get("choices") or []:
        if choice.get("finish_reason"):
            return choice["finish_reason"]
    return None


async def send_request(client, url: str, req: TraceRequest, body: dict, headers: dict,
                       endpoint: str, bench_start: float) -> RequestResult:
    """Send one request and measure it (``client``: an ``httpx.AsyncClient``)."""
    import httpx

    res = RequestResult(id=req.id, cls=req.cls, scheduled_s=req.arrival_s)
    start = time.perf_counter()
    res.sent_s = start - bench_start
    last_content = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            res.status = resp.status_code
            res.request_id = resp.headers.get("x-request-id")
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                res.error = f"HTTP {resp.status_code}: {_error_message(text)}"
                res.e2el = time.perf_counter() - start
                return res
            usage = None
            if not req.stream:
                data = json.loads(await resp.aread())
                now = time.perf_counter()
                res.ttft = res.e2el = now - start
                usage = data.get("usage")
                res.finish_reason = _finish_reason(data)
                content = ""
                if data.get("choices"):
                    c = data["choices"][0]
                    content = (c.get("message") or {}).get("content") or c.get("text") or ""
                res.content_events = 1 if content else 0
            else:
                data_lines: list[str] = []
                async for line in resp.aiter_lines():
                    now = time.perf_counter()
                    if line.startswith("data:"):
                        data_lines.append(line[6:] if line[5:6] == " " else line[5:])
                        # OpenAI-style servers put one JSON object on one data line: handle
                        # it now so the timestamp is that of its arrival.
                        payload = "\n".join(data_lines)
                        if payload.strip() == "[DONE]":
                            data_lines = []
                            continue
                        try:
                            chunk = json.loads(payload)
                        except json.JSONDecodeError:
                            continue  # a multi-line event: wait for more lines
                        data_lines = []
                        if "error" in chunk and not chunk.get("choices"):
                            err = chunk["error"]
                            msg = err.get("message") if isinstance(err, dict) else str(err)
                            raise _StreamError(msg)
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        res.finish_reason = _finish_reason(chunk) or res.finish_reason
                        if _content_of(chunk, endpoint):
                            res.content_events += 1
                            if last_content is None:
                                res.ttft = now - start
                            else:
                                res.itl.append(now - last_content)
                            last_content = now
                    elif line == "":
                        data_lines = []
                res.e2el = time.perf_counter() - start
            if usage:
                res.output_tokens = usage.get("completion_tokens")
                res.prompt_tokens = usage.get("prompt_tokens")
            if res.output_tokens is None:
                res.output_tokens, res.output_tokens_source = res.content_events, "events"
            if res.prompt_tokens is None:
                res.prompt_tokens, res.prompt_tokens_source = req.prompt_tokens, "trace"
            if res.ttft is None:
                res.error = "stream ended without any content"
                return res
            if res.output_tokens and res.output_tokens > 1:
                res.tpot = (res.e2el - res.ttft) / (res.output_tokens - 1)
            res.success = True
    except _StreamError as exc:
        res.error = f"stream error: {exc}"
        res.e2el = time.perf_counter() - start
    except (httpx.HTTPError, OSError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        res.e2el = time.perf_counter() - start
    return res


class _StreamError(Exception):
    pass


def _error_message(text: str) -> str:
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict):
            return str(err.get("message"))[:300]
        return str(err)[:300]
    except (ValueError, AttributeError):
        return text[:300]


def retime(requests: list[TraceRequest], rate: float | None, burstiness: float = 1.0,
           seed: int = 0, num_requests: int | None = None) -> list[TraceRequest]:
    """The first ``num_requests`` of ``requests`` (cycled when more are asked
    for) with new arrival offsets: Poisson/gamma at ``rate`` (inf or None: all
    at 0). Without ``rate``, the trace's offsets are kept."""
    if num_requests is not None and num_requests != len(requests):
        base = requests
        requests = [replace(base[i % len(base)], id=f"{base[i % len(base)].id}"
                            + (f"-c{i // len(base)}" if i >= len(base) else ""))
                    for i in range(num_requests)]
    if rate is None:
        return requests
    if rate == float("inf"):
        offsets = np.zeros(len(requests))
    else:
        offsets = arrival_offsets(len(requests), "gamma" if burstiness != 1.0 else "poisson",
                                  rate, burstiness, seed)
    return [replace(r, arrival_s=round(float(t), 6)) for r, t in zip(requests, offsets, strict=True)]


async def run_replay(requests: list[TraceRequest], base_url: str, *, endpoint: str = "chat",
                     model: str | None = None, max_concurrency: int | None = None,
                     ignore_eos: bool = True, temperature: float = 0.0,
                     priority_via: str = "header", api_key: str | None = None,
                     timeout: float = 600.0, progress: bool = True,
                     run_id: str | None = None, extra_body: dict | None = None,
                     extra_headers: dict | None = None) -> tuple[list[RequestResult], float]:
    """Replay ``requests``; returns the per-request results (trace order) and the
    benchmark duration (first send -> last completion, seconds).

    ``extra_body`` fields (e.g. ``top_p``) and ``extra_headers`` (e.g.
    ``Connection: close``) are merged into every request."""
    import httpx

    run_id = run_id or f"bench{int(time.time()) % 1000000:06d}"
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    url = base_url.rstrip("/") + path
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(requests), desc="replay", unit="req", file=sys.stderr)
    limits = httpx.Limits(max_connections=max(len(requests), 1) + 4,
                          max_keepalive_connections=max(len(requests), 1) + 4)
    ends: list[float] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0),
                                 limits=limits) as client:
        start = time.perf_counter()

        async def one(req: TraceRequest) -> RequestResult:
            body = {**build_body(req, endpoint, model, ignore_eos, temperature, priority_via),
                    **(extra_body or {})}
            headers = {**build_headers(req, priority_via, api_key, run_id),
                       **(extra_headers or {})}
            if sem is None:
                res = await send_request(client, url, req, body, headers, endpoint, start)
            else:
                async with sem:
                    res = await send_request(client, url, req, body, headers, endpoint, start)
            ends.append(time.perf_counter())
            if bar is not None:
                bar.update(1)
            return res

        tasks = []
        for req in requests:
            delay = start + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = list(await asyncio.gather(*tasks))
    if bar is not None:
        bar.close()
    duration = (max(ends) - start) if ends else 0.0
    return results, duration


# --------------------------------------------------------------------------- summaries


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        for part in item.replace(",", " ").split():
            name, sep, value = part.partition(":")
            if not sep or name not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"bad --goodput item {part!r}: use ttft:MS, tpot:MS or e2el:MS")
            slos[name] = float(value)
            if slos[name] <= 0:
                raise ValueError(f"SLO {name} must be > 0 ms")
    return slos


def dist_stats(values_s: list[float]) -> dict:
    """mean/median/p90/p99/std/min/max of seconds, in milliseconds (n = count)."""
    if not values_s:
        return {"n": 0, "mean": None, "median": None, "p90": None, "p99": None,
                "std": None, "min": None, "max": None}
    a = np.asarray(values_s, dtype=float) * 1000.0
    return {"n": int(a.size), "mean": float(a.mean()), "median": float(np.median(a)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
            "std": float(a.std()), "min": float(a.min()), "max": float(a.max())}


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    """vLLM's goodput rule: every given SLO is met (a missing TPOT -- one output
    token -- counts as met)."""
    for name, limit_ms in slos.items():
        value = getattr(r, name)
        if value is not None and value * 1000.0 > limit_ms:
            return False
    return True


def summarize(results: list[RequestResult], duration: float,
              slos: dict[str, float] | None = None) -> dict:
    """Counts, latency distributions, throughputs and goodput of ``results``
    over ``duration`` seconds (the whole benchmark's, also for a group)."""
    ok = [r for r in results if r.success]
    statuses: dict[str, int] = {}
    errors: dict[str, int] = {}
    for r in results:
        key = str(r.status) if r.status is not None else "none"
        statuses[key] = statuses.get(key, 0) + 1
        if not r.success:
            kind = (r.error or "unknown").split(":")[0][:80]
            errors[kind] = errors.get(kind, 0) + 1
    out_tokens = sum(int(r.output_tokens or 0) for r in ok)
    in_tokens = sum(int(r.prompt_tokens or 0) for r in ok)
    d = duration if duration > 0 else float("nan")
    summary = {
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "error_rate": (len(results) - len(ok)) / len(results) if results else 0.0,
        "status_codes": statuses, "errors": errors,
        "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / d, "output_throughput": out_tokens / d,
        "total_token_throughput": (in_tokens + out_tokens) / d,
        "ttft_ms": dist_stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": dist_stats([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": dist_stats([g for r in ok for g in r.itl]),
        "e2el_ms": dist_stats([r.e2el for r in ok if r.e2el is not None]),
    }
    if slos:
        good = [r for r in ok if meets_slos(r, slos)]
        summary["goodput"] = {"slos_ms": dict(slos), "good_requests": len(good),
                              "request_goodput": len(good) / d,
                              "good_fraction": len(good) / len(results) if results else 0.0}
    return summary


def prompt_bucket(tokens: int | None) -> str:
    if tokens is None:
        return "unknown"
    for lo, hi, label in PROMPT_BUCKETS:
        if lo <= tokens < hi:
            return label
    return "unknown"


def summarize_all(results: list[RequestResult], duration: float,
                  slos: dict[str, float] | None = None) -> dict:
    """Overall, per class and per prompt-length bucket."""
    by_class: dict[str, list[RequestResult]] = {}
    by_bucket: dict[str, list[RequestResult]] = {}
    for r in results:
        by_class.setdefault(r.cls, []).append(r)
        by_bucket.setdefault(prompt_bucket(r.prompt_tokens), []).append(r)
    order = [label for _, _, label in PROMPT_BUCKETS] + ["unknown"]
    return {
        "overall": summarize(results, duration, slos),
        "by_class": {k: summarize(v, duration, slos) for k, v in sorted(by_class.items())},
        "by_prompt_bucket": {k: summarize(by_bucket[k], duration, slos)
                             for k in order if k in by_bucket},
    }


# --------------------------------------------------------------------------- provenance


def _run(cmd: list[str], cwd: str | None = None, timeout: float = 10.0) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_info() -> dict:
    """Commit and dirty flag of the checkout this code runs from (None outside git)."""
    here = str(Path(__file__).resolve().parent)
    commit = _run(["git", "rev-parse", "HEAD"], cwd=here)
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here)
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def machine_info() -> dict:
    """CPU model, cores, memory, OS, Python and GPUs (from ``nvidia-smi`` if present)."""
    cpu_model = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    gpus = []
    smi = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                "--format=csv,noheader"])
    for line in (smi or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if parts and parts[0]:
            gpus.append({"name": parts[0], "memory": parts[1] if len(parts) > 1 else None,
                         "driver": parts[2] if len(parts) > 2 else None})
    return {"cpu_model": cpu_model or platform.processor() or None, "cpu_count": os.cpu_count(),
            "cpus_usable": usable, "memory_bytes": mem, "platform": platform.platform(),
            "python": platform.python_version(), "gpus": gpus}


def model_checksum(path: str | Path) -> dict:
    """sha256 of a local model: per file (config, tokenizer, weights) and combined."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(
        f for f in p.iterdir() if f.is_file() and (f.suffix in (".safetensors", ".gguf", ".bin")
                                                   or f.name.endswith(".json")))
    combined = hashlib.sha256()
    per_file = {}
    for f in files:
        digest = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                digest.update(block)
        per_file[f.name] = digest.hexdigest()
        combined.update(f"{f.name}:{per_file[f.name]}\n".encode())
    return {"path": str(p), "sha256": combined.hexdigest(), "files": per_file}


def server_info(base_url: str, api_key: str | None = None) -> dict:
    """The server's ``/v1/models`` and ``/version`` answers (status code if not 200)."""
    import httpx

    info: dict = {"base_url": base_url}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for name, path in (("models", "/v1/models"), ("version", "/version")):
        try:
            resp = httpx.get(base_url.rstrip("/") + path, headers=headers, timeout=10.0)
            if resp.status_code == 200:
                try:
                    info[name] = resp.json()
                except ValueError:
                    info[name] = resp.text[:1000]
            else:
                info[name] = {"status": resp.status_code}
        except httpx.HTTPError as exc:
            info[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return info


def first_model_id(info: dict) -> str | None:
    models = info.get("models")
    if isinstance(models, dict) and models.get("data"):
        return models["data"][0].get("id")
    return None


def provenance(trace_path: str | Path | None, base_url: str, server: dict,
               model_path: str | None, trace_meta: dict | None = None) -> dict:
    import kvserve

    return {
        "tool": {"name": "kvserve.bench.replay", "version": BENCH_VERSION,
                 "kvserve_version": getattr(kvserve, "__version__", None)},
        "git": git_info(),
        "trace": None if trace_path is None else {
            "path": str(trace_path), "sha256": trace_sha256(trace_path), "meta": trace_meta or {}},
        "server": server, "server_url": base_url,
        "model_checksum": model_checksum(model_path) if model_path else None,
        "machine": machine_info(),
        "started_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": [Path(sys.argv[0]).name, *sys.argv[1:]],
    }


# --------------------------------------------------------------------------- report


def format_summary(summary: dict, title: str = "Serving benchmark result") -> str:
    """A vLLM-style text block of one summary."""
    lines = [f"{'=' * 16} {title} {'=' * 16}"]

    def row(label: str, value) -> None:
        if isinstance(value, float):
            value = f"{value:.2f}"
        lines.append(f"{label:<40}{value!s:>12}")

    row("Requests (completed / total):", f"{summary['completed']}/{summary['num_requests']}")
    row("Failed requests:", summary["failed"])
    row("Status codes:", ",".join(f"{k}x{v}" for k, v in summary["status_codes"].items()))
    row("Benchmark duration (s):", summary["duration_s"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total output tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    if "goodput" in summary:
        g = summary["goodput"]
        row("Request goodput (req/s):", g["request_goodput"])
        row("Good requests (SLOs " + " ".join(f"{k}:{v:g}" for k, v in g["slos_ms"].items())
            + "):", g["good_requests"])
    for metric in METRICS:
        st = summary[f"{metric}_ms"]
        if not st["n"]:
            continue
        lines.append(f"{'-' * 10} {metric.upper()} (ms, n={st['n']}) {'-' * 10}")
        for key in ("mean", "median", "p90", "p99"):
            row(f"  {key}:", st[key])
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The replay flags (shared by ``tools/replay.py`` and ``kvserve bench``)."""
    p.add_argument("--trace", required=True, help="JSONL trace (tools/README.md)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server to replay against (default %(default)s)")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                   help="/v1/chat/completions or /v1/completions")
    p.add_argument("--model", default=None,
                   help="model name for the request body (default: the first of /v1/models)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="cap requests in flight (closed loop with all arrivals at 0); default: "
                        "the trace meta's concurrency, else unlimited (open loop)")
    p.add_argument("--request-rate", type=float, default=None,
                   help="replace the trace's arrivals by Poisson (or gamma) arrivals at this "
                        "rate in req/s; 'inf' sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape for --request-rate (1 = Poisson)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="replay this many requests (the trace's first, cycled if needed)")
    p.add_argument("--seed", type=int, default=0, help="seed of --request-rate arrivals")
    p.add_argument("--goodput", nargs="+", default=None, metavar="SLO",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS (any subset)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (outputs may then be shorter than the trace's)")
    p.add_argument("--priority-via", choices=["header", "body", "both", "none"],
                   default="header", help="how a trace priority is sent (X-Priority header)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="Bearer token (default $OPENAI_API_KEY)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--warmup", type=int, default=0,
                   help="send this many of the trace's requests first, unmeasured")
    p.add_argument("--model-path", default=None,
                   help="local model folder/file: its sha256 goes into the provenance")
    p.add_argument("--launch-server", action="store_true",
                   help="start 'kvserve serve' on a free port for this run (ignores --base-url)")
    p.add_argument("--server-args", default="",
                   help="flags for the launched server, one string (e.g. '--kv-cache-memory 256MiB')")
    p.add_argument("--server-log", default=None, help="launched server's log file")
    p.add_argument("--label", default=None, help="free text stored in the result")
    p.add_argument("--calibrate", action="store_true",
                   help="record the machine: load average before and after the run and "
                        "kvserve.bench.calibration's figures (compare judges in their units)")
    p.add_argument("--out", default=None, help="write the result JSON here")
    p.add_argument("--per-request", action=argparse.BooleanOptionalAction, default=True,
                   help="keep per-request records in the result JSON (default on)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--quiet", action="store_true", help="print no summary")


def replay_trace(args: argparse.Namespace, base_url: str) -> dict:
    """Run a replay as described by parsed ``args`` against ``base_url``; the result dict."""
    slos = parse_goodput(args.goodput)
    requests, meta = read_trace(args.trace)
    if not requests:
        raise ValueError(f"trace {args.trace} has no requests")
    rate = args.request_rate
    requests = retime(requests, rate, args.burstiness, args.seed, args.num_requests)
    max_conc = args.max_concurrency or meta.get("concurrency")
    server = server_info(base_url, args.api_key)
    model = args.model or first_model_id(server)
    common = dict(endpoint=args.endpoint, model=model, ignore_eos=args.ignore_eos,
                  temperature=args.temperature, priority_via=args.priority_via,
                  api_key=args.api_key, timeout=args.timeout)
    machine = {"loadavg_before": [round(x, 2) for x in os.getloadavg()]}
    results, duration = replay_with_warmup(requests, base_url, args.warmup, max_conc,
                                           args.progress, **common)
    machine["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    if getattr(args, "calibrate", False):
        from kvserve.bench.calibration import calibrate

        machine["calibration"] = calibrate(repeats=3)
    result = {
        "schema": "kvserve.bench.result/1",
        "label": args.label,
        "provenance": provenance(args.trace, base_url, server, args.model_path, meta),
        "config": {"endpoint": args.endpoint, "model": model, "max_concurrency": max_conc,
                   "request_rate": rate, "burstiness": args.burstiness,
                   "num_requests": len(requests), "ignore_eos": args.ignore_eos,
                   "temperature": args.temperature, "priority_via": args.priority_via,
                   "goodput_slos_ms": slos, "warmup": args.warmup,
                   "mode": "closed-loop" if max_conc and all(r.arrival_s == 0 for r in requests)
                   else "open-loop"},
        "summary": summarize_all(results, duration, slos),
        "machine": machine,
    }
    if args.per_request:
        result["requests"] = [r.to_json() for r in results]
    return result


def run_cli(args: argparse.Namespace) -> int:
    """Run parsed replay ``args``; 0 when every request completed, 1 otherwise."""
    server = None
    try:
        if args.launch_server:
            from kvserve.bench.server import ServerProcess, exit_on_sigterm
            exit_on_sigterm()
            log = args.server_log or (str(Path(args.out).with_suffix(".server.log"))
                                      if args.out else None)
            server = ServerProcess(shlex.split(args.server_args), log_path=log)
            base_url = server.base_url
        else:
            base_url = args.base_url
        result = replay_trace(args, base_url)
    except (ValueError, FileNotFoundError) as exc:
        print(f"replay: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            server.stop()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    overall = result["summary"]["overall"]
    if not args.quiet:
        print(format_summary(overall))
        if args.out:
            print(f"result: {args.out}")
    return 0 if overall["failed"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="replay", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())


def replay_with_warmup(requests: list, base_url: str, warmup: int, max_concurrency: int | None,
                       progress: bool, **common) -> tuple[list, float]:
    """Send the first ``warmup`` requests at once (results discarded), then
    replay ``requests``; returns ``run_replay``'s (results, duration in s)."""
    if warmup:
        warm = [replace(r, arrival_s=0.0, id=f"warmup-{r.id}") for r in requests[:warmup]]
        asyncio.run(run_replay(warm, base_url, progress=False, **common))
    return asyncio.run(run_replay(requests, base_url, max_concurrency=max_concurrency,
                                  progress=progress, **common))
