#!/usr/bin/env python3
"""Pipeline parallelism (``-pp 2``) against one process, at 1 and 16 clients.

One ``kvserve serve`` per configuration (default model), one after the
other, measured by the same client (``kvserve.bench.replay``) with the same
load: ~100-word prompts (distinct per request), ``--output-tokens`` (128)
tokens streamed with EOS ignored at temperature 0, closed loops of each
``--clients`` count (1 and 16) sending ``--requests`` requests (4 and 32).

Configurations (``--configs``, in this order):

- ``one-process-2t``: ``kvserve serve --num-threads 2`` (the baseline: the
  2-core machine's both cores in one process);
- ``pp2``: ``kvserve serve -pp 2 --ray-address local``: a new local Ray, two
  stage actors of one thread each (Ray's 2 CPUs / 2 stages); the engine's
  process keeps the scheduler and sampler;
- ``one-process-1t``: ``kvserve serve --num-threads 1`` (one stage's share).

Per run: output tokens/s (completion tokens / the replay's duration, first
send to last completion), TTFT and ITL (p50 and p99), the load average
before and after, and from two scrapes of ``/metrics`` around the run:

- every step phase's mean seconds (``kvserve:step_phase_seconds``: delta of
  ``_sum`` / delta of ``_count``), and the engine's busy fraction (delta of
  ``kvserve:engine_busy_seconds_total`` / duration);
- with ``-pp``: each stage's mean step seconds
  (``kvserve:pipeline_stage_seconds``, the same deltas), its busy seconds
  (``kvserve:pipeline_stage_busy_seconds_total``) and the bubble fraction
  ``1 - sum_s busy_s / (P * duration)`` (the main session's definition,
  ``kvserve.observability.metrics``: the share of the P stages' time spent
  idle), and the engine's forward phase mean minus the slowest stage's
  mean and minus the sum of the stages' means. One micro-batch in flight
  (1 client) passes through the stages one after the other, so there
  forward - sum is the transfer overhead (Ray calls, object store); with
  two in flight a step's forward phase also waits behind the other
  micro-batch, and forward - max is what pipelining leaves on top of the
  slowest stage. The means are over every step of the run, the prompts'
  (prefill) steps included.

The record also holds the command lines, git commit, machine info and a
calibration (``kvserve.bench.calibration``). A Markdown table is printed
last; server logs go to ``--log-dir``. About 5 minutes on 2 cores.

    python tools/bench_pipeline.py --out docs/benchmarks/2026-12-02-pipeline-parallel.json
    python tools/bench_pipeline.py --configs pp2 --clients 1 --requests 2 --output-tokens 16
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from kvserve.bench import replay
from kvserve.bench.calibration import calibrate
from kvserve.bench.server import ServerProcess, exit_on_sigterm
from kvserve.bench.trace import TraceRequest
from kvserve.observability.metrics import parse_metrics_text

#: Configuration name -> its ``kvserve serve`` flags.
CONFIGS = {
    "one-process-2t": ["--num-threads", "2"],
    "pp2": ["-pp", "2", "--ray-address", "local"],
    "one-process-1t": ["--num-threads", "1"],
    # the last stage also runs the final norm and the LM head: one layer moved off it
    "pp2-16-14": ["-pp", "2", "--pp-layer-partition", "16,14", "--ray-address", "local"],
    "tp2": ["-tp", "2", "--ray-address", "local"],
}
PHASE = "kvserve:step_phase_seconds"
STAGE = "kvserve:pipeline_stage_seconds"
STAGE_BUSY = "kvserve:pipeline_stage_busy_seconds_total"
ENGINE_BUSY = "kvserve:engine_busy_seconds_total"

Samples = dict[str, list[tuple[dict[str, str], float]]]


# --------------------------------------------------------------------------- arithmetic


def bubble_fraction(busy_seconds: Sequence[float], wall_seconds: float) -> float:
    """The pipeline bubble over a window: ``1 - sum(busy_seconds) / (P * wall_seconds)``.

    Args:
        busy_seconds: seconds each of the P stages computed in the window
            (deltas of ``kvserve:pipeline_stage_busy_seconds_total``), length P.
        wall_seconds: the window's length in seconds.

    Returns:
        The fraction of the P stages' time spent idle, in [0, 1] when each
        stage's busy seconds are at most the window (0: every stage always busy;
        1 - 1/P: one stage busy at a time, as with one request in flight).

    Raises:
        ValueError: no stages, or a window of zero or negative length.

    Source: the pipeline metrics' definition in ``kvserve.observability.metrics``
    (GPipe's bubble, Huang et al. 2019, measured instead of modelled).
    """
    if not busy_seconds:
        raise ValueError("bubble_fraction needs at least one stage")
    if not wall_seconds > 0:
        raise ValueError(f"bubble_fraction needs a window > 0 s, got {wall_seconds}")
    return 1.0 - sum(busy_seconds) / (len(busy_seconds) * wall_seconds)


def sample_value(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
    return sum(value for have, value in samples.get(name, [])
               if all(have.get(k) == v for k, v in labels.items()))


def histogram_mean(before: Samples, after: Samples, name: str, **labels: str) -> float | None:
    """Mean observation of histogram ``name`` between two scrapes (seconds):
    delta of ``name_sum`` / delta of ``name_count``; None with no observation."""
    count = (sample_value(after, name + "_count", **labels)
             - sample_value(before, name + "_count", **labels))
    if count <= 0:
        return None
    total = (sample_value(after, name + "_sum", **labels)
             - sample_value(before, name + "_sum", **labels))
    return total / count


def label_values(samples: Samples, name: str, label: str) -> list[str]:
    """The values of ``label`` among ``name``'s samples, sorted as numbers where they are."""
    values = {have[label] for have, _ in samples.get(name, []) if label in have}
    return sorted(values, key=lambda v: (not v.isdigit(), int(v) if v.isdigit() else 0, v))


def step_figures(before: Samples, after: Samples, wall_seconds: float) -> dict:
    """The engine's and the pipeline's figures between two ``/metrics`` scrapes
    over a run of ``wall_seconds``:

    ``{"phase_mean_s": {phase: s}, "steps": n, "engine_busy_fraction": f,
    "pipeline": None | {"stages": P, "stage_mean_s": [s], "stage_steps": [n],
    "stage_busy_s": [s], "bubble_fraction": f, "forward_mean_s": s,
    "forward_minus_max_stage_s": s, "forward_minus_stage_sum_s": s}}``.
    ``pipeline`` is None without stage observations (one process)."""
    phases = {phase: histogram_mean(before, after, PHASE, phase=phase)
              for phase in label_values(after, PHASE + "_count", "phase")}
    steps = (sample_value(after, PHASE + "_count", phase="forward")
             - sample_value(before, PHASE + "_count", phase="forward"))
    busy = sample_value(after, ENGINE_BUSY) - sample_value(before, ENGINE_BUSY)
    result = {"phase_mean_s": {k: v for k, v in phases.items() if v is not None},
              "steps": int(steps), "engine_busy_s": busy,
              "engine_busy_fraction": busy / wall_seconds if wall_seconds > 0 else None,
              "pipeline": None}
    stages = label_values(after, STAGE + "_count", "stage")
    means = [histogram_mean(before, after, STAGE, stage=s) for s in stages]
    if not stages or any(m is None for m in means):
        return result
    stage_busy = [sample_value(after, STAGE_BUSY, stage=s) - sample_value(before, STAGE_BUSY,
                                                                           stage=s)
                  for s in stages]
    forward = phases.get("forward")
    result["pipeline"] = {
        "stages": len(stages), "stage_mean_s": means,
        "stage_steps": [int(sample_value(after, STAGE + "_count", stage=s)
                            - sample_value(before, STAGE + "_count", stage=s)) for s in stages],
        "stage_busy_s": stage_busy,
        "bubble_fraction": bubble_fraction(stage_busy, wall_seconds),
        "forward_mean_s": forward,
        "forward_minus_max_stage_s": None if forward is None else forward - max(means),
        "forward_minus_stage_sum_s": None if forward is None else forward - sum(means)}
    return result


# --------------------------------------------------------------------------- runs


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def scrape(base_url: str) -> Samples:
    """The server's ``/metrics`` now, parsed."""
    return parse_metrics_text(httpx.get(base_url + "/metrics", timeout=30).text)


def make_requests(tag: str, n: int, words: int, output_tokens: int) -> list[TraceRequest]:
    """``n`` requests whose ~``words``-word prompts ``replay`` synthesizes from
    their ids: distinct between requests, the same for every configuration."""
    return [TraceRequest(id=f"{tag}-{i}", arrival_s=0.0, cls=tag, prompt_tokens=words,
                         output_tokens=output_tokens) for i in range(n)]


def send(base_url: str, requests: list[TraceRequest], clients: int) -> tuple[list, float]:
    """A closed loop of ``clients`` (streaming, EOS ignored, temperature 0):
    ``run_replay``'s (results, duration in s)."""
    model = replay.first_model_id(replay.server_info(base_url))
    return asyncio.run(replay.run_replay(requests, base_url, model=model,
                                         max_concurrency=clients, temperature=0.0,
                                         progress=False, run_id="benchpipeline"))


def load_run(base_url: str, clients: int, n: int, args: argparse.Namespace) -> dict:
    """One closed-loop run with its latency summary, checks and step figures."""
    loadavg = _loadavg()
    before = scrape(base_url)
    results, duration = send(base_url, make_requests(f"c{clients}", n, args.prompt_words,
                                                     args.output_tokens), clients)
    after = scrape(base_url)
    summary = replay.summarize(results, duration)
    ok = [r for r in results if r.success]
    run = {"clients": clients, "requests": n, "completed": summary["completed"],
           "duration_s": duration, "output_tokens": summary["total_output_tokens"],
           "prompt_tokens": summary["total_input_tokens"],
           "output_tokens_per_s": summary["output_throughput"],
           **{key: summary[key] for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2el_ms")},
           "checks": {"usage_counted": sum(r.output_tokens_source == "usage" for r in ok),
                      "short_outputs": sum((r.output_tokens or 0) < args.output_tokens
                                           for r in ok),
                      "first_error": next((r.error for r in results if not r.success), None)},
           "metrics": step_figures(before, after, duration),
           "loadavg": [loadavg, _loadavg()]}
    print(f"  c={clients}: {run['output_tokens_per_s']:.1f} output tok/s, "
          f"{run['completed']}/{n} ok, checks {run['checks']}", file=sys.stderr, flush=True)
    return run


def measure_config(name: str, args: argparse.Namespace, log_dir: Path) -> dict:
    """Start the configuration's server, warm it up, run every client count."""
    flags = [*CONFIGS[name], *shlex.split(args.server_args)]
    print(f"{name}:", file=sys.stderr, flush=True)
    loadavg = _loadavg()
    started = time.monotonic()
    with ServerProcess(flags, log_path=log_dir / f"{name}.log") as server:
        start_s = time.monotonic() - started
        send(server.base_url, make_requests(f"{name}-warmup", 2, args.prompt_words, 16), 2)
        runs = {str(c): load_run(server.base_url, c, n, args)
                for c, n in zip(args.clients, args.requests, strict=True)}
        command = server.args
    return {"command": command, "command_line": shlex.join(command),
            "start_seconds": round(start_s, 1), "runs": runs,
            "minutes": round((time.monotonic() - started) / 60, 2),
            "loadavg": [loadavg, _loadavg()]}


# --------------------------------------------------------------------------- report


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1000:.1f}"


def format_table(result: dict) -> str:
    """One Markdown row per configuration and client count."""
    lines = ["| config | clients | output tok/s | TTFT p50 (ms) | ITL p50 (ms) | forward (ms) "
             "| stage steps (ms) | fwd - max stage (ms) | fwd - stage sum (ms) | bubble "
             "| load before -> after |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for name, config in result["configs"].items():
        for clients, run in config["runs"].items():
            metrics = run["metrics"]
            pipe = metrics["pipeline"] or {}
            stages = " / ".join(_ms(s) for s in pipe.get("stage_mean_s", []))
            bubble = pipe.get("bubble_fraction")
            lines.append(
                f"| {name} | {clients} | {run['output_tokens_per_s']:.1f} | "
                f"{run['ttft_ms']['median']:.1f} | {run['itl_ms']['median']:.1f} | "
                f"{_ms(metrics['phase_mean_s'].get('forward'))} | {stages} | "
                f"{_ms(pipe.get('forward_minus_max_stage_s'))} | "
                f"{_ms(pipe.get('forward_minus_stage_sum_s'))} | "
                f"{'' if bubble is None else f'{bubble:.3f}'} | "
                f"{run['loadavg'][0][0]} -> {run['loadavg'][1][0]} |")
    return "\n".join(lines)


def format_report(result: dict) -> str:
    git = result["git"]
    cal = result["calibration"]
    return "\n".join([
        format_table(result), "",
        "forward: the engine's forward phase mean per step; stage steps: each pipeline stage's "
        "mean forward per step in its process (means over all steps, prefill included).",
        f"git {git['commit']}{' (dirty)' if git['dirty'] else ''}; {os.cpu_count()} cores; "
        f"calibration: NumPy GEMM {cal['gemm_gflops']} GFLOP/s, one-core read "
        f"{cal['read_gbs']} GB/s, copy {cal['copy_gbs']} GB/s",
        f"results: {result['out']}"])


# --------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests", type=int, nargs="+", default=None,
                   help="requests of each --clients run (default: 4 at 1 client, else 2x)")
    p.add_argument("--prompt-words", type=int, default=100)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--server-args", default="",
                   help="extra 'kvserve serve' flags for every configuration, one string")
    p.add_argument("--out", default="results/bench_pipeline/results.json")
    p.add_argument("--log-dir", default="results/bench_pipeline",
                   help="the servers' logs (default %(default)s)")
    args = p.parse_args(argv)
    if args.requests is None:
        args.requests = [max(4, 2 * c) for c in args.clients]
    if len(args.requests) != len(args.clients):
        p.error("--requests needs one count per --clients value")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    out, log_dir = Path(args.out), Path(args.log_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"tool": "tools/bench_pipeline.py",
                    "command": shlex.join(["python", "tools/bench_pipeline.py",
                                           *(sys.argv[1:] if argv is None else argv)]),
                    "config": vars(args), "out": str(out), "git": replay.git_info(),
                    "machine": replay.machine_info(), "loadavg_before": _loadavg(),
                    "calibration": calibrate(), "configs": {}}
    for name in args.configs:
        result["configs"][name] = measure_config(name, args, log_dir)
        out.write_text(json.dumps(result, indent=1), encoding="utf-8")  # partial results too
    result["loadavg_after"] = _loadavg()
    out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
