#!/usr/bin/env python3
"""Does compiling large output constraints slow the other streams? (issue 25)

One ``kvserve serve`` (default model, default limits), then two phases
side by side in one run, each with the same neighbour: a greedy streaming
chat request of ``--tokens`` tokens (EOS ignored).

- ``with``: the neighbour while another client sends, for each constraint
  field (``guided_json``, ``response_format``, ``guided_regex``,
  ``guided_choice``, ``guided_grammar``, ``tools``), the largest constraint
  the server accepts (new to its compile cache: ``kvserve.testing.hostile``;
  tools only over the limit: a tool's schema is also prompt, so the largest
  one accepted is bounded by the context and costs what its prompt's
  prefill costs, as any long prompt would, which the other phases measure
  nothing of) and one just over ``--structured-outputs-max-bytes``, round after round
  with new names until the neighbour ends;
- ``unconstrained``: the accepted requests with their constraints taken out
  (``hostile.without_constraint``: tools stay in the prompt, with
  ``tool_choice: "auto"``), the oversized ones left out: the prompts' own
  prefill steps, so that this phase and ``with`` differ by the constraints
  (their compiles, masks and 400s) only;
- ``alone``: the neighbour and nothing else.

Every request body is built before the phases (building a 64 KiB schema
costs the client CPU the 2-core server would miss).

Reports the neighbour's inter-token latency (p50, p99, max) in the three
phases and the p99 ratios of ``with`` to the other two (goal: within 1.5x
of ``alone``), each constraint's status and
seconds to acceptance (its compile), the load average and the machine, as
a Markdown table and a JSON record (``--out``).

    python tools/bench_constraints.py
    python tools/bench_constraints.py --tokens 400 --out docs/benchmarks/x.json
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

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

    from kvserve.testing.hostile import Neighbour, constraint_round, send_constraint, without_constraint
    from kvserve.bench.replay import git_info, machine_info
    from kvserve.bench.server import ServerProcess
    from kvserve.testing.soak import percentile
    from kvserve.model.default_model import ensure_default_model
except ModuleNotFoundError as exc:  # run outside the venv
    sys.exit(f"{exc}: run it with the project's venv: .venv/bin/python {sys.argv[0]} "
             "(make install creates it)")

MAX_BYTES = 64 * 1024
#: Size of the (unsent) accepted tools' schema of a round.
TOOLS_BYTES = 256


def itl_summary(neighbour: Neighbour) -> dict:
    """The neighbour's inter-token latency figures, milliseconds."""
    gaps = neighbour.gaps()
    ms = lambda v: None if v is None else round(1000 * v, 1)
    return {"tokens": len(neighbour.arrivals), "itl_p50_ms": ms(percentile(gaps, 50)),
            "itl_p99_ms": ms(percentile(gaps, 99)), "itl_max_ms": ms(max(gaps, default=None)),
            "seconds": round(neighbour.arrivals[-1] - neighbour.arrivals[0], 2)}


async def phase(base_url: str, tokens: int, rounds: list, name: str) -> dict:
    """One neighbour beside ``rounds`` of requests (``constraint_round``s),
    sent one after the other until it ends: as they are (``with``), without
    their constraints (``unconstrained``), or none (``alone``)."""
    neighbour = Neighbour(max_tokens=tokens)
    plan = [(field, over, fields if name == "with" else without_constraint(fields))
            for round_ in (rounds if name != "alone" else ()) for field, over, fields in round_
            if (name == "with" or not over) and (over or field != "tools")]
    shots = []
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        task = asyncio.create_task(neighbour.run(client))
        while len(neighbour.arrivals) < 5 and not task.done():
            await asyncio.sleep(0.05)
        for field, over, fields in plan:
            if task.done():
                break
            shots.append(await send_constraint(client, field, fields, over))
        await task
    return {"phase": name, **itl_summary(neighbour),
            "requests": [{"field": s.field, "over": s.over, "status": s.status,
                          "param": s.param, "seconds": round(s.seconds, 3)} for s in shots]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=300, help="the neighbour's max_tokens")
    parser.add_argument("--rounds", type=int, default=20,
                        help="rounds of constraints built in advance (sent until the "
                             "neighbour ends)")
    parser.add_argument("--serve-args", default="--kv-cache-memory 512MiB --max-model-len 2048",
                        help="extra kvserve serve flags")
    parser.add_argument("--out", help="write the JSON record here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()
    server = ServerProcess(["--model", str(ensure_default_model()), *args.serve_args.split()])
    try:
        rounds = [constraint_round(MAX_BYTES, "".join(random.choices(string.ascii_lowercase,
                                                                     k=8)), TOOLS_BYTES)
                  for _ in range(args.rounds)]
        asyncio.run(phase(server.base_url, 16, rounds[:1], "unconstrained"))  # warm-up
        rows = [asyncio.run(phase(server.base_url, args.tokens, rounds, name))
                for name in ("alone", "unconstrained", "with")]
    finally:
        server.stop()
    load_after = os.getloadavg()
    alone, unconstrained, with_ = rows
    ratio = with_["itl_p99_ms"] / alone["itl_p99_ms"]
    ratio_traffic = with_["itl_p99_ms"] / unconstrained["itl_p99_ms"]
    record = {"command": "python tools/bench_constraints.py " + " ".join(argv or sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "git": git_info(), "machine": machine_info(),
              "load_average_before": load_before, "load_average_after": load_after,
              "server_args": args.serve_args, "max_bytes": MAX_BYTES, "rows": rows,
              "p99_ratio_to_alone": round(ratio, 3),
              "p99_ratio_to_unconstrained": round(ratio_traffic, 3)}
    print(f"\nload average {load_before[0]:.2f} before, {load_after[0]:.2f} after "
          f"({os.cpu_count()} CPUs)\n")
    print("| neighbour | tokens | ITL p50 ms | ITL p99 ms | ITL max ms |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['phase']} | {row['tokens']} | {row['itl_p50_ms']} | "
              f"{row['itl_p99_ms']} | {row['itl_max_ms']} |")
    print(f"\nITL p99 with constraints / alone: {ratio:.2f}x (goal: at most 1.5x); "
          f"/ the same requests unconstrained: {ratio_traffic:.2f}x\n")
    by_field: dict[tuple[str, bool], list[dict]] = {}
    for shot in with_["requests"]:
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
