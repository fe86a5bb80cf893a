"""Soak test: bounded mixed traffic against a server on loopback, then leak checks.

``--concurrency`` workers (seeded, each with its own random stream) send, until
``--duration`` seconds or ``--max-requests`` requests, a mix of: streaming and
non-streaming requests to ``/v1/chat/completions`` and ``/v1/completions``
with short prompts and 1..``--max-tokens`` tokens; streams the client hangs up
on after 1-2 chunks; bad requests (invalid JSON, unknown model, negative
``max_tokens``, wrong types, ...) that must get a 4xx; bursts of
``--burst-size`` requests at once; prompts too long for ``max_model_len``
(from ``GET /v1/models``) that must get a 400; slow clients that pause
between chunks; and three hostile kinds, a few percent each:

- ``constraint``: a chat (``max_tokens`` 4-8, temperature 0) with a
  structured-output constraint in one of ``guided_json``,
  ``response_format`` (``json_schema``), ``guided_regex``,
  ``guided_choice``, ``guided_grammar`` or ``tools`` (with ``tool_choice:
  "required"``): ``oversized`` (70-100 KB, over kvserve's default
  ``--structured-outputs-max-bytes`` of 64 KiB) and ``invalid`` (a small
  one that does not compile, e.g. ``{"type": "nonsense"}``) must get a
  400; ``large`` (40-56 KB, valid, salted so that the server's compile
  cache never has it: each one costs a real compile; not in ``tools``, whose
  schemas also go into the prompt) must complete;
- ``smuggle``: request smuggling on a raw TCP connection: a ``POST
  /v1/completions`` with both ``Content-Length`` and ``Transfer-Encoding``
  (``chunked``, ``gzip, chunked`` or ``transfer-encoding: Chunked``; either
  header first) whose body hides a ``GET /v1/models``. Everything up to the
  server's close must be exactly one response, a 400;
- ``flood``: a chat of more messages than ``max_model_len`` tokens can hold
  (``max_model_len`` + 1..1000, sometimes 20,000; under 1 MB of JSON): a 400;
- ``samples`` (issue 47's request kinds): ``n_echo``, a completion of n =
  2-4 samples with ``echo`` and ``logprobs`` (one prompt pass for all: item
  4), and ``min_tokens_grammar``, a chat whose boolean schema is done
  before its ``min_tokens`` (it must stop, not pad: item 5); both complete.

A probe stream runs throughout; its inter-token latencies (ITL) are
reported as p50/p99. Kinds that need ``max_model_len`` (``oversized``,
``flood``) send a normal stream when it is unknown.

Every request gets one outcome: ``complete`` (200 and a full answer; a stream
ends with ``[DONE]``), ``4xx`` (a bad request refused as it should be),
``429/503`` (refused for load: acceptable), ``disconnect`` (we hung up on
purpose), or a failure: ``5xx``, ``transport_error`` (for a smuggling attempt:
also a close with no response), ``timeout`` (for a smuggling attempt: also no
close by the deadline), ``unexpected_4xx`` (a 4xx for a well-formed request,
or another 4xx than the 400 expected), ``unexpected_2xx`` (a bad request
accepted), ``bad_body`` (a 200 with a malformed body or stream; bytes that
are no HTTP response), ``smuggled`` (more than one response to a smuggling
attempt: the hidden request ran). The check ``accounted`` fails unless the
outcomes are exactly as many as the requests sent (probe included).

After the load, waiting on each condition up to ``--settle-timeout`` seconds:
``/health`` is 200; the gauges ``kvserve:num_requests_running`` and
``kvserve:num_requests_waiting`` are 0 and ``kvserve:kv_cache_usage_perc`` is
back to its baseline; the server's open file descriptors are back to their
baseline (+``--fd-tolerance``); peak RSS minus the RSS after warm-up is at
most ``--max-rss-growth-mib`` (the CPU backend commits its KV cache at
start-up, so the baseline holds it). The fd and RSS checks need
the server's pid (known when the soak starts the server, else ``--server-pid``).

Exit status: 0 when every check passes and no request failed, 1 otherwise,
2 for bad usage (e.g. a ``--url`` that is not on loopback).

This module is the driver (warm-up, baseline, load, checks, the CLI); the
parts live beside it and are re-exported here: the request kinds
(``soak_plans``, the hostile ones in ``soak_attacks``), the mix and the
load (``soak_load``), sending and classifying (``soak_send``), the server
under test (``soak_server``) and the checks and report (``soak_report``).

    python tools/soak.py --duration 60
    python tools/soak.py --url http://127.0.0.1:8000 --server-pid 1234 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from kvserve.bench import BENCH_VERSION
from kvserve.testing.soak_attacks import (CONSTRAINT_FIELDS, CONSTRAINT_MAX_BYTES,
                                          FLOOD_LARGE_COUNT, FLOOD_MAX_BYTES,
                                          INVALID_CONSTRAINTS, LARGE_CONSTRAINT_BYTES,
                                          LARGE_FIELDS, OVERSIZED_CONSTRAINT_BYTES,
                                          SMUGGLE_ENCODINGS, SMUGGLED, constraint_bytes,
                                          constraint_fields, constraint_plan,
                                          constraint_request, flood_plan, sized_constraint,
                                          smuggle_plan, smuggle_request)
from kvserve.testing.soak_load import (DEFAULT_MIX, Budget, Load, make_plans, parse_mix,
                                       run_load)
from kvserve.testing.soak_plans import (OVERSIZED_CHARS_PER_TOKEN, OVERSIZED_MAX_CHARS, Plan,
                                        Target, bad_plan, generation_plan, oversized_plan,
                                        oversized_prompt, probe_plan, samples_plan)
from kvserve.testing.soak_report import (Baseline, Check, check_accounted, check_fds,
                                         check_gauges, check_health, check_outcomes, check_rss,
                                         format_table, measure_baseline, percentile, summarize)
from kvserve.testing.soak_send import (CONTENT_LENGTH, FAILURES, OUTCOMES, STATUS_LINE,
                                       WIRE_MAX_BYTES, Attempt, StreamRead, apply_event,
                                       body_problem, classify, finish_problem, http_statuses,
                                       read_stream, send, sse_payloads, stream_end_problem,
                                       usage_problem, wire_outcome)
from kvserve.testing.soak_server import (GAUGES, RssSampler, Server, alive, fd_count,
                                         parse_gauges, rss_mib, wait_until)

__all__ = [
    # soak_attacks
    "CONSTRAINT_FIELDS", "CONSTRAINT_MAX_BYTES", "FLOOD_LARGE_COUNT", "FLOOD_MAX_BYTES",
    "INVALID_CONSTRAINTS", "LARGE_CONSTRAINT_BYTES", "LARGE_FIELDS",
    "OVERSIZED_CONSTRAINT_BYTES", "SMUGGLE_ENCODINGS", "SMUGGLED", "constraint_bytes",
    "constraint_fields", "constraint_plan", "constraint_request", "flood_plan",
    "sized_constraint", "smuggle_plan", "smuggle_request",
    # soak_load
    "DEFAULT_MIX", "Budget", "Load", "make_plans", "parse_mix", "run_load",
    # soak_plans
    "OVERSIZED_CHARS_PER_TOKEN", "OVERSIZED_MAX_CHARS", "Plan", "Target", "bad_plan",
    "generation_plan", "oversized_plan", "oversized_prompt", "probe_plan", "samples_plan",
    # soak_report
    "Baseline", "Check", "check_accounted", "check_fds", "check_gauges", "check_health",
    "check_outcomes", "check_rss", "format_table", "measure_baseline", "percentile",
    "summarize",
    # soak_send
    "CONTENT_LENGTH", "FAILURES", "OUTCOMES", "STATUS_LINE", "WIRE_MAX_BYTES", "Attempt",
    "StreamRead", "apply_event", "body_problem", "classify", "finish_problem",
    "http_statuses", "read_stream", "send", "sse_payloads", "stream_end_problem",
    "usage_problem", "wire_outcome",
    # soak_server
    "GAUGES", "RssSampler", "Server", "alive", "fd_count", "parse_gauges", "rss_mib",
    "wait_until",
    # this module
    "LOOPBACK_HOSTS", "MIB", "add_arguments", "end_checks", "loopback_error", "main",
    "run_cli", "soak", "start_server", "usage_error", "warm_up",
]

#: The hosts ``--url`` may name.
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
MIB = 1024 * 1024


def loopback_error(url: str) -> str | None:
    """Why ``url`` may not be soaked (not http(s), or a host other than
    127.0.0.1 / localhost / ::1), or None when it may."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return f"--url must be an http(s) URL, got {url!r}"
    if (parts.hostname or "").lower() not in LOOPBACK_HOSTS:
        return (f"--url host {parts.hostname!r} is not loopback: the soak only runs "
                "against 127.0.0.1, localhost or ::1")
    return None


