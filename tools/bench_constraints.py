#!/usr/bin/env python3
"""Does compiling large output constraints slow the other streams? (issue 25)

One ``kvserve serve`` (default model, default limits), then two phases
side by side in one run, each with the same neighbour: a greedy streaming
chat request of ``--tokens`` tokens (EOS ignored).

- ``without``: the neighbour alone;
- ``with``: the neighbour while another client sends, for each constraint
  field (``guided_json``, ``response_format``, ``guided_regex``,
  ``guided_choice``, ``guided_grammar``, ``tools``), the largest constraint
  the server accepts (new to its compile cache: ``kvserve.bench.hostile``)
  and one just over ``--structured-outputs-max-bytes``, round after round
  with new names until the neighbour ends.

Reports the neighbour's inter-token latency (p50, p99, max) in both phases
and their ratio (goal: p99 within 1.5x), each constraint's status and
seconds to acceptance (its compile), the load average and the machine, as
a Markdown table and a JSON record (``--out``).

    python tools/bench_constraints.py
    python tools/bench_constraints.py --tokens 400 --out docs/benchmarks/x.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import string
import sys
import time

try:
    import httpx

    from kvserve.bench.hostile import Neighbour, fire_constraints
    from kvserve.bench.replay import git_info, machine_info
    from kvserve.bench.server import ServerProcess
    from kvserve.bench.soak import percentile
    from kvserve.model.default_model import ensure_default_model
except ModuleNotFoundError as exc:  # run outside the venv
    sys.exit(f"{exc}: run it with the project's venv: .venv/bin/python {sys.argv[0]} "
             "(make install creates it)")

MAX_BYTES = 64 * 1024


def itl_summary(neighbour: Neighbour) -> dict:
    """The neighbour's inter-token latency figures, milliseconds."""
    gaps = neighbour.gaps()
    ms = lambda v: None if v is None else round(1000 * v, 1)
    return {"tokens": len(neighbour.arrivals), "itl_p50_ms": ms(percentile(gaps, 50)),
            "itl_p99_ms": ms(percentile(gaps, 99)), "itl_max_ms": ms(max(gaps, default=None)),
            "seconds": round(neighbour.arrivals[-1] - neighbour.arrivals[0], 2)}


async def phase(base_url: str, tokens: int, max_model_len: int, constraints: bool) -> dict:
    """One neighbour, alone or beside rounds of constraints."""
    neighbour = Neighbour(max_tokens=tokens)
    shots = []
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        task = asyncio.create_task(neighbour.run(client))
        while constraints and not task.done():
            if len(neighbour.arrivals) < 5:
                await asyncio.sleep(0.05)
                continue
            salt = "".join(random.choices(string.ascii_lowercase, k=8))
            shots += await fire_constraints(client, MAX_BYTES, salt, max_model_len)
        await task
    row = {"phase": "with" if constraints else "without", **itl_summary(neighbour)}
    if constraints:
        row["constraints"] = [{"field": s.field, "over": s.over, "status": s.status,
                               "param": s.param, "seconds": round(s.seconds, 3)} for s in shots]
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=300, help="the neighbour's max_tokens")
    parser.add_argument("--serve-args", default="--kv-cache-memory 512MiB --max-model-len 2048",
                        help="extra kvserve serve flags")
    parser.add_argument("--out", help="write the JSON record here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()
    server = ServerProcess(["--model", str(ensure_default_model()), *args.serve_args.split()])
    try:
        max_model_len = httpx.get(server.base_url + "/v1/models").json()["data"][0]["max_model_len"]
        asyncio.run(phase(server.base_url, 16, max_model_len, constraints=False))  # warm-up
        rows = [asyncio.run(phase(server.base_url, args.tokens, max_model_len, constraints=c))
                for c in (False, True)]
    finally:
        server.stop()
    load_after = os.getloadavg()
    without, with_ = rows
    ratio = with_["itl_p99_ms"] / without["itl_p99_ms"]
    record = {"command": "python tools/bench_constraints.py " + " ".join(argv or sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "git": git_info(), "machine": machine_info(),
              "load_average_before": load_before, "load_average_after": load_after,
              "server_args": args.serve_args, "max_bytes": MAX_BYTES, "rows": rows,
              "p99_ratio": round(ratio, 3)}
    print(f"\nload average {load_before[0]:.2f} before, {load_after[0]:.2f} after "
          f"({os.cpu_count()} CPUs)\n")
    print("| neighbour | tokens | ITL p50 ms | ITL p99 ms | ITL max ms |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['phase']} constraints | {row['tokens']} | {row['itl_p50_ms']} | "
              f"{row['itl_p99_ms']} | {row['itl_max_ms']} |")
    print(f"\nITL p99 with / without: {ratio:.2f}x (goal: at most 1.5x)\n")
    by_field: dict[tuple[str, bool], list[dict]] = {}
    for shot in with_["constraints"]:
        by_field.setdefault((shot["field"], shot["over"]), []).append(shot)
    print("| constraint | sent | statuses | seconds to answer (max) |")
    print("|---|---|---|---|")
    for (name, over), shots in by_field.items():
        statuses = sorted({s["status"] for s in shots})
        print(f"| {name} {'over the limit' if over else 'largest accepted'} | {len(shots)} | "
              f"{statuses} | {max(s['seconds'] for s in shots):.2f} |")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(record, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
