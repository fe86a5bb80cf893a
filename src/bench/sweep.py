"""Sweep one variable, replaying a trace at each value; plot latency vs
throughput and mark the saturation point.

Variables (one at a time, everything else fixed):

- ``rate``: the trace's requests re-timed as Poisson (gamma with
  ``--burstiness``) arrivals at each rate; each point replays
  ``max(--min-requests, rate * --duration)`` requests (open loop);
- ``concurrency``: all arrivals at 0, ``--max-concurrency`` = each value
  (closed loop), ``max(--min-requests, value * --requests-per-user)`` requests;
- ``server-flag``: the server is restarted per value with ``--FLAG VALUE``
  added to ``--server-args`` (kvserve) or ``{value}`` filled in
  ``--server-cmd`` (any server); the load is the trace as is (or
  ``--request-rate``).

Saturation point: the first value whose throughput gain over the previous
value is below ``--saturation-gain`` (default 5 %), i.e. where added load
stops adding throughput. If no value qualifies the sweep did not saturate.
For rate sweeps ``sweep.json`` also gives ``achieved_over_offered`` per rate
and ``overloaded_from``: the first rate whose achieved request throughput is
below 80 % of the offered rate (continuous batching can keep raising
throughput while the queue, and so TTFT, grows without bound).

Output (``--out-dir``): one result JSON per value (``point-<value>.json``),
``sweep.json`` (the points and the saturation point) and ``sweep.png``.

    python tools/sweep.py --trace t.jsonl --variable rate --values 0.5,1,2,4 \
        --duration 20 --launch-server --server-args "--kv-cache-memory 256MiB" --out-dir sweep/
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

from kvserve.bench.replay import (
    first_model_id,
    format_summary,
    provenance,
    retime,
    replay_with_warmup,
    server_info,
    summarize_all,
)
from kvserve.bench.trace import read_trace


def saturation_index(throughputs: list[float], min_gain: float = 0.05) -> int | None:
    """Index of the first value whose throughput gain over the previous one is
    below ``min_gain`` (relative), or None when throughput kept rising."""
    for i in range(1, len(throughputs)):
        prev, cur = throughputs[i - 1], throughputs[i]
        if prev is None or cur is None or not math.isfinite(prev) or not math.isfinite(cur):
            continue
        if prev <= 0:
            continue
        if (cur - prev) / prev < min_gain:
            return i
    return None


def plot_sweep(points: list[dict], variable: str, sat: int | None, path: str | Path,
               throughput_metric: str = "output_throughput", title: str | None = None) -> None:
    """Latency (median and p99 of TTFT, TPOT, E2E) against throughput, plus
    throughput against the swept value; the saturation point is marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p["summary"]["overall"][throughput_metric] for p in points]
    values = [p["value"] for p in points]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    unit = "tok/s" if "token" in throughput_metric or throughput_metric == "output_throughput" \
        else "req/s"
    for ax, (fam, label) in zip(axes.flat[:3], (("ttft", "TTFT"), ("tpot", "TPOT"),
                                                 ("e2el", "E2E latency")), strict=True):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            ys = [p["summary"]["overall"][f"{fam}_ms"][stat] for p in points]
            ys = [math.nan if y is None else y for y in ys]
            ax.plot(xs, ys, style, label=f"{label} {stat}")
            if stat == "median":
                for x, y, v in zip(xs, ys, values, strict=True):
                    ax.annotate(f"{v:g}", (x, y), textcoords="offset points", xytext=(4, 4),
                                fontsize=8)
            if sat is not None and not math.isnan(ys[sat]):
                ax.plot([xs[sat]], [ys[sat]], marker="*", color="red", markersize=14,
                        linestyle="none", label="saturation" if stat == "median" else None)
        ax.set_xlabel(f"{throughput_metric} ({unit})")
        ax.set_ylabel(f"{label} (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes.flat[3]
    ax.plot(values, xs, "o-", label=throughput_metric)
    if sat is not None:
        ax.axvline(values[sat], color="red", linestyle=":", label=f"saturation at {values[sat]:g}")
        ax.plot([values[sat]], [xs[sat]], marker="*", color="red", markersize=14)
    ax.set_xlabel(variable)
    ax.set_ylabel(f"{throughput_metric} ({unit})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title or f"kvserve sweep of {variable}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _point_requests(args, requests, value):
    if args.variable == "rate":
        n = max(args.min_requests, int(math.ceil(value * args.duration)))
        return retime(requests, value, args.burstiness, args.seed, n), None
    if args.variable == "concurrency":
        n = max(args.min_requests, int(value) * args.requests_per_user)
        return retime(requests, float("inf"), 1.0, args.seed, n), int(value)
    reqs = retime(requests, args.request_rate, args.burstiness, args.seed, args.num_requests)
    return reqs, args.max_concurrency


def run_point(args, requests, value, base_url, meta) -> dict:
    """Replay the trace at ``value`` against ``base_url``: one point's result JSON."""
    server = server_info(base_url, args.api_key)
    model = args.model or first_model_id(server)
    reqs, max_conc = _point_requests(args, requests, value)
    common = dict(endpoint=args.endpoint, model=model, ignore_eos=True, temperature=0.0,
                  api_key=args.api_key, timeout=args.timeout)
    results, duration = replay_with_warmup(reqs, base_url, args.warmup, max_conc,
                                           args.progress, **common)
    return {"schema": "kvserve.bench.result/1", "label": f"{args.variable}={value:g}",
            "value": value, "variable": args.variable,
            "provenance": provenance(args.trace, base_url, server, None, meta),
            "config": {"endpoint": args.endpoint, "model": model, "max_concurrency": max_conc,
                       "num_requests": len(reqs), "variable": args.variable, "value": value,
                       "flag": args.flag, "server_args": args.server_args},
            "summary": summarize_all(results, duration),
            "requests": [r.to_json() for r in results]}


def build_parser() -> argparse.ArgumentParser:
    """The sweep's flags."""
    p = argparse.ArgumentParser(prog="sweep", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True)
    p.add_argument("--variable", choices=["rate", "concurrency", "server-flag"], required=True)
    p.add_argument("--values", required=True, help="comma-separated values, in increasing load")
    p.add_argument("--flag", default=None,
                   help="for server-flag: the kvserve flag name, e.g. max-num-batched-tokens")
    p.add_argument("--base-url", default=None, help="an already running server (rate/concurrency)")
    p.add_argument("--launch-server", action="store_true", help="start kvserve serve for the sweep")
    p.add_argument("--server-args", default="", help="flags for the launched kvserve serve")
    p.add_argument("--server-cmd", default=None,
                   help="any server's command with {port} (and {value} for server-flag)")
    p.add_argument("--duration", type=float, default=20.0, help="rate: seconds of arrivals per value")
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--requests-per-user", type=int, default=4, help="concurrency: requests per user")
    p.add_argument("--request-rate", type=float, default=None, help="server-flag: load rate")
    p.add_argument("--max-concurrency", type=int, default=None, help="server-flag: cap")
    p.add_argument("--num-requests", type=int, default=None, help="server-flag: requests per value")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--model", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests before each value")
    p.add_argument("--throughput-metric", default="output_throughput",
                   choices=["output_throughput", "request_throughput", "total_token_throughput"])
    p.add_argument("--saturation-gain", type=float, default=0.05,
                   help="saturation: first value whose throughput gain is below this fraction")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def _checked_values(args) -> list[float]:
    """The swept values of ``args``; ValueError when the flags do not fit together."""
    values = [float(v) for v in args.values.split(",") if v.strip()]
    if args.variable == "server-flag" and not (args.flag or args.server_cmd):
        raise ValueError("--variable server-flag needs --flag (or --server-cmd with {value})")
    if args.variable != "server-flag" and not (args.base_url or args.launch_server
                                               or args.server_cmd):
        raise ValueError("give --base-url, --launch-server or --server-cmd")
    return values


def _run_points(args, values, requests, meta, out: Path) -> list[dict]:
    """Replay at each value (a server started per value for ``server-flag``,
    one for the sweep when there is no ``--base-url``); every point is
    written to ``point-<value>.json`` and summarized as it finishes."""
    from kvserve.bench.server import ServerProcess, exit_on_sigterm

    exit_on_sigterm()
    points = []
    shared = None
    try:
        if args.variable != "server-flag" and not args.base_url:
            shared = ServerProcess(shlex.split(args.server_args), command=args.server_cmd,
                                   log_path=out / "server.log")
        for value in values:
            text = f"{value:g}"
            server = None
            if args.variable == "server-flag":
                flag_args = shlex.split(args.server_args) + [f"--{args.flag}", str(int(value))
                                                             if value.is_integer() else text]
                cmd = args.server_cmd.replace("{value}", text) if args.server_cmd else None
                server = ServerProcess(flag_args, command=cmd, log_path=out / f"server-{text}.log")
                base_url = server.base_url
            else:
                base_url = args.base_url or shared.base_url
            try:
                print(f"--- {args.variable} = {text}", file=sys.stderr)
                point = run_point(args, requests, value, base_url, meta)
            finally:
                if server is not None:
                    server.stop()
            (out / f"point-{text}.json").write_text(json.dumps(point, indent=1))
            _print_point(args, text, point)
            points.append(point)
    finally:
        if shared is not None:
            shared.stop()
    return points


def _print_point(args, text: str, point: dict) -> None:
    """One line of a finished point's results."""
    o = point["summary"]["overall"]
    print(f"{args.variable}={text}: {o['completed']}/{o['num_requests']} ok, "
          f"{o['request_throughput']:.3f} req/s, {o['output_throughput']:.1f} out tok/s, "
          f"TTFT p50 {o['ttft_ms']['median'] or math.nan:.0f} ms, "
          f"TPOT p50 {o['tpot_ms']['median'] or math.nan:.1f} ms", flush=True)


def sweep_report(args, values: list[float], points: list[dict], sat: int | None,
                 png: Path) -> dict:
    """``sweep.json``: the points, the saturation point (index ``sat``) and,
    for rate sweeps, achieved over offered load and the rate it is
    overloaded from."""
    # rate sweeps: does the server keep up with the offered load at all?
    keep_up = None
    overloaded_from = None
    if args.variable == "rate":
        keep_up = [p["summary"]["overall"]["request_throughput"] / p["value"] for p in points]
        overloaded_from = next((v for v, k in zip(values, keep_up, strict=False) if k < 0.8), None)
    return {
        "variable": args.variable, "flag": args.flag, "values": values,
        "throughput_metric": args.throughput_metric, "saturation_gain": args.saturation_gain,
        "saturation_value": None if sat is None else values[sat],
        "saturation_rule": f"first value whose {args.throughput_metric} gain over the previous "
                           f"value is < {args.saturation_gain:.0%}",
        "points": [{"value": p["value"], "overall": {k: v for k, v in
                                                     p["summary"]["overall"].items()}}
                   for p in points],
        "png": str(png),
        "achieved_over_offered": keep_up,
        "overloaded_from": overloaded_from,
        "overload_rule": "rate sweeps: first rate whose achieved request throughput is < 80 % "
                         "of the offered rate (the queue grows; latency is mostly queueing)",
    }


def _print_report(args, points: list[dict], report: dict, png: Path) -> None:
    """The last point's summary, the saturation and overload points, the plot."""
    if points:
        print(format_summary(points[-1]["summary"]["overall"], f"last point {args.variable}"))
    sat = report["saturation_value"]
    print(f"saturation point: {'none (throughput kept rising)' if sat is None else sat:}"
          f"  [{report['saturation_rule']}]")
    if args.variable == "rate":
        print(f"overloaded from rate: {report['overloaded_from']}  (achieved/offered: "
              + ", ".join(f"{k:.2f}" for k in report["achieved_over_offered"]) + ")")
    print(f"plot: {png}")


def main(argv: list[str] | None = None) -> int:
    """Run the sweep: 0 when it ran, 2 for bad usage or an unreadable trace."""
    args = build_parser().parse_args(argv)
    try:
        values = _checked_values(args)
        requests, meta = read_trace(args.trace)
    except (ValueError, OSError) as exc:
        print(f"sweep: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    points = _run_points(args, values, requests, meta, out)
    tputs = [p["summary"]["overall"][args.throughput_metric] for p in points]
    sat = saturation_index(tputs, args.saturation_gain)
    png = out / "sweep.png"
    report = sweep_report(args, values, points, sat, png)
    plot_sweep(points, args.variable, sat, png, args.throughput_metric)
    (out / "sweep.json").write_text(json.dumps(report, indent=1))
    _print_report(args, points, report, png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