async def warm_up(base_url: str, target: Target, count: int, timeout_s: float,
                  headers: dict[str, str]) -> Check:
    """Send ``count`` well-formed requests one by one (stream and not); all must complete."""
    rng = random.Random("warm-up")
    async with httpx.AsyncClient(base_url=base_url, headers=headers,
                                 timeout=httpx.Timeout(timeout_s)) as client:
        attempts = [await send(client, generation_plan("warmup", rng, target, stream=i % 2 == 0),
                               timeout_s) for i in range(count)]
    done = sum(a.outcome == "complete" for a in attempts)
    return Check("warm-up", "PASS" if done == count else "FAIL", f"{done}/{count} complete")


async def end_checks(args: argparse.Namespace, server: Server, base: Baseline,
                     sampler: RssSampler, stopped: str | None) -> list[Check]:
    """The checks after the load; they share one deadline of ``--settle-timeout`` s."""
    deadline = time.monotonic() + args.settle_timeout
    checks = [Check("load", "FAIL" if stopped else "PASS", stopped or "ran to its bound"),
              await check_health(server, deadline),
              await check_gauges(server, base, deadline),
              await check_fds(server, base, args.fd_tolerance, deadline)]
    await sampler.stop()
    return [*checks, check_rss(base, sampler.peak, args.max_rss_growth_mib)]


