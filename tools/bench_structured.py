#!/usr/bin/env python3
"""Structured-output overhead: output tokens/s with and without a JSON schema.

One ``kvserve serve`` (default model), then for each client count in
``--clients`` (default 1 and 16) two closed loops of ``--requests`` chat
requests per client, side by side in one run:

- ``free``: no constraint, ``ignore_eos`` and ``max_tokens`` = ``--tokens``;
- ``schema``: ``response_format`` with a JSON schema of an object holding an
  array of exactly ``--items`` integers (about ``--tokens`` tokens), so both
  generate about as many tokens.

Output tokens/s = the completion tokens of all requests (``usage``) / the
loop's wall time. The mask of a constrained row is computed on a helper
thread during the forward pass (``kvserve.constraints.masks``); this measures
what is left of its cost. Prints a Markdown table with the load average.

    python tools/bench_structured.py
    python tools/bench_structured.py --clients 1 4 16 --requests 4
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import asyncio
import json
import os
import sys
import time

import httpx

from kvserve.bench.server import ServerProcess
from kvserve.model.default_model import ensure_default_model

PROMPT = "Write a list of numbers."


def schema(items: int) -> dict:
    """An object holding an array of exactly ``items`` integers in [0, 999]."""
    return {"type": "object", "additionalProperties": False, "required": ["values"],
            "properties": {"values": {"type": "array", "minItems": items, "maxItems": items,
                                      "items": {"type": "integer", "minimum": 0,
                                                "maximum": 999}}}}


def body(kind: str, args: argparse.Namespace, seed: int) -> dict:
    base = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0.8,
            "seed": seed, "max_tokens": args.tokens}
    if kind == "free":
        return {**base, "ignore_eos": True}
    return {**base, "max_tokens": 4 * args.tokens, "response_format": {
        "type": "json_schema", "json_schema": {"name": "numbers", "schema": schema(args.items)}}}


async def client_loop(client: httpx.AsyncClient, kind: str, args: argparse.Namespace,
                      worker: int) -> int:
    tokens = 0
    for i in range(args.requests):
        response = await client.post("/v1/chat/completions",
                                     json=body(kind, args, seed=1000 * worker + i))
        response.raise_for_status()
        data = response.json()
        if kind == "schema":
            json.loads(data["choices"][0]["message"]["content"])  # it must parse
        tokens += data["usage"]["completion_tokens"]
    return tokens


async def measure(base_url: str, kind: str, clients: int, args: argparse.Namespace) -> dict:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        start = time.perf_counter()
        counts = await asyncio.gather(*(client_loop(client, kind, args, w)
                                        for w in range(clients)))
        seconds = time.perf_counter() - start
    return {"kind": kind, "clients": clients, "tokens": sum(counts),
            "seconds": round(seconds, 2), "tokens_per_s": round(sum(counts) / seconds, 1)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--requests", type=int, default=3, help="requests per client")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens of the free runs")
    parser.add_argument("--items", type=int, default=20,
                        help="integers in the schema's array (about --tokens tokens)")
    parser.add_argument("--serve-args", default="--kv-cache-memory 512MiB")
    return parser.parse_args(argv)


async def run_all(base_url: str, args: argparse.Namespace) -> list[dict]:
    await measure(base_url, "schema", 1, argparse.Namespace(**{**vars(args), "requests": 1}))
    rows = []
    for clients in args.clients:
        for kind in ("free", "schema"):
            rows.append(await measure(base_url, kind, clients, args))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    server = ServerProcess(["--model", str(ensure_default_model()), *args.serve_args.split()])
    try:
        rows = asyncio.run(run_all(server.base_url, args))
    finally:
        server.stop()
    print(f"\nload average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after "
          f"({os.cpu_count()} CPUs)\n")
    print("| clients | free tok/s | schema tok/s | schema / free |")
    print("|---|---|---|---|")
    by = {(r["clients"], r["kind"]): r for r in rows}
    for clients in args.clients:
        free, con = by[(clients, "free")], by[(clients, "schema")]
        print(f"| {clients} | {free['tokens_per_s']} | {con['tokens_per_s']} | "
              f"{con['tokens_per_s'] / free['tokens_per_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
