#!/usr/bin/env python3
"""Speculative decoding (n-gram prompt lookup, a draft model) against plain decoding, one run.

Servers of the default model, ``--speculative-config`` off and then each
``--spec`` given (default: n-gram), the same two workloads on each:

- **code edit**, one client: a prompt holding a ~300-token Python module
  and the instruction to repeat it with one name changed; the answer
  copies most of the prompt, which is where prompt lookup pays. Reported:
  decode tokens/s (output tokens after the first over the time after the
  first token), the mean acceptance length, and why the speed-up is what
  it is: the engine's steps for the edits (from /metrics), output tokens
  per step (steps with no n-gram match emit one) and a step's forward
  milliseconds (a verification of k + 1 tokens against a decode's).
- **short Q&A**, ``--qa-clients`` clients: short questions with 64-token
  answers, where drafts are rarely right; the off switch must keep the
  total output throughput within a few percent of plain decoding.

Greedy (temperature 0) throughout, so the servers' texts must be equal.
``{default_model}`` in a ``--spec`` stands for the default model's folder:
the default model with int8 weights as its own draft is

    python tools/bench_spec_decode.py --spec '{"method": "ngram", "num_speculative_tokens": 8}' \
        --spec '{"method": "draft_model", "model": "{default_model}", "quantization": "int8"}'
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

import httpx

from kvserve.bench.replay import machine_info, run_replay, summarize
from kvserve.bench.server import ServerProcess
from kvserve.bench.trace import TraceRequest
from kvserve.model.default_model import ensure_default_model
from kvserve.observability.metrics import parse_metrics_text

FUNCTIONS = ["parse_header", "read_records", "merge_sorted", "format_table", "count_words",
             "clamp_range"]


def module_source() -> str:
    """About 300 tokens of plain Python: a few small functions."""
    return '''import math


def parse_header(line):
    """Split a header line into a name and a value."""
    name, _, value = line.partition(":")
    return name.strip().lower(), value.strip()


def read_records(lines):
    """Yield one dictionary per non-empty line of comma-separated values."""
    keys = None
    for line in lines:
        line = line.strip()
        if not line:
            continue
        values = line.split(",")
        if keys is None:
            keys = values
            continue
        yield dict(zip(keys, values))


def merge_sorted(left, right):
    """Merge two sorted lists into one sorted list."""
    result = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result


def clamp_range(value, low, high):
    """Return value limited to the range from low to high."""
    return max(low, min(high, value))
'''


def code_edit_prompt(index: int) -> str:
    old = FUNCTIONS[index % 4 if index % 4 != 3 else 5]
    return (f"Here is a Python module:\n\n```python\n{module_source()}```\n\nHere is the whole "
            f"module again, with the function `{old}` renamed to `{old}_v{index}` and nothing "
            "else changed:\n\n```python\nimport math\n\n\n")


QUESTIONS = ["What is the capital of France?", "Why is the sky blue?",
             "Name three kinds of fruit.", "How many legs does a spider have?",
             "What does a baker do?", "Why do cats purr?", "What is rain made of?",
             "Who wrote Romeo and Juliet?"]


def workloads(args: argparse.Namespace) -> dict[str, list[TraceRequest]]:
    edit = [TraceRequest(id=f"edit-{i}", cls="edit", arrival_s=0.0, prompt=code_edit_prompt(i),
                         output_tokens=args.edit_tokens) for i in range(1, args.edits + 1)]
    qa = [TraceRequest(id=f"qa-{i}", cls="qa", arrival_s=0.0,
                       messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]
                                  + f" (question {i})"}], output_tokens=args.qa_tokens)
          for i in range(args.qa_requests)]
    return {"edit": edit, "qa": qa}


def step_figures(base_url: str) -> dict[str, float]:
    """The engine's steps so far, from /metrics: how many (``steps``: the
    forward phase's count) and the seconds of its forward phases."""
    samples = parse_metrics_text(httpx.get(f"{base_url}/metrics", timeout=30).text)

    def forward(name: str) -> float:
        return sum(v for labels, v in samples.get(f"kvserve:step_phase_seconds_{name}", [])
                   if labels.get("phase") == "forward")

    return {"steps": forward("count"), "forward_s": forward("sum")}


def acceptance(base_url: str) -> float | None:
    samples = parse_metrics_text(httpx.get(f"{base_url}/metrics", timeout=30).text)
    drafts = sum(v for _, v in samples.get("kvserve:spec_decode_num_drafts_total", []))
    accepted = sum(v for _, v in samples.get("kvserve:spec_decode_num_accepted_tokens_total",
                                            []))
    return 1 + accepted / drafts if drafts else None