async def soak(args: argparse.Namespace, base_url: str, pid: int | None) -> dict:
    """Warm up, measure the baseline, run the load, check; the result dict."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers,
                                 timeout=httpx.Timeout(30.0)) as probe_client:
        server = Server(probe_client, pid)
        target = await server.target(args.max_tokens, args.burst_size)
        warm = await warm_up(base_url, target, args.warmup, args.request_timeout, headers)
        base = await measure_baseline(server, time.monotonic() + args.settle_timeout)
        sampler = RssSampler(pid)
        sampler.start()
        _log(f"load for {args.duration:g} s"
             + (f" or {args.max_requests} requests" if args.max_requests else "")
             + f" at concurrency {args.concurrency}")
        load = await run_load(
            base_url, target, concurrency=args.concurrency, mix=parse_mix(args.mix),
            seed=args.seed, duration_s=args.duration, max_requests=args.max_requests,
            timeout_s=args.request_timeout, headers=headers)
        checks = [warm, *await end_checks(args, server, base, sampler, load.stopped),
                  check_outcomes(Counter(a.outcome for a in load.attempts)),
                  check_accounted(load.granted, load.attempts)]
        result = summarize(load.attempts, load.duration_s, base, sampler.samples,
                           await server.fds(), checks, load.granted)
    result["server"] = {"url": base_url, "pid": pid, "model": target.model,
                        "max_model_len": target.max_model_len}
    return result


def _log(message: str) -> None:
    print(f"soak: {message}", file=sys.stderr, flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The soak's flags."""
    p.add_argument("--url", default=None,
                   help="attach to this server (loopback only) instead of starting one")
    p.add_argument("--server-pid", type=int, default=None,
                   help="with --url: the server's pid, for the fd and RSS checks")
    p.add_argument("--model", default=None,
                   help="model to serve when starting the server (default: the default model)")
    p.add_argument("--serve-args", default="",
                   help="extra 'kvserve serve' flags, one string (e.g. '--max-model-len 512'; "
                        "a single flag as --serve-args=--FLAG)")
    p.add_argument("--server-log", default=None, help="started server's log file")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    p.add_argument("--max-requests", type=int, default=None,
                   help="stop after this many requests (probe included) if sooner")
    p.add_argument("--concurrency", type=int, default=16, help="workers (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the traffic mix")
    p.add_argument("--mix", default=None,
                   help="KIND=WEIGHT,... of " + ", ".join(f"{k} ({v:g})"
                                                         for k, v in DEFAULT_MIX.items()))
    p.add_argument("--max-tokens", type=int, default=32,
                   help="largest max_tokens of a request (1..this); the probe's (default 32)")
    p.add_argument("--burst-size", type=int, default=8, help="requests of one burst")
    p.add_argument("--warmup", type=int, default=4, help="warm-up requests before the baseline")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="seconds one request may take in all (default 120)")
    p.add_argument("--settle-timeout", type=float, default=60.0,
                   help="seconds the end checks wait for their conditions (default 60)")
    p.add_argument("--max-rss-growth-mib", type=float, default=200.0,
                   help="largest peak RSS minus post-warm-up RSS, MiB (default 200); it "
                        "includes KV-cache pages written for the first time (tools/README.md)")
    p.add_argument("--fd-tolerance", type=int, default=4,
                   help="open fds allowed above the baseline at the end (default 4)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="Bearer token (default $OPENAI_API_KEY)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the result JSON here")


def usage_error(args: argparse.Namespace) -> str | None:
    """The one-line reason ``args`` cannot run (exit 2), or None."""
    if args.url is not None:
        if args.model is not None or args.serve_args:
            return "--url attaches to a running server: --model and --serve-args do not apply"
        if (error := loopback_error(args.url)) is not None:
            return error
    elif args.server_pid is not None:
        return "--server-pid needs --url"
    if args.server_pid is not None and not Path(f"/proc/{args.server_pid}").is_dir():
        return f"--server-pid {args.server_pid}: no such process"
    if args.duration <= 0 or args.concurrency < 1 or args.max_tokens < 2 or args.burst_size < 1:
        return "--duration must be > 0, --concurrency and --burst-size >= 1, --max-tokens >= 2"
    try:
        parse_mix(args.mix)
    except ValueError as exc:
        return str(exc)
    return None


def start_server(args: argparse.Namespace):
    """``kvserve serve`` on a free loopback port (``kvserve.bench.server.ServerProcess``)."""
    from kvserve.bench.server import ServerProcess

    model = args.model
    if model is None:
        from kvserve.model.default_model import ensure_default_model
        model = str(ensure_default_model())
    log = args.server_log or Path(tempfile.gettempdir()) / f"kvserve-soak-{os.getpid()}.log"
    _log(f"starting kvserve serve --model {model} {args.serve_args} (log {log})")
    return ServerProcess(["--model", model, *shlex.split(args.serve_args)], log_path=log)


def run_cli(args: argparse.Namespace) -> int:
    """Run parsed ``args``: 0 when everything passed, 1 otherwise, 2 for bad usage."""
    if (error := usage_error(args)) is not None:
        print(f"soak: error: {error}", file=sys.stderr)
        return 2
    server = None
    try:
        if args.url is None:
            from kvserve.bench.server import exit_on_sigterm
            exit_on_sigterm()
            server = start_server(args)
        url = args.url or server.base_url
        pid = args.server_pid if server is None else server.proc.pid
        result = asyncio.run(soak(args, url.rstrip("/"), pid))
    except (RuntimeError, httpx.HTTPError) as exc:  # no server, or none answering
        print(f"soak: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
    result["tool"] = {"name": "kvserve.testing.soak", "version": BENCH_VERSION}
    result["config"] = {k: v for k, v in vars(args).items() if k != "api_key"}
    print(format_table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0 if result["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    """The soak's command line (``tools/soak.py``): ``run_cli``'s exit status."""
    parser = argparse.ArgumentParser(prog="soak", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