async def replay(base_url: str, requests: list[TraceRequest], endpoint: str,
                 concurrency: int) -> tuple[list, float]:
    return await run_replay(requests, base_url, endpoint=endpoint, max_concurrency=concurrency,
                            ignore_eos=False, progress=False)


def measure(spec: str | None, args: argparse.Namespace) -> dict:
    model = str(ensure_default_model())
    flags = ["--model", model, "--stats-interval", "0", *shlex.split(args.server_args)]
    if spec:
        flags += ["--speculative-config", spec.replace("{default_model}", model)]
    server = ServerProcess(flags)
    try:
        work = workloads(args)
        asyncio.run(replay(server.base_url, work["edit"][:1], "completions", 1))  # warm-up
        load_before = os.getloadavg()[0]
        before = step_figures(server.base_url)
        edit, edit_s = asyncio.run(replay(server.base_url, work["edit"], "completions", 1))
        after = step_figures(server.base_url)
        mean_len = acceptance(server.base_url)
        qa, qa_s = asyncio.run(replay(server.base_url, work["qa"], "chat", args.qa_clients))
    finally:
        server.stop()
    decode = [((r.output_tokens or 0) - 1) / (r.e2el - r.ttft) for r in edit
              if r.success and r.output_tokens and r.output_tokens > 1]
    return {"spec": spec or "off", "edit_decode_tok_s": sum(decode) / max(len(decode), 1),
            "edit_output_tokens": [r.output_tokens for r in edit],
            # why a speed-up is what it is: the edit's steps, tokens per step
            # and a step's forward time (a verification is longer than a decode)
            "edit_steps": after["steps"] - before["steps"],
            "edit_tokens_per_step": (sum(r.output_tokens or 0 for r in edit)
                                     / max(after["steps"] - before["steps"], 1)),
            "edit_forward_ms_per_step": 1e3 * (after["forward_s"] - before["forward_s"])
            / max(after["steps"] - before["steps"], 1),
            "edit_texts": [r.finish_reason for r in edit],
            "mean_acceptance_length": mean_len,
            "qa_output_throughput": summarize(qa, qa_s)["output_throughput"],
            "failed": sum(not r.success for r in edit + qa),
            "load_before": load_before, "load_after": os.getloadavg()[0]}


DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, ' \
               '"prompt_lookup_min": 2}'


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", action="append", metavar="JSON",
                        help="a --speculative-config to measure (repeatable; default: "
                             f"{DEFAULT_SPEC})")
    parser.add_argument("--edits", type=int, default=3)
    parser.add_argument("--edit-tokens", type=int, default=300)
    parser.add_argument("--qa-requests", type=int, default=32)
    parser.add_argument("--qa-clients", type=int, default=8)
    parser.add_argument("--qa-tokens", type=int, default=64)
    parser.add_argument("--server-args", default="",
                        help="more 'kvserve serve' flags for every server, one string "
                             "(e.g. '--quantization w4a8': the default model on its GGUF "
                             "blocks)")
    parser.add_argument("--out", default=None,
                        help="write the rows, the command and the machine (CPU model, load) "
                             "to this JSON file (a record for docs/benchmarks/)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    specs = args.spec or [DEFAULT_SPEC]
    rows = [measure(None, args)] + [measure(spec, args) for spec in specs]
    for row in rows:
        print(json.dumps(row), file=sys.stderr)
    if args.out:
        record = {"command": "python tools/bench_spec_decode.py " + " ".join(argv or sys.argv[1:]),
                  "machine": machine_info(), "rows": rows}
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
    base = rows[0]
    print(f"\n{os.cpu_count()} CPUs\n")
    print("| --speculative-config | code edit decode tok/s (1 client) | speed-up | mean "
          "acceptance length | edit steps | tokens / step | forward ms / step | short Q&A "
          f"output tok/s ({args.qa_clients} clients) | ratio | same output lengths | load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        length = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else "-"
        print(f"| {r['spec']} | {r['edit_decode_tok_s']:.1f} | "
              f"{r['edit_decode_tok_s'] / base['edit_decode_tok_s']:.2f}x | {length} | "
              f"{r['edit_steps']:.0f} | {r['edit_tokens_per_step']:.2f} | "
              f"{r['edit_forward_ms_per_step']:.1f} | {r['qa_output_throughput']:.1f} | "
              f"{r['qa_output_throughput'] / base['qa_output_throughput']:.2f}x | "
              f"{r['edit_output_tokens'] == base['edit_output_tokens']} | "
              f"{r['load_before']:.1f} -> {r['load_after']:.1f} |")
    return 0 if not any(r["failed"] for r in rows) else 1

if __name__ == "__main__":
    sys.exit(main())
